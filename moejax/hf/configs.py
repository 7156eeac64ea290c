"""transformers configs -> `MoEConfig`, and which decoder layers hold an MoE block."""

from __future__ import annotations

from typing import Any

from moejax.config import MoEConfig
from moejax.hf.config_fields import HFConfig, as_dict, text_part
from moejax.hf.families import BY_MODEL_TYPE, Family
from moejax.hf.family_configs import LayerKind


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
