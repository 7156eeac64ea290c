"""One record per model family: everything moejax knows about a family's Hugging Face form, in one place.

A `Family` holds the HF `model_type`s it answers to, how its config maps to a `MoEConfig`, which decoder layers
have an MoE block (and of which kind), the key layout of transformers' in-memory block, and, per checkpoint
class, the prefix of the block on disk and its key layout. Adding a family is adding one record to `FAMILY_RECORDS`
(and, if its keys are new, one `KeyLayout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from moejax.config import Activation, ClampOrder, ScalingTarget, ScoreOrder, Scoring, SharedExpert
from moejax.hf.hfconfig import NUM_EXPERTS, HFConfig
from moejax.hf.layouts import W1_W3_W2, KeyLayout

# -- key layouts -----------------------------------------------------------------------------------------------

# Keys of the decoder layer that sit beside the block in layouts whose keys are relative to the decoder layer.
_DECODER_SIBLINGS = ("self_attn", "input_layernorm", "post_attention_layernorm")

QWEN = KeyLayout("qwen", router="gate.weight", shared_prefix="shared_expert.")
DEEPSEEK = KeyLayout("deepseek", router="gate.weight", shared_prefix="shared_experts.")
# Mixtral's and MiniMax-M2's checkpoints (`block_sparse_moe.`): w1/w3/w2 experts, MiniMax's bias on the block.
MIXTRAL = KeyLayout(
    "mixtral", router="gate.weight", expert_names=W1_W3_W2, correction=("e_score_correction_bias", "gate.bias")
)
DEEPSEEK_V4 = KeyLayout(  # the original DeepSeek-V4 release (`layers.L.ffn.`)
    "deepseek_v4",
    router="gate.weight",
    correction=("gate.bias", "gate.e_score_correction_bias", "e_score_correction_bias"),
    expert_names=W1_W3_W2,
    shared_names=W1_W3_W2,
)
STEP3P7 = KeyLayout(  # Step-3.7 on disk: keys relative to the decoder layer, experts stacked per layer
    "step3p7",
    router="moe.gate.weight",
    correction=("moe.router_bias",),
    experts="stacked_moe",
    shared_prefix="share_expert.",
    decoder_layer=True,
    ignored=_DECODER_SIBLINGS,
)
LONGCAT = KeyLayout(
    "longcat_flash",
    router="router.classifier.weight",
    correction=("router.e_score_correction_bias",),
    zero_expert_rows=True,
    ignored=("router.classifier.bias",),  # exists with router_bias=True, never applied (FAMILIES.md §19.1)
)
GEMMA4 = KeyLayout(  # no block module: router and experts sit on the decoder layer
    "gemma4",
    router="router.proj.weight",
    decoder_layer=True,
    ignored=(
        *_DECODER_SIBLINGS,
        # The dense branch, the post norms and the per-layer-input branch stay with the model.
        "mlp",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_feedforward_layernorm_1",
        "post_feedforward_layernorm_2",
        "per_layer_input_gate",
        "per_layer_projection",
        "post_per_layer_input_norm",
        "layer_scalar",
    ),
)
GPT_OSS = KeyLayout("gpt_oss", router="router.weight", experts="gpt_oss", identify=("router.bias",))
LLAMA4 = KeyLayout(
    "llama4",
    router="router.weight",
    experts="llama4",
    shared_prefix="shared_expert.",
    identify=("shared_expert.down_proj.weight",),
)
LAYOUTS = (QWEN, DEEPSEEK, MIXTRAL, DEEPSEEK_V4, STEP3P7, LONGCAT, GEMMA4, GPT_OSS, LLAMA4)


@dataclasses.dataclass(frozen=True)
class Block:
    """Where a checkpoint class keeps the MoE block of layer L, and how its keys are laid out there.

    Attributes:
      prefix: the key prefix with `{layer}` for the layer index, e.g. `"model.layers.{layer}.mlp."`.
      layout: the block's key layout under the prefix.
      checkpoint: the checkpoint class, for messages (`"MixtralForCausalLM"`).
      experts: how the routed experts are stored there ("per_expert" keys or "fused" tensors), as written by
        `save_layer`; both are read.
      composite: the class goes with the multimodal config (text part nested as `text_config`: True), the text
        config (False), or both (None); `save_layer` picks the first class that fits the config it is given.
    """

    prefix: str
    layout: KeyLayout
    checkpoint: str
    experts: Literal["fused", "per_expert"] = "per_expert"
    composite: bool | None = False

    def at(self, layer: int) -> str:
        return self.prefix.format(layer=layer)


LayerKind = Literal["moe", "hash_moe", "dense"]


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything about one family (see the module docstring).

    Attributes:
      name: the moejax family (`moejax.FAMILIES`).
      model_types: the HF `model_type`s of its configs (text and composite).
      config: (text config, layer index or None) -> `MoEConfig` fields.
      layer_kind: (text config, layer index) -> ("moe" | "hash_moe" | "dense", the config fields that decided it).
      memory: the key layout of transformers' in-memory block (`params_from_hf` / `params_to_hf`).
      blocks: per checkpoint class, the block's prefix and on-disk layout; the first is what `save_layer` writes.
      num_layers: the config field holding the number of decoder layers with one MoE block each at most.
    """

    name: str
    model_types: tuple[str, ...]
    config: Callable[[HFConfig, int | None], dict[str, Any]]
    layer_kind: Callable[[HFConfig, int], tuple[LayerKind, str]]
    memory: KeyLayout
    blocks: tuple[Block, ...]
    num_layers: str = "num_hidden_layers"

    @property
    def layouts(self) -> tuple[KeyLayout, ...]:
        """Every layout a block of this family may be in: in memory first, then the on-disk ones."""
        seen = [self.memory]
        seen += [b.layout for b in self.blocks if b.layout not in seen]
        return tuple(seen)


