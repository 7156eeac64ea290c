"""One record per model family: everything moejax knows about a family's Hugging Face form, in one place.

A `Family` holds the HF `model_type`s it answers to, how its config maps to a `MoEConfig` and which decoder layers
have an MoE block (`moejax.hf.config_mapping`), the key names of transformers' in-memory block, and, per checkpoint
class, the prefix of the block on disk and its key names (`moejax.hf.keys`). Adding a family is adding one record
to `FAMILY_RECORDS` (and, if its keys are new, one `BlockKeys`).

Below the records, a config's family and what it says through it: `config_from_hf` (a transformers config ->
`MoEConfig`), `is_moe_layer` and `moe_layer_indices` (which decoder layers hold an MoE block).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from moejax.config import MoEConfig
from moejax.hf import config_mapping as fc
from moejax.hf.config_mapping import HFConfig, LayerKind, as_dict, text_part
from moejax.hf.keys import DEEPSEEK, DEEPSEEK_V4, GEMMA4, GPT_OSS, LLAMA4, LONGCAT, MIXTRAL, QWEN, STEP3P7, BlockKeys


@dataclasses.dataclass(frozen=True)
class Block:
    """Where a checkpoint class keeps the MoE block of layer L, and how its keys are laid out there.

    Attributes:
      prefix: the key prefix with `{layer}` for the layer index, e.g. `"model.layers.{layer}.mlp."`.
      keys: the block's key names under the prefix.
      checkpoint: the checkpoint class, for messages (`"MixtralForCausalLM"`).
      experts: how the routed experts are stored there ("per_expert" keys or "fused" tensors), as written by
        `save_layer`; both are read.
      composite: the class goes with the multimodal config (text part nested as `text_config`: True), the text
        config (False), or both (None); `save_layer` picks the first class that fits the config it is given.
    """

    prefix: str
    keys: BlockKeys
    checkpoint: str
    experts: Literal["fused", "per_expert"] = "per_expert"
    composite: bool | None = False

    def at(self, layer: int) -> str:
        return self.prefix.format(layer=layer)


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything about one family (see the module docstring).

    Attributes:
      name: the moejax family (`moejax.FAMILIES`).
      model_types: the HF `model_type`s of its configs (text and composite).
      config: (text config, layer index or None) -> `MoEConfig` fields.
      layer_kind: (text config, layer index) -> ("moe" | "hash_moe" | "dense", the config fields that decided it).
      memory: the key names of transformers' in-memory block (`params_from_hf` / `params_to_hf`).
      blocks: per checkpoint class, the block's prefix and on-disk key names; the first is what `save_layer` writes.
      num_layers: the config field holding the number of decoder layers with one MoE block each at most.
    """

    name: str
    model_types: tuple[str, ...]
    config: Callable[[HFConfig, int | None], dict[str, Any]]
    layer_kind: Callable[[HFConfig, int], tuple[LayerKind, str]]
    memory: BlockKeys
    blocks: tuple[Block, ...]
    num_layers: str = "num_hidden_layers"

    @property
    def block_keys(self) -> tuple[BlockKeys, ...]:
        """Every `BlockKeys` a block of this family may be in: in memory first, then the on-disk ones."""
        seen = [self.memory]
        seen += [b.keys for b in self.blocks if b.keys not in seen]
        return tuple(seen)


# -- the records -----------------------------------------------------------------------------------------------

_MLP = "model.layers.{layer}.mlp."


def _causal_lm(cls: str, keys: BlockKeys, experts: Literal["fused", "per_expert"] = "per_expert") -> tuple[Block]:
    """The usual text checkpoint: the block at `model.layers.L.mlp.`."""
    return (Block(_MLP, keys, cls, experts),)


def _block_sparse_moe(cls: str) -> tuple[Block, Block]:
    """Mixtral's and MiniMax-M2's checkpoints: the block at `block_sparse_moe.` on disk, then transformers 5's
    in-memory names at `mlp.`."""
    return (
        Block("model.layers.{layer}.block_sparse_moe.", MIXTRAL, cls),
        Block(_MLP, MIXTRAL, f"{cls}, in-memory names", "fused"),
    )