# -- which layers are MoE --------------------------------------------------------------------------------------


def every_layer(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    return "moe", "every layer is MoE"


def _from_type_list(c: HFConfig, name: str, layer: int) -> str:
    types = c.values[name]
    if layer >= len(types):
        raise ValueError(f"layer_idx={layer} is out of range for {name} of length {len(types)}")
    return types[layer]


def _first_k_dense(default: int) -> Callable[[HFConfig, int], tuple[LayerKind, str]]:
    """DeepSeek-style: `mlp_layer_types` when the config has it, else the first `first_k_dense_replace` dense."""

    def kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
        if c.get("mlp_layer_types") is not None:
            name = _from_type_list(c, "mlp_layer_types", layer)
            return ("dense" if name == "dense" else "moe"), f"mlp_layer_types[{layer}]={name!r}"
        k = c.get("first_k_dense_replace", default=default)
        return ("dense" if layer < k else "moe"), f"first_k_dense_replace={k}"

    return kind


def _qwen_sparse_step(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    only, step = c.get("mlp_only_layers", default=[]), c.get("decoder_sparse_step", default=1)
    sparse = layer not in only and c.one_of(NUM_EXPERTS, 1) > 0 and (layer + 1) % step == 0
    return ("moe" if sparse else "dense"), f"mlp_only_layers={only}, decoder_sparse_step={step}"


def _moe_layers_enum(c: HFConfig) -> list[int] | None:
    enum = c.get("moe_layers_enum")
    if isinstance(enum, str):
        return [int(i) for i in enum.split(",") if i.strip()]
    return None if enum is None else [int(i) for i in enum]


def _step3p7_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    if c.get("mlp_layer_types") is not None:
        name = _from_type_list(c, "mlp_layer_types", layer)
        return ("dense" if name == "dense" else "moe"), f"mlp_layer_types[{layer}]={name!r}"
    enum = _moe_layers_enum(c)
    if enum is not None:
        return ("moe" if layer in enum else "dense"), "moe_layers_enum"
    return ("dense" if layer < 3 else "moe"), "the default (layers 0-2 dense)"


def _deepseek_v4_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    if c.get("mlp_layer_types") is not None:
        return _from_type_list(c, "mlp_layer_types", layer), f"mlp_layer_types[{layer}]"
    n_hash = c.get("num_hash_layers", default=3)
    return ("hash_moe" if layer < n_hash else "moe"), f"num_hash_layers={n_hash}"


def _llama4_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    moe_layers = c.get("moe_layers")
    if moe_layers is not None:
        return ("moe" if layer in moe_layers else "dense"), f"moe_layers={moe_layers}"
    step = c.get("interleave_moe_layer_step", default=1)
    return ("moe" if (layer + 1) % step == 0 else "dense"), f"interleave_moe_layer_step={step}"


def _gemma4_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    if not c.get("enable_moe_block", default=False):
        return "dense", "enable_moe_block=False"
    return "moe", "enable_moe_block=True"


def _per_layer(c: HFConfig, kind: Callable, layer: int | None, name: str, values: list[Any]) -> Any:
    """`values[layer]`, or the one value all MoE layers share when `layer` is None (else ValueError)."""
    if layer is not None:
        if layer >= len(values):
            raise ValueError(f"layer_idx={layer} is out of range for {name} of length {len(values)}")
        return values[layer]
    distinct = {values[i] for i in range(len(values)) if kind(c, i)[0] != "dense"}
    if len(distinct) > 1:
        raise ValueError(
            f"{c.model_type}: {name} differs between MoE layers ({sorted(distinct, key=str)}): pass layer_idx"
        )
    return distinct.pop() if distinct else None


# -- config mappings -------------------------------------------------------------------------------------------


def _mixtral(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("intermediate_size",), (8, 2, 14336)),
        "normalize": True,
        "router_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


def _qwen(defaults: tuple[int, int, int, int, bool], *, always_normalize: bool = False, shared: bool = True):
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next / Qwen3.5 with their class defaults (E, k, I, shared I, norm_topk_prob).
    Qwen3.5's router always renormalises (it has no norm_topk_prob)."""
    E, k, I, Is, norm = defaults

    def fields(c: HFConfig, layer: int | None) -> dict:
        out = {
            **c.sizes(("moe_intermediate_size",), (E, k, I)),
            "normalize": always_normalize or bool(c.get("norm_topk_prob", default=norm)),
            "router_dtype": "input",
            "weights_dtype": "input",
            "activation": c.activation("hidden_act"),
        }
        if shared:
            out["shared_expert"] = SharedExpert.SIGMOID_GATED
            out["shared_intermediate_size"] = c.get("shared_expert_intermediate_size", default=Is)
        return out

    return fields


def _olmoe(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("intermediate_size",), (64, 8, 2048)),
        "normalize": bool(c.get("norm_topk_prob", default=False)),
        "router_dtype": "input",
        "weights_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


def _deepseek(defaults: tuple[int, int, int, int, int, float]):
    """DeepSeek-V3 and its copies (GLM-4.5, GLM-5), class defaults (E, k, I, n_group, topk_group, scaling)."""
    E, k, I, n_group, topk_group, rsf = defaults

    def fields(c: HFConfig, layer: int | None) -> dict:
        out = {
            **c.sizes(("moe_intermediate_size",), (E, k, I)),
            "scoring": Scoring.SIGMOID,
            "correction_bias": True,
            "n_group": c.get("n_group", default=n_group),
            "topk_group": c.get("topk_group", default=topk_group),
            "normalize": bool(c.get("norm_topk_prob", default=True)),
            "norm_epsilon": 1e-20,
            "routed_scaling_factor": float(c.get("routed_scaling_factor", default=rsf)),
            "activation": c.activation("hidden_act"),
        }
        n_shared = c.get("n_shared_experts", default=1)
        if n_shared:
            out["shared_expert"] = SharedExpert.UNGATED
            out["shared_intermediate_size"] = out["intermediate_size"] * n_shared
        return out

    return fields


def _minimax_m2(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("intermediate_size",), (256, 8, 1536)),
        "scoring": Scoring.SIGMOID,
        "correction_bias": True,
        "normalize": True,
        "router_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


def _limit(value: Any) -> float | None:
    """Step-3.7's per-layer clamp: None or 0 means no clamp."""
    return None if value is None or value == 0 else float(value)


def _step3p7(c: HFConfig, layer: int | None) -> dict:
    if c.get("mlp_bias", default=False):
        raise NotImplementedError("step3p7 with mlp_bias=True (biases on the shared expert) is not supported")
    fields = {
        **c.sizes(("moe_intermediate_size",), (288, 8, 1280)),
        "scoring": Scoring.SIGMOID,
        "correction_bias": True,
        "normalize": True,
        "router_dtype": "input",
        # The routed sum (not the weights) is scaled; hidden_act is forced to silu by Step3p7TextConfig.
        "scaling_target": ScalingTarget.OUTPUT,
        "routed_scaling_factor": float(c.get("moe_router_scaling_factor", default=1.0)),
        "clamp_order": ClampOrder.AFTER_ACTIVATION,
    }
    limits = c.get("swiglu_limits")
    if limits is not None:
        fields["swiglu_limit"] = _per_layer(c, _step3p7_kind, layer, "swiglu_limits", [_limit(v) for v in limits])
    shared = c.one_of(("share_expert_dim", "share_expert_dims"), 1280)
    if isinstance(shared, list | tuple):
        shared = _per_layer(c, _step3p7_kind, layer, "share_expert_dims", list(shared))
    if shared:
        fields["shared_expert"] = SharedExpert.UNGATED
        fields["shared_intermediate_size"] = shared
        shared_limits = c.get("swiglu_limits_shared")
        if shared_limits is not None:
            values = [_limit(v) for v in shared_limits]
            fields["shared_swiglu_limit"] = _per_layer(c, _step3p7_kind, layer, "swiglu_limits_shared", values)
    return fields


def _longcat_flash(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("expert_ffn_hidden_size", "moe_intermediate_size"), (512, 12, 2048)),
        "num_zero_experts": c.get("zero_expert_num", default=256),
        "correction_bias": True,
        "routed_scaling_factor": float(c.get("routed_scaling_factor", default=6.0)),
        "activation": c.activation("hidden_act"),
    }


def _deepseek_v4_uniform_kind(c: HFConfig) -> str:
    """The one kind (hash or top-k) of every layer, for a call without layer_idx (else ValueError)."""
    n = c.get("num_hidden_layers")
    if c.get("mlp_layer_types") is not None:
        kinds = set(c.values["mlp_layer_types"])
    elif n is not None:
        kinds = {_deepseek_v4_kind(c, i)[0] for i in range(n)}
    else:
        kinds = {"hash_moe", "moe"} if c.get("num_hash_layers", default=3) else {"moe"}
    if len(kinds) > 1:
        raise ValueError(
            f"{c.model_type}: layers differ ({sorted(kinds)}: hash routing or top-k); pass layer_idx to choose"
        )
    return kinds.pop()


def _deepseek_v4(c: HFConfig, layer: int | None) -> dict:
    if c.get("mlp_bias", default=False):
        raise NotImplementedError("deepseek_v4 with mlp_bias=True (biases on the shared expert) is not supported")
    scoring = c.get("scoring_func", default="sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        # transformers raises KeyError for "softmax" too (ACT2FN has no softmax; FAMILIES.md §19.3).
        raise ValueError(f"deepseek_v4 scoring_func={scoring!r} is not one of ['sqrtsoftplus', 'sigmoid']")
    sizes = c.sizes(("moe_intermediate_size", "intermediate_size"), (256, 6, 2048))
    limit = c.get("swiglu_limit", default=10.0)
    fields = {
        **sizes,
        "scoring": Scoring(scoring),
        "normalize": True,  # norm_topk_prob is ignored by the block
        "norm_epsilon": 1e-20,
        "routed_scaling_factor": float(c.get("routed_scaling_factor", default=1.5)),
        "swiglu_limit": None if limit is None else float(limit),
        "clamp_order": ClampOrder.BEFORE_ACTIVATION,
        # The shared MLP's width is `intermediate_size`, an alias of moe_intermediate_size; n_shared_experts unread.
        "shared_expert": SharedExpert.UNGATED,
        "shared_intermediate_size": sizes["intermediate_size"],
        "shared_swiglu_limit": None if limit is None else float(limit),
        "router_dtype": "input",
        "weights_dtype": "input",
        "activation": c.activation("hidden_act"),
    }
    kind = _deepseek_v4_kind(c, layer)[0] if layer is not None else _deepseek_v4_uniform_kind(c)
    if kind == "hash_moe":
        fields |= {"hash_routing": True, "vocab_size": c.get("vocab_size", default=129280)}
    else:
        fields["correction_bias"] = True
    return fields


def _gemma4(c: HFConfig, layer: int | None) -> dict:
    if not c.get("enable_moe_block", default=False):
        raise ValueError(f"{c.model_type} config has enable_moe_block=False: its layers have no MoE block")
    return {
        "hidden_size": c.require("hidden_size"),
        "num_experts": c.require("num_experts"),
        "top_k": c.require("top_k_experts"),
        "intermediate_size": c.require("moe_intermediate_size"),
        "normalize": True,
        "per_expert_scale": True,
        "router_prenorm": True,
        "expert_prenorm": True,
        "rms_norm_eps": float(c.get("rms_norm_eps", default=1e-6)),
        "activation": c.activation("hidden_activation", default="gelu_pytorch_tanh"),
        "router_dtype": "input",
    }


def _gpt_oss(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("intermediate_size",), (128, 4, 2880)),
        "score_order": ScoreOrder.AFTER_TOPK,
        "router_bias": True,
        "activation": Activation.GPT_OSS,  # hidden_act is not used by the experts
        "swiglu_limit": float(c.get("swiglu_limit", default=7.0)),
        "swiglu_alpha": float(c.get("swiglu_alpha", default=1.702)),
        "expert_bias": True,
        "router_dtype": "input",
        "weights_dtype": "input",
    }


def _llama4(c: HFConfig, layer: int | None) -> dict:
    sizes = c.sizes(("intermediate_size",), (16, 1, 8192))
    return {
        **sizes,
        "scoring": Scoring.SIGMOID,
        "score_order": ScoreOrder.AFTER_TOPK,
        "weights_on_input": True,
        "shared_expert": SharedExpert.UNGATED,
        "shared_intermediate_size": sizes["intermediate_size"],  # the shared MLP is as wide as an expert
        "router_dtype": "input",
        "weights_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


# -- the records -----------------------------------------------------------------------------------------------

_MLP = "model.layers.{layer}.mlp."


def _causal_lm(cls: str, layout: KeyLayout, experts: Literal["fused", "per_expert"] = "per_expert") -> tuple[Block]:
    """The usual text checkpoint: the block at `model.layers.L.mlp.`."""
    return (Block(_MLP, layout, cls, experts),)


FAMILY_RECORDS: tuple[Family, ...] = (
    Family(
        "mixtral",
        ("mixtral",),
        _mixtral,
        every_layer,
        MIXTRAL,
        (
            Block("model.layers.{layer}.block_sparse_moe.", MIXTRAL, "MixtralForCausalLM"),
            Block(_MLP, MIXTRAL, "MixtralForCausalLM, in-memory names", "fused"),
        ),
    ),
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        _qwen((60, 4, 1408, 5632, False)),
        _qwen_sparse_step,
        QWEN,
        _causal_lm("Qwen2MoeForCausalLM", QWEN),
    ),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        _qwen((128, 8, 768, 0, False), shared=False),
        _qwen_sparse_step,
        QWEN,
        _causal_lm("Qwen3MoeForCausalLM", QWEN),
    ),
    Family(
        "qwen3_next",
        ("qwen3_next",),
        _qwen((512, 10, 512, 512, True)),
        _qwen_sparse_step,
        QWEN,
        _causal_lm("Qwen3NextForCausalLM", QWEN),
    ),
    Family(
        "qwen3_5_moe",
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        _qwen((256, 8, 512, 512, True), always_normalize=True),
        every_layer,
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
        _deepseek((256, 8, 2048, 8, 4, 2.5)),
        _first_k_dense(3),
        DEEPSEEK,
        _causal_lm("DeepseekV3ForCausalLM", DEEPSEEK),
    ),
    Family(
        "glm4_moe",
        ("glm4_moe",),
        _deepseek((128, 8, 1408, 1, 1, 1.0)),
        _first_k_dense(1),
        DEEPSEEK,
        _causal_lm("Glm4MoeForCausalLM", DEEPSEEK),
    ),
    Family(
        "glm_moe_dsa",
        ("glm_moe_dsa",),
        _deepseek((256, 8, 2048, 1, 1, 2.5)),
        _first_k_dense(3),
        DEEPSEEK,
        _causal_lm("GlmMoeDsaForCausalLM", DEEPSEEK),
    ),
    Family(
        "minimax_m2",
        ("minimax_m2",),
        _minimax_m2,
        every_layer,
        MIXTRAL,
        (
            Block("model.layers.{layer}.block_sparse_moe.", MIXTRAL, "MiniMaxM2ForCausalLM"),
            Block(_MLP, MIXTRAL, "MiniMaxM2ForCausalLM, in-memory names", "fused"),
        ),
    ),
    Family(
        "step3p7",
        ("step3p7", "step3p5"),  # the text config calls itself step3p5
        _step3p7,
        _step3p7_kind,
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
        _longcat_flash,
        every_layer,
        LONGCAT,
        _causal_lm("LongcatFlashForCausalLM", LONGCAT),
        # num_hidden_layers counts its two sublayers per decoder layer; one MoE per `num_layers`.
        num_layers="num_layers",
    ),
    Family(
        "deepseek_v4",
        ("deepseek_v4",),
        _deepseek_v4,
        _deepseek_v4_kind,
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
        _gemma4,
        _gemma4_kind,
        GEMMA4,
        (
            Block("model.language_model.layers.{layer}.", GEMMA4, "Gemma4ForConditionalGeneration", "fused", True),
            Block("model.layers.{layer}.", GEMMA4, "Gemma4ForCausalLM", "fused"),
        ),
    ),
    Family(
        "gpt_oss",
        ("gpt_oss",),
        _gpt_oss,
        every_layer,
        GPT_OSS,
        _causal_lm("GptOssForCausalLM", GPT_OSS, "fused"),
    ),
    Family(
        "llama4",
        ("llama4", "llama4_text"),
        _llama4,
        _llama4_kind,
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
    Family("olmoe", ("olmoe",), _olmoe, every_layer, QWEN, _causal_lm("OlmoeForCausalLM", QWEN)),
)

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILY_RECORDS}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILY_RECORDS for t in f.model_types}