FAMILY_RECORDS: tuple[Family, ...] = (
    Family(
        "mixtral",
        ("mixtral",),
        fc.mixtral,
        fc.every_layer,
        MIXTRAL,
        _block_sparse_moe("MixtralForCausalLM"),
    ),
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        fc.qwen((60, 4, 1408, 5632, False)),
        fc.qwen_sparse_step,
        QWEN,
        _causal_lm("Qwen2MoeForCausalLM", QWEN),
    ),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        fc.qwen((128, 8, 768, 0, False), shared=False),
        fc.qwen_sparse_step,
        QWEN,
        _causal_lm("Qwen3MoeForCausalLM", QWEN),
    ),
    Family(
        "qwen3_next",
        ("qwen3_next",),
        fc.qwen((512, 10, 512, 512, True)),
        fc.qwen_sparse_step,
        QWEN,
        _causal_lm("Qwen3NextForCausalLM", QWEN),
    ),
    Family(
        "qwen3_5_moe",
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        fc.qwen((256, 8, 512, 512, True), always_normalize=True),
        fc.every_layer,
        QWEN,
        (
            Block(
                "model.language_model.layers.{layer}.mlp.", QWEN, "Qwen3_5MoeForConditionalGeneration", composite=True
            ),
            Block(_MLP, QWEN, "Qwen3_5MoeForCausalLM"),
        ),
    ),
    Family(
        "deepseek_v3",
        ("deepseek_v3",),
        fc.deepseek((256, 8, 2048, 8, 4, 2.5)),
        fc.first_k_dense(3),
        DEEPSEEK,
        _causal_lm("DeepseekV3ForCausalLM", DEEPSEEK),
    ),
    Family(
        "glm4_moe",
        ("glm4_moe",),
        fc.deepseek((128, 8, 1408, 1, 1, 1.0)),
        fc.first_k_dense(1),
        DEEPSEEK,
        _causal_lm("Glm4MoeForCausalLM", DEEPSEEK),
    ),
    Family(
        "glm_moe_dsa",
        ("glm_moe_dsa",),
        fc.deepseek((256, 8, 2048, 1, 1, 2.5)),
        fc.first_k_dense(3),
        DEEPSEEK,
        _causal_lm("GlmMoeDsaForCausalLM", DEEPSEEK),
    ),
    Family(
        "minimax_m2",
        ("minimax_m2",),
        fc.minimax_m2,
        fc.every_layer,
        MIXTRAL,
        _block_sparse_moe("MiniMaxM2ForCausalLM"),
    ),
    Family(
        "step3p7",
        ("step3p7", "step3p5"),  # the text config calls itself step3p5
        fc.step3p7,
        fc.step3p7_kind,
        DEEPSEEK,
        (
            Block("model.layers.{layer}.", STEP3P7, "Step3p7ForConditionalGeneration", "fused", None),
            Block(
                "model.language_model.layers.{layer}.mlp.",
                DEEPSEEK,
                "Step3p7ForConditionalGeneration, in-memory names",
                composite=True,
            ),
        ),
    ),
    Family(
        "longcat_flash",
        ("longcat_flash",),
        fc.longcat_flash,
        fc.every_layer,
        LONGCAT,
        _causal_lm("LongcatFlashForCausalLM", LONGCAT),
        # num_hidden_layers counts its two sublayers per decoder layer; one MoE per `num_layers`.
        num_layers="num_layers",
    ),
    Family(
        "deepseek_v4",
        ("deepseek_v4",),
        fc.deepseek_v4,
        fc.deepseek_v4_kind,
        DEEPSEEK,
        (
            Block("model.layers.{layer}.ffn.", DEEPSEEK_V4, "DeepseekV4ForCausalLM"),
            Block("layers.{layer}.ffn.", DEEPSEEK_V4, "DeepseekV4ForCausalLM, original release prefix"),
            Block(_MLP, DEEPSEEK, "DeepseekV4ForCausalLM, in-memory names", "fused"),
        ),
    ),
    Family(
        "gemma4",
        ("gemma4", "gemma4_text"),
        fc.gemma4,
        fc.gemma4_kind,
        GEMMA4,
        (
            Block("model.language_model.layers.{layer}.", GEMMA4, "Gemma4ForConditionalGeneration", "fused", True),
            Block("model.layers.{layer}.", GEMMA4, "Gemma4ForCausalLM", "fused"),
        ),
    ),
    Family(
        "gpt_oss",
        ("gpt_oss",),
        fc.gpt_oss,
        fc.every_layer,
        GPT_OSS,
        _causal_lm("GptOssForCausalLM", GPT_OSS, "fused"),
    ),
    Family(
        "llama4",
        ("llama4", "llama4_text"),
        fc.llama4,
        fc.llama4_kind,
        LLAMA4,
        (
            Block(
                "language_model.model.layers.{layer}.feed_forward.",
                LLAMA4,
                "Llama4ForConditionalGeneration",
                "fused",
                True,
            ),
            Block("model.layers.{layer}.feed_forward.", LLAMA4, "Llama4ForCausalLM", "fused"),
        ),
    ),
    Family("olmoe", ("olmoe",), fc.olmoe, fc.every_layer, QWEN, _causal_lm("OlmoeForCausalLM", QWEN)),
)

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILY_RECORDS}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILY_RECORDS for t in f.model_types}


# -- a config's family: its MoEConfig and its MoE layers -------------------------------------------------------


def family_config(hf_config: Any) -> tuple[Family, HFConfig]:
    """The family record of `hf_config` and its text part (multimodal configs nest it as `text_config`)."""
    values, outer_type = text_part(hf_config)
    model_type = values.get("model_type")
    family = BY_MODEL_TYPE.get(model_type) or BY_MODEL_TYPE.get(outer_type)
    if family is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(BY_MODEL_TYPE)}")
    return family, HFConfig(values, model_type)


def is_composite(hf_config: Any) -> bool:
    """Whether `hf_config` is a multimodal config with its text part nested as `text_config`."""
    return as_dict(hf_config).get("text_config") is not None


def num_layers(family: Family, c: HFConfig) -> int | None:
    return c.get(family.num_layers)


def _check_layer(family: Family, c: HFConfig, layer: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer_idx must be an int >= 0, got {layer!r}")
    n = num_layers(family, c)
    if n is not None and layer >= n:
        raise ValueError(f"layer_idx={layer} is out of range: the {c.model_type} config has {n} layers")


def layer_kind(hf_config: Any, layer_idx: int) -> tuple[LayerKind, str]:
    """("moe" | "hash_moe" | "dense", the config fields that decided it) for decoder layer `layer_idx`."""
    family, c = family_config(hf_config)
    _check_layer(family, c, layer_idx)
    return family.layer_kind(c, layer_idx)


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` of this HF config has an MoE block (False: a dense MLP)."""
    return layer_kind(hf_config, layer_idx)[0] != "dense"


def moe_layer_indices(hf_config: Any) -> list[int]:
    """The decoder layers of this HF config (a transformers config, its dict or `config.json`'s) that hold an
    MoE block, in order. Needs the config's layer count (`num_hidden_layers`; LongCat's `num_layers`)."""
    family, c = family_config(hf_config)
    n = num_layers(family, c)
    if n is None:
        raise ValueError(f"the {c.model_type} config has no {family.num_layers!r}: cannot list its layers")
    return [i for i in range(n) if family.layer_kind(c, i)[0] != "dense"]


def config_from_hf(hf_config: Any, layer_idx: int | None = None) -> MoEConfig:
    """The `MoEConfig` of the MoE block of a Hugging Face model config.

    Args:
      hf_config: a transformers `PretrainedConfig` (anything with `to_dict()`), an object with attributes, or the
        config dict (`config.json`); a multimodal config is read through its `text_config`. Every spelling of a
        field is read (transformers 5's `num_local_experts` as older configs' `num_experts`, ...); keys absent
        under every spelling take the transformers defaults listed in docs/FAMILIES.md.
      layer_idx: the decoder layer, for settings that vary per layer (DeepSeek-V4 hash / top-k layers, Step-3.7
        clamps). Needed only where they do vary; when given, it must be an MoE layer.
    Raises:
      ValueError: unsupported `model_type`; `layer_idx` needed but None, out of range, or a dense-MLP layer;
        two spellings of one field with different values.
      NotImplementedError: a valid HF setting moejax does not implement (an unknown activation, biases on
        the Step-3.7 / DeepSeek-V4 shared expert).
    """
    family, c = family_config(hf_config)
    if layer_idx is not None:
        _check_layer(family, c, layer_idx)
        kind, reason = family.layer_kind(c, layer_idx)
        if kind == "dense":
            raise ValueError(
                f"layer_idx={layer_idx} of this {c.model_type} config is a dense MLP ({reason}), not an MoE block"
            )
    return MoEConfig(**family.config(c, layer_idx))
