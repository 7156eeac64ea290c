"""Hugging Face interop: transformers configs, state dicts and safetensors checkpoints -> moejax.

* `config_from_hf(hf_config, layer_idx=None)` reads a transformers config (object or dict, also a multimodal one
  with a nested `text_config`) of any family in FAMILIES.md and returns the `MoEConfig` of its MoE block.
* `params_from_hf(state_dict, cfg)` converts the tensors of one block (keys relative to the block) into
  `MoEParams`, from either layout found in the wild: the fused in-memory tensors of transformers 5
  (`experts.gate_up_proj`, ...) or the per-expert checkpoint keys (`experts.{e}.gate_proj.weight`, Mixtral's
  `w1/w3/w2`, Step-3.7's stacked `moe.*`, gpt-oss's MXFP4 blocks). `params_to_hf` is its inverse.
* `load_safetensors(files, cfg, prefix)` reads one block from a (sharded) safetensors checkpoint.

The HF layout is chosen from the config, because shapes alone are ambiguous (H == 2I):

| layout kind | families (config flags that identify it) | router key |
|---|---|---|
| standard | Mixtral, Qwen*, OLMoE, DeepSeek-V3/V4, GLM, MiniMax-M2, Step-3.7 | `gate.weight` |
| step_disk | Step-3.7 on disk (`moe.gate.weight` present; keys relative to the decoder layer) | `moe.gate.weight` |
| longcat | LongCat-Flash (softmax scoring with a correction bias) | `router.classifier.weight` |
| gemma4 | Gemma-4 (router_prenorm; keys relative to the decoder layer) | `router.proj.weight` |
| gpt_oss | gpt-oss (activation="gpt_oss"): transposed, interleaved gate/up, biases | `router.weight` |
| llama4 | Llama-4 (weights_on_input): transposed, concatenated gate/up | `router.weight` |
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.config import Activation, ClampOrder, MoEConfig, ScalingTarget, ScoreOrder, Scoring, SharedExpert
from moejax.params import MoEParams, check_params, flatten, unflatten, with_experts_layout
from moejax.weights import ExpertWeights, Layout, from_host

# -------------------------------------------------------------------------------------------------------------
# Config
# -------------------------------------------------------------------------------------------------------------

# HF model_type -> moejax family (FAMILIES.md). Step-3.7's text config calls itself "step3p5".
MODEL_TYPES: dict[str, str] = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    "glm_moe_dsa": "glm_moe_dsa",
    "minimax_m2": "minimax_m2",
    "step3p5": "step3p7",
    "step3p7": "step3p7",
    "longcat_flash": "longcat_flash",
    "deepseek_v4": "deepseek_v4",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "gpt_oss": "gpt_oss",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "olmoe": "olmoe",
}

_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}


class _HFConfig:
    """A flat HF text config with alias-aware lookups; a value of None counts as absent (HF treats it so)."""

    def __init__(self, values: Mapping[str, Any], family: str, model_type: str):
        self.values = values
        self.family = family
        self.model_type = model_type

    def get(self, *names: str, default: Any = None) -> Any:
        for name in names:
            if self.values.get(name) is not None:
                return self.values[name]
        return default

    def require(self, *names: str) -> Any:
        value = self.get(*names)
        if value is None:
            raise ValueError(f"{self.model_type} config needs {' or '.join(map(repr, names))} to build an MoE block")
        return value

    def activation(self, *names: str, default: str = "silu") -> Activation:
        name = self.get(*names, default=default)
        if name not in _ACTIVATIONS:
            raise NotImplementedError(f"{self.model_type}: {names[0]}={name!r} is not one of {sorted(_ACTIVATIONS)}")
        return _ACTIVATIONS[name]


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    if hasattr(hf_config, "__dict__"):
        return {k: v for k, v in vars(hf_config).items() if not k.startswith("_")}
    raise TypeError(f"hf_config must be a transformers config, a mapping or an object, got {type(hf_config).__name__}")


def _text_config(hf_config: Any) -> _HFConfig:
    """The text part of `hf_config` (multimodal configs nest it as `text_config`), with its family."""
    values = _as_dict(hf_config)
    if values.get("text_config") is not None:
        outer_type = values.get("model_type")
        values = _as_dict(values["text_config"])
        values.setdefault("model_type", outer_type)
    model_type = values.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return _HFConfig(values, MODEL_TYPES[model_type], model_type)


# -- which layers have an MoE block ----------------------------------------------------------------------------


def _num_layers(c: _HFConfig) -> int | None:
    # LongCat's num_hidden_layers counts its two sublayers per decoder layer; one MoE per `num_layers`.
    return c.get("num_layers") if c.family == "longcat_flash" else c.get("num_hidden_layers")


def _from_type_list(c: _HFConfig, name: str, layer: int) -> str:
    types = c.values[name]
    if layer >= len(types):
        raise ValueError(f"layer_idx={layer} is out of range for {name} of length {len(types)}")
    return types[layer]


def _moe_layers_enum(c: _HFConfig) -> list[int] | None:
    enum = c.get("moe_layers_enum")
    if isinstance(enum, str):
        return [int(i) for i in enum.split(",") if i.strip()]
    return None if enum is None else [int(i) for i in enum]


def _layer_type(c: _HFConfig, layer: int) -> tuple[str, str]:
    """("moe" | "hash_moe" | "dense", the config fields that decided it) for decoder layer `layer`."""
    f = c.family
    if f in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        only, step = c.get("mlp_only_layers", default=[]), c.get("decoder_sparse_step", default=1)
        sparse = layer not in only and c.get("num_experts", default=1) > 0 and (layer + 1) % step == 0
        return ("moe" if sparse else "dense"), f"mlp_only_layers={only}, decoder_sparse_step={step}"
    if f == "deepseek_v3" or (f == "glm4_moe" and c.get("mlp_layer_types") is None):
        k = c.get("first_k_dense_replace", default=3 if f == "deepseek_v3" else 1)
        return ("dense" if layer < k else "moe"), f"first_k_dense_replace={k}"
    if f in ("glm4_moe", "glm_moe_dsa", "step3p7") and c.get("mlp_layer_types") is not None:
        kind = _from_type_list(c, "mlp_layer_types", layer)
        return ("dense" if kind == "dense" else "moe"), f"mlp_layer_types[{layer}]={kind!r}"
    if f == "glm_moe_dsa":
        k = c.get("first_k_dense_replace", default=3)
        return ("dense" if layer < k else "moe"), f"first_k_dense_replace={k}"
    if f == "step3p7":
        enum = _moe_layers_enum(c)
        if enum is not None:
            return ("moe" if layer in enum else "dense"), "moe_layers_enum"
        return ("dense" if layer < 3 else "moe"), "the default (layers 0-2 dense)"
    if f == "deepseek_v4":
        if c.get("mlp_layer_types") is not None:
            return _from_type_list(c, "mlp_layer_types", layer), f"mlp_layer_types[{layer}]"
        n_hash = c.get("num_hash_layers", default=3)
        return ("hash_moe" if layer < n_hash else "moe"), f"num_hash_layers={n_hash}"
    if f == "llama4":
        moe_layers = c.get("moe_layers")
        if moe_layers is not None:
            return ("moe" if layer in moe_layers else "dense"), f"moe_layers={moe_layers}"
        step = c.get("interleave_moe_layer_step", default=1)
        return ("moe" if (layer + 1) % step == 0 else "dense"), f"interleave_moe_layer_step={step}"
    if f == "gemma4" and not c.get("enable_moe_block", default=False):
        return "dense", "enable_moe_block=False"
    return "moe", "every layer is MoE"


def _check_layer(c: _HFConfig, layer: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer_idx must be an int >= 0, got {layer!r}")
    n = _num_layers(c)
    if n is not None and layer >= n:
        raise ValueError(f"layer_idx={layer} is out of range: the {c.model_type} config has {n} layers")


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` of this HF config has an MoE block (False: a dense MLP)."""
    c = _text_config(hf_config)
    _check_layer(c, layer_idx)
    return _layer_type(c, layer_idx)[0] != "dense"


def _moe_layer_indices(c: _HFConfig, length: int) -> list[int]:
    return [i for i in range(length) if _layer_type(c, i)[0] != "dense"]


def _per_layer(c: _HFConfig, layer: int | None, name: str, values: list[Any]) -> Any:
    """`values[layer]`, or the one value all MoE layers share when `layer` is None (else ValueError)."""
    if layer is not None:
        if layer >= len(values):
            raise ValueError(f"layer_idx={layer} is out of range for {name} of length {len(values)}")
        return values[layer]
    distinct = {values[i] for i in _moe_layer_indices(c, len(values))}
    if len(distinct) > 1:
        raise ValueError(
            f"{c.model_type}: {name} differs between MoE layers ({sorted(distinct, key=str)}): pass layer_idx"
        )
    return distinct.pop() if distinct else None


# -- per-family fields -----------------------------------------------------------------------------------------


def _sizes(
    c: _HFConfig, experts: tuple[str, ...], k: tuple[str, ...], inter: tuple[str, ...], defaults: tuple[int, int, int]
) -> dict:
    e_default, k_default, i_default = defaults
    return {
        "hidden_size": c.require("hidden_size"),
        "num_experts": c.get(*experts, default=e_default),
        "top_k": c.get(*k, default=k_default),
        "intermediate_size": c.get(*inter, default=i_default),
    }


def _mixtral(c: _HFConfig, layer: int | None) -> dict:
    return {
        **_sizes(c, ("num_local_experts",), ("num_experts_per_tok",), ("intermediate_size",), (8, 2, 14336)),
        "normalize": True,
        "router_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


_QWEN_DEFAULTS = {  # (E, k, I, shared I, norm_topk_prob)
    "qwen2_moe": (60, 4, 1408, 5632, False),
    "qwen3_moe": (128, 8, 768, 0, False),
    "qwen3_next": (512, 10, 512, 512, True),
    "qwen3_5_moe": (256, 8, 512, 512, True),
}


def _qwen(c: _HFConfig, layer: int | None) -> dict:
    E, k, I, Is, norm = _QWEN_DEFAULTS[c.family]
    fields = {
        **_sizes(c, ("num_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",), (E, k, I)),
        # Qwen3.5's router always renormalises (it has no norm_topk_prob).
        "normalize": True if c.family == "qwen3_5_moe" else bool(c.get("norm_topk_prob", default=norm)),
        "router_dtype": "input",
        "weights_dtype": "input",
        "activation": c.activation("hidden_act"),
    }
    if c.family != "qwen3_moe":
        fields["shared_expert"] = SharedExpert.SIGMOID_GATED
        fields["shared_intermediate_size"] = c.get("shared_expert_intermediate_size", default=Is)
    return fields


def _olmoe(c: _HFConfig, layer: int | None) -> dict:
    experts = ("num_experts", "num_local_experts")
    return {
        **_sizes(c, experts, ("num_experts_per_tok",), ("intermediate_size",), (64, 8, 2048)),
        "normalize": bool(c.get("norm_topk_prob", default=False)),
        "router_dtype": "input",
        "weights_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


_DEEPSEEK_DEFAULTS = {  # (E, k, I, n_group, topk_group, routed_scaling_factor)
    "deepseek_v3": (256, 8, 2048, 8, 4, 2.5),
    "glm4_moe": (128, 8, 1408, 1, 1, 1.0),
    "glm_moe_dsa": (256, 8, 2048, 1, 1, 2.5),
}


def _deepseek_v3(c: _HFConfig, layer: int | None) -> dict:
    E, k, I, n_group, topk_group, rsf = _DEEPSEEK_DEFAULTS[c.family]
    experts = ("n_routed_experts", "num_local_experts", "num_experts")
    fields = {
        **_sizes(c, experts, ("num_experts_per_tok",), ("moe_intermediate_size",), (E, k, I)),
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
        fields["shared_expert"] = SharedExpert.UNGATED
        fields["shared_intermediate_size"] = fields["intermediate_size"] * n_shared
    return fields


def _minimax_m2(c: _HFConfig, layer: int | None) -> dict:
    experts = ("num_local_experts", "num_experts")
    return {
        **_sizes(c, experts, ("num_experts_per_tok",), ("intermediate_size",), (256, 8, 1536)),
        "scoring": Scoring.SIGMOID,
        "correction_bias": True,
        "normalize": True,
        "router_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


def _limit(value: Any) -> float | None:
    """Step-3.7's per-layer clamp: None or 0 means no clamp."""
    return None if value is None or value == 0 else float(value)


def _step3p7(c: _HFConfig, layer: int | None) -> dict:
    if c.get("mlp_bias", default=False):
        raise NotImplementedError("step3p7 with mlp_bias=True (biases on the shared expert) is not supported")
    experts = ("n_routed_experts", "num_local_experts", "moe_num_experts")
    fields = {
        **_sizes(c, experts, ("num_experts_per_tok", "moe_top_k"), ("moe_intermediate_size",), (288, 8, 1280)),
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
        fields["swiglu_limit"] = _per_layer(c, layer, "swiglu_limits", [_limit(v) for v in limits])
    shared = c.get("share_expert_dim", "share_expert_dims", default=1280)
    if isinstance(shared, list | tuple):
        shared = _per_layer(c, layer, "share_expert_dims", list(shared))
    if shared:
        fields["shared_expert"] = SharedExpert.UNGATED
        fields["shared_intermediate_size"] = shared
        shared_limits = c.get("swiglu_limits_shared")
        if shared_limits is not None:
            values = [_limit(v) for v in shared_limits]
            fields["shared_swiglu_limit"] = _per_layer(c, layer, "swiglu_limits_shared", values)
    return fields


def _longcat_flash(c: _HFConfig, layer: int | None) -> dict:
    sizes = _sizes(
        c,
        ("n_routed_experts", "num_local_experts"),
        ("moe_topk", "num_experts_per_tok"),
        ("expert_ffn_hidden_size", "moe_intermediate_size"),
        (512, 12, 2048),
    )
    return {
        **sizes,
        "num_zero_experts": c.get("zero_expert_num", default=256),
        "correction_bias": True,
        "routed_scaling_factor": float(c.get("routed_scaling_factor", default=6.0)),
        "activation": c.activation("hidden_act"),
    }


def _deepseek_v4_layer_type(c: _HFConfig, layer: int | None) -> str:
    if layer is not None:
        return _layer_type(c, layer)[0]
    n = _num_layers(c)
    if c.get("mlp_layer_types") is not None:
        kinds = set(c.values["mlp_layer_types"])
    elif n is not None:
        kinds = {_layer_type(c, i)[0] for i in range(n)}
    else:
        kinds = {"hash_moe", "moe"} if c.get("num_hash_layers", default=3) else {"moe"}
    if len(kinds) > 1:
        raise ValueError(
            f"{c.model_type}: layers differ ({sorted(kinds)}: hash routing or top-k); pass layer_idx to choose"
        )
    return kinds.pop()


def _deepseek_v4(c: _HFConfig, layer: int | None) -> dict:
    if c.get("mlp_bias", default=False):
        raise NotImplementedError("deepseek_v4 with mlp_bias=True (biases on the shared expert) is not supported")
    scoring = c.get("scoring_func", default="sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        # transformers raises KeyError for "softmax" too (ACT2FN has no softmax; FAMILIES.md §19.3).
        raise ValueError(f"deepseek_v4 scoring_func={scoring!r} is not one of ['sqrtsoftplus', 'sigmoid']")
    sizes = _sizes(
        c,
        ("n_routed_experts", "num_local_experts"),
        ("num_experts_per_tok",),
        ("moe_intermediate_size", "intermediate_size"),
        (256, 6, 2048),
    )
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
    if _deepseek_v4_layer_type(c, layer) == "hash_moe":
        fields |= {"hash_routing": True, "vocab_size": c.get("vocab_size", default=129280)}
    else:
        fields["correction_bias"] = True
    return fields


def _gemma4(c: _HFConfig, layer: int | None) -> dict:
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


def _gpt_oss(c: _HFConfig, layer: int | None) -> dict:
    experts = ("num_local_experts", "num_experts")
    return {
        **_sizes(c, experts, ("num_experts_per_tok",), ("intermediate_size",), (128, 4, 2880)),
        "score_order": ScoreOrder.AFTER_TOPK,
        "router_bias": True,
        "activation": Activation.GPT_OSS,  # hidden_act is not used by the experts
        "swiglu_limit": float(c.get("swiglu_limit", default=7.0)),
        "swiglu_alpha": float(c.get("swiglu_alpha", default=1.702)),
        "expert_bias": True,
        "router_dtype": "input",
        "weights_dtype": "input",
    }


def _llama4(c: _HFConfig, layer: int | None) -> dict:
    sizes = _sizes(c, ("num_local_experts",), ("num_experts_per_tok",), ("intermediate_size",), (16, 1, 8192))
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


_BUILDERS: dict[str, Callable[[_HFConfig, int | None], dict]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen,
    "qwen3_moe": _qwen,
    "qwen3_next": _qwen,
    "qwen3_5_moe": _qwen,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _deepseek_v3,
    "glm_moe_dsa": _deepseek_v3,
    "minimax_m2": _minimax_m2,
    "step3p7": _step3p7,
    "longcat_flash": _longcat_flash,
    "deepseek_v4": _deepseek_v4,
    "gemma4": _gemma4,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "olmoe": _olmoe,
}


def config_from_hf(hf_config: Any, layer_idx: int | None = None) -> MoEConfig:
    """The `MoEConfig` of the MoE block of a Hugging Face model config.

    Args:
      hf_config: a transformers `PretrainedConfig` (anything with `to_dict()`), an object with attributes, or the
        config dict (`config.json`); a multimodal config is read through its `text_config`. Keys absent from it
        take the transformers defaults listed in FAMILIES.md.
      layer_idx: the decoder layer, for settings that vary per layer (DeepSeek-V4 hash / top-k layers, Step-3.7
        clamps). Needed only where they do vary; when given, it must be an MoE layer.
    Raises:
      ValueError: unsupported `model_type`; `layer_idx` needed but None, out of range, or a dense-MLP layer.
      NotImplementedError: a valid HF setting moejax does not implement (an unknown activation, biases on
        the Step-3.7 / DeepSeek-V4 shared expert).
    """
    c = _text_config(hf_config)
    if layer_idx is not None:
        _check_layer(c, layer_idx)
        kind, reason = _layer_type(c, layer_idx)
        if kind == "dense":
            raise ValueError(
                f"layer_idx={layer_idx} of this {c.model_type} config is a dense MLP ({reason}), not an MoE block"
            )
    return MoEConfig(**_BUILDERS[c.family](c, layer_idx))


# -------------------------------------------------------------------------------------------------------------
# Parameters
# -------------------------------------------------------------------------------------------------------------

# Keys of the decoder layer that sit beside the block in layouts whose keys are relative to the decoder layer.
_DECODER_SIBLINGS = ("self_attn", "input_layernorm", "post_attention_layernorm")
_IGNORED: dict[str, tuple[str, ...]] = {
    # Gemma-4: the dense branch, the post norms and the per-layer-input branch stay with the model.
    "gemma4": (
        *_DECODER_SIBLINGS,
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
    "step_disk": _DECODER_SIBLINGS,
    "longcat": ("router.classifier.bias",),  # exists with router_bias=True, never applied (FAMILIES.md §19.1)
}
# Quantized-checkpoint tensors (FP8 block scales, DeepSeek-V4's expert scales, packed ints): named in the error.
_QUANTIZED_KEY = re.compile(r"(scale_inv|weight_scale|_blocks|_scales|\.scales?|\.qweight|\.qzeros)$")
_ROUTER_KEYS = {
    "standard": "gate.weight",
    "step_disk": "moe.gate.weight",
    "longcat": "router.classifier.weight",
    "gemma4": "router.proj.weight",
    "gpt_oss": "router.weight",
    "llama4": "router.weight",
}
_CORRECTION_KEYS = {
    # MiniMax-M2 keeps the bias on the block, DeepSeek-V4's original checkpoints call it gate.bias.
    "standard": ("gate.e_score_correction_bias", "e_score_correction_bias", "gate.bias"),
    "step_disk": ("moe.router_bias",),
    "longcat": ("router.e_score_correction_bias",),
}
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # HF names, Mixtral/DeepSeek names
_PER_EXPERT_KEY = re.compile(r"experts\.(\d+)\.")


def _layout_kind(cfg: MoEConfig, keys: Iterable[str]) -> str:
    """Which HF key scheme holds this config's block (see the module docstring)."""
    if cfg.router_prenorm:
        return "gemma4"
    if cfg.activation is Activation.GPT_OSS:
        return "gpt_oss"
    if cfg.weights_on_input:
        return "llama4"
    if cfg.scoring is Scoring.SOFTMAX and cfg.correction_bias:
        return "longcat"
    return "step_disk" if "moe.gate.weight" in set(keys) else "standard"


def _to_numpy(value: Any) -> np.ndarray:
    """A host numpy array from numpy / jax / torch (bfloat16 torch tensors have no numpy dtype: viewed as int16)."""
    if str(getattr(value, "dtype", "")) == "torch.bfloat16":
        import torch  # only reached with a torch tensor, so torch is importable

        return value.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if hasattr(value, "detach"):  # torch tensors that require grad refuse __array__
        value = value.detach().cpu()
    return np.asarray(value)


def _shape_text(shapes: tuple[tuple[int, ...], ...]) -> str:
    return " or ".join(str(s) for s in shapes)


class _StateDict:
    """The HF tensors of one block: lookups with shape checks, and a record of the keys used."""

    def __init__(self, state_dict: Mapping[str, Any]):
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping from key to array, got {type(state_dict).__name__}")
        self.raw = dict(state_dict)
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def find(self, keys: tuple[str, ...]) -> str:
        """The first of `keys` present, else the first (so the error names the usual key)."""
        return next((k for k in keys if k in self.raw), keys[0])

    def take(self, keys: str | tuple[str, ...], *shapes: tuple[int, ...]) -> np.ndarray:
        """The array under the first present of `keys`, checked to have one of `shapes`."""
        keys = (keys,) if isinstance(keys, str) else keys
        key = self.find(keys)
        if key not in self.raw:
            also = f" (also accepted: {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""
            raise ValueError(f"state dict is missing key {key!r}{also}, expected shape {_shape_text(shapes)}")
        array = _to_numpy(self.raw[key])
        if array.shape not in shapes:
            raise ValueError(f"state dict key {key!r}: expected shape {_shape_text(shapes)}, got {array.shape}")
        self.used.add(key)
        return array

    def check_all_used(self, ignored: tuple[str, ...], cfg: MoEConfig) -> None:
        def is_ignored(key: str) -> bool:
            return any(key == p or key.startswith(p + ".") for p in ignored)

        extra = sorted(k for k in self.raw if k not in self.used and not is_ignored(k))
        if not extra:
            return
        described = ", ".join(f"{k!r} with shape {_to_numpy(self.raw[k]).shape}" for k in extra[:8])
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        if any(_QUANTIZED_KEY.search(k) and k != "router.scale" for k in extra):
            raise NotImplementedError(f"quantized checkpoint tensors are not supported yet: {described}{more}")
        raise ValueError(f"state dict has unexpected keys {described}{more}: not used by {cfg}")


def _router(sd: _StateDict, cfg: MoEConfig, kind: str) -> dict[str, np.ndarray]:
    H, E, N, K = cfg.hidden_size, cfg.num_experts, cfg.num_selectable, cfg.top_k
    flat = {"router.kernel": sd.take(_ROUTER_KEYS[kind], (N, H)).T}
    if cfg.router_bias:
        flat["router.bias"] = sd.take("router.bias", (N,))
    if cfg.correction_bias:
        keys = _CORRECTION_KEYS.get(kind, _CORRECTION_KEYS["standard"])
        flat["router.correction_bias"] = sd.take(keys, (N,)).astype(np.float32)
    if cfg.router_prenorm:
        flat["router.scale"] = sd.take("router.scale", (H,))
    if cfg.per_expert_scale:
        flat["router.per_expert_scale"] = sd.take("router.per_expert_scale", (E,))
    if cfg.hash_routing:
        table = sd.take("gate.tid2eid", (cfg.vocab_size, K))
        if table.size and (table.min() < 0 or table.max() >= N):
            raise ValueError(f"gate.tid2eid has expert ids in [{table.min()}, {table.max()}], outside [0, {N})")
        flat["router.tid2eid"] = table.astype(np.int32)
    return flat


def _split_fused(gate_up: np.ndarray, down: np.ndarray, I: int) -> dict[str, np.ndarray]:
    """transformers' `gate_up_proj [E, 2I, H]` (gate rows first) and `down_proj [E, H, I]` -> moejax."""
    return {
        "experts.gate": gate_up[:, :I, :].transpose(0, 2, 1),
        "experts.up": gate_up[:, I:, :].transpose(0, 2, 1),
        "experts.down": down.transpose(0, 2, 1),
    }


def _per_expert(sd: _StateDict, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """`experts.{e}.{gate,up,down}_proj.weight` (or w1/w3/w2), Linear `[out, in]`, stacked on E."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    names = next((n for n in _PER_EXPERT_NAMES if f"experts.0.{n[0]}.weight" in sd), _PER_EXPERT_NAMES[0])
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
    for e in range(E):
        gate, up, down = (f"experts.{e}.{n}" for n in names)
        out["gate"].append(sd.take(f"{gate}.weight", (I, H)).T)
        out["up"].append(sd.take(f"{up}.weight", (I, H)).T)
        out["down"].append(sd.take(f"{down}.weight", (H, I)).T)
        if cfg.expert_bias:
            out["gate_bias"].append(sd.take(f"{gate}.bias", (I,)))
            out["up_bias"].append(sd.take(f"{up}.bias", (I,)))
            out["down_bias"].append(sd.take(f"{down}.bias", (H,)))
    return {f"experts.{k}": np.stack(v) for k, v in out.items() if v}


def _has_per_expert(sd: _StateDict) -> bool:
    return any(_PER_EXPERT_KEY.match(k) for k in sd.raw)


def _experts(sd: _StateDict, cfg: MoEConfig, kind: str) -> dict[str, np.ndarray]:
    H, E, N, I = cfg.hidden_size, cfg.num_experts, cfg.num_selectable, cfg.intermediate_size
    if kind == "step_disk":  # already stacked per layer, Linear [out, in] per expert
        return {
            "experts.gate": sd.take("moe.gate_proj.weight", (E, I, H)).transpose(0, 2, 1),
            "experts.up": sd.take("moe.up_proj.weight", (E, I, H)).transpose(0, 2, 1),
            "experts.down": sd.take("moe.down_proj.weight", (E, H, I)).transpose(0, 2, 1),
        }
    if _has_per_expert(sd):
        return _per_expert(sd, cfg)
    if kind == "gpt_oss":
        return _gpt_oss_experts(sd, cfg)
    if kind == "llama4":  # transposed [in, out], concatenated halves
        gate_up = sd.take("experts.gate_up_proj", (E, H, 2 * I))
        down = sd.take("experts.down_proj", (E, I, H))
        return {"experts.gate": gate_up[..., :I], "experts.up": gate_up[..., I:], "experts.down": down}
    # LongCat sizes gate_up_proj with the zero experts too; their rows are never used (FAMILIES.md §11).
    rows = (E, N) if kind == "longcat" else (E,)
    gate_up = sd.take("experts.gate_up_proj", *((r, 2 * I, H) for r in rows))[:E]
    return _split_fused(gate_up, sd.take("experts.down_proj", (E, H, I)), I)


def _gpt_oss_experts(sd: _StateDict, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """gpt-oss: `gate_up_proj [E, H, 2I]` with gate in the even columns and up in the odd ones, plus biases."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    if "experts.gate_up_proj_blocks" in sd:
        gate_up = _mxfp4(sd, "experts.gate_up_proj", E, 2 * I, H)
        down = _mxfp4(sd, "experts.down_proj", E, H, I)
    else:
        gate_up = sd.take("experts.gate_up_proj", (E, H, 2 * I))
        down = sd.take("experts.down_proj", (E, I, H))
    bias = sd.take("experts.gate_up_proj_bias", (E, 2 * I))
    return {
        "experts.gate": gate_up[..., 0::2],
        "experts.up": gate_up[..., 1::2],
        "experts.down": down,
        "experts.gate_bias": bias[:, 0::2],
        "experts.up_bias": bias[:, 1::2],
        "experts.down_bias": sd.take("experts.down_proj_bias", (E, H)),
    }


_FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _mxfp4(sd: _StateDict, name: str, E: int, rows: int, cols: int) -> np.ndarray:
    """gpt-oss's MXFP4 `{name}_blocks [E, rows, cols/32, 16]` + `{name}_scales [E, rows, cols/32]` -> bfloat16
    `[E, cols, rows]` (the in-memory transposed layout).

    1. Each byte holds two e2m1 codes: the low nibble is the even position, the high nibble the odd one.
    2. Each block of 32 values is scaled by `2^(scale - 127)`.  3. Reshape to `[E, rows, cols]`, transpose.
    One expert at a time, so the float32 intermediate stays one expert's size.
    """
    if cols % 32:
        raise ValueError(f"{name}_blocks: MXFP4 needs the inner size to be a multiple of 32, got {cols}")
    blocks = sd.take(f"{name}_blocks", (E, rows, cols // 32, 16))
    scales = sd.take(f"{name}_scales", (E, rows, cols // 32))
    out = np.empty((E, cols, rows), ml_dtypes.bfloat16)
    for e in range(E):
        codes = np.stack([blocks[e] & 0x0F, blocks[e] >> 4], axis=-1).reshape(rows, cols // 32, 32)
        values = np.ldexp(_FP4_E2M1[codes], scales[e].astype(np.int32)[..., None] - 127)
        out[e] = values.reshape(rows, cols).T
    return out


def _shared_prefixes(cfg: MoEConfig, kind: str) -> tuple[str, ...]:
    """Where the shared MLP lives, the family's usual name first (Qwen / Llama-4 singular, DeepSeek plural)."""
    if kind == "step_disk":
        return ("share_expert.",)
    if cfg.shared_expert is SharedExpert.SIGMOID_GATED or kind == "llama4":
        return ("shared_expert.", "shared_experts.")
    return ("shared_experts.", "shared_expert.")


def _shared(sd: _StateDict, cfg: MoEConfig, kind: str) -> dict[str, np.ndarray]:
    H, Is = cfg.hidden_size, cfg.shared_intermediate_size
    prefixes = _shared_prefixes(cfg, kind)
    prefix = next((p for p in prefixes if any(k.startswith(p) for k in sd.raw)), prefixes[0])
    # DeepSeek-V4's original checkpoints name the shared MLP w1/w3/w2.
    gate, up, down = next((n for n in _PER_EXPERT_NAMES if f"{prefix}{n[0]}.weight" in sd), _PER_EXPERT_NAMES[0])
    flat = {
        "shared.gate": sd.take(f"{prefix}{gate}.weight", (Is, H)).T,
        "shared.up": sd.take(f"{prefix}{up}.weight", (Is, H)).T,
        "shared.down": sd.take(f"{prefix}{down}.weight", (H, Is)).T,
    }
    if cfg.shared_expert is SharedExpert.SIGMOID_GATED:
        flat["shared.gate_kernel"] = sd.take("shared_expert_gate.weight", (1, H)).T
    return flat


def _ignored(cfg: MoEConfig, kind: str) -> tuple[str, ...]:
    ignored = _IGNORED.get(kind, ())
    if kind == "longcat":
        # A per-expert save of the in-memory tensor has gate/up weights for the unused zero-expert rows.
        ignored += tuple(
            f"experts.{e}.{n}" for e in range(cfg.num_experts, cfg.num_selectable) for n in ("gate_proj", "up_proj")
        )
    return ignored


def params_from_hf(state_dict: Mapping[str, Any], cfg: MoEConfig, *, layout: Layout = "auto") -> MoEParams:
    """Convert the Hugging Face tensors of one MoE block into `MoEParams` (moejax's layout, dtypes kept).

    Args:
      state_dict: key -> array (numpy, jax, torch or anything with `__array__`), keys relative to the block
        (`gate.weight`, `experts.gate_up_proj`, ...); for Gemma-4 and Step-3.7's on-disk layout, relative to
        the decoder layer (`router.proj.weight`, `moe.gate_proj.weight`). Accepted expert layouts: the fused
        in-memory tensors of transformers, the per-expert keys `experts.{e}.{gate,up,down}_proj.weight`
        (or `w1/w3/w2`; with `.bias` for gpt-oss), Step-3.7's stacked `moe.*`, and gpt-oss's MXFP4 blocks
        (dequantized to bfloat16).
      cfg: the block's config, e.g. from `config_from_hf`; it picks the key scheme (module docstring).
      layout: the routed experts' layout (`moejax.weights`): "auto" is per-expert on a CPU backend (what
        XLA:CPU reads in place), stacked elsewhere.
    Returns:
      `MoEParams` with weights `[in, out]`, gate and up apart. Arrays keep their dtype, except the correction
      bias (float32), the hash table (int32) and MXFP4 experts (bfloat16).
    Raises:
      ValueError: a missing key, an unexpected key (keys the family legitimately leaves unused are ignored by
        name), or a mis-shaped tensor; the message names the key and the expected and actual shapes.
      NotImplementedError: quantized tensors other than gpt-oss's MXFP4 (FP8 block scales, ...).
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a moejax.MoEConfig, got {type(cfg).__name__}")
    sd = _StateDict(state_dict)
    kind = _layout_kind(cfg, sd.raw)
    flat = _router(sd, cfg, kind) | _experts(sd, cfg, kind)
    if cfg.shared_expert is not SharedExpert.NONE:
        flat |= _shared(sd, cfg, kind)
    if cfg.expert_prenorm:
        flat["expert_norm"] = sd.take("pre_feedforward_layernorm_2.weight", (cfg.hidden_size,))
    sd.check_all_used(_ignored(cfg, kind), cfg)
    expert_fields = {name[len("experts.") :]: flat.pop(name) for name in list(flat) if name.startswith("experts.")}
    experts = from_host(expert_fields, ExpertWeights, layout)
    params = unflatten({name: jnp.asarray(value) for name, value in flat.items()}, experts=experts)
    check_params(params, cfg)
    return params


def params_to_hf(params: MoEParams, cfg: MoEConfig, layout: str = "fused") -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf`: numpy arrays under Hugging Face keys relative to the block.

    `layout="fused"` writes the in-memory tensors of transformers (`experts.gate_up_proj`, ...);
    `layout="per_expert"` writes `experts.{e}.{gate,up,down}_proj.weight` (and `.bias` for gpt-oss). Names are
    the canonical transformers names of the config's layout kind (the correction bias as
    `gate.e_score_correction_bias`, Step-3.7 in its in-memory names); LongCat's `gate_up_proj` holds the E real
    experts only.
    """
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout={layout!r} is not one of ['fused', 'per_expert']")
    check_params(params, cfg)
    flat = {name: np.asarray(value) for name, value in flatten(with_experts_layout(params, "stacked")).items()}
    kind = _layout_kind(cfg, ())
    hf = {_ROUTER_KEYS[kind]: flat["router.kernel"].T}
    names = {
        "router.bias": "router.bias",
        "router.correction_bias": _CORRECTION_KEYS.get(kind, _CORRECTION_KEYS["standard"])[0],
        "router.scale": "router.scale",
        "router.per_expert_scale": "router.per_expert_scale",
        "router.tid2eid": "gate.tid2eid",
        "shared.gate_kernel": "shared_expert_gate.weight",
        "expert_norm": "pre_feedforward_layernorm_2.weight",
    }
    hf |= {hf_name: flat[name] for name, hf_name in names.items() if name in flat}
    if "shared_expert_gate.weight" in hf:
        hf["shared_expert_gate.weight"] = hf["shared_expert_gate.weight"].T
    hf |= _experts_to_hf(flat, kind) if layout == "fused" else _per_expert_to_hf(flat, cfg)
    if "shared.gate" in flat:
        prefix = _shared_prefixes(cfg, kind)[0]
        hf |= {f"{prefix}{name}_proj.weight": flat[f"shared.{name}"].T for name in ("gate", "up", "down")}
    return hf


def _experts_to_hf(flat: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    gate, up, down = flat["experts.gate"], flat["experts.up"], flat["experts.down"]
    if kind == "gpt_oss":
        E, H, I = gate.shape
        gate_up = np.stack([gate, up], axis=-1).reshape(E, H, 2 * I)  # interleave: even gate, odd up
        bias = np.stack([flat["experts.gate_bias"], flat["experts.up_bias"]], axis=-1).reshape(E, 2 * I)
        return {
            "experts.gate_up_proj": gate_up,
            "experts.gate_up_proj_bias": bias,
            "experts.down_proj": down,
            "experts.down_proj_bias": flat["experts.down_bias"],
        }
    if kind == "llama4":
        return {"experts.gate_up_proj": np.concatenate([gate, up], axis=-1), "experts.down_proj": down}
    gate_up = np.concatenate([gate, up], axis=-1).transpose(0, 2, 1)  # [E, 2I, H]
    return {"experts.gate_up_proj": gate_up, "experts.down_proj": down.transpose(0, 2, 1)}


def _per_expert_to_hf(flat: dict[str, np.ndarray], cfg: MoEConfig) -> dict[str, np.ndarray]:
    hf = {}
    for e in range(cfg.num_experts):
        for name in ("gate", "up", "down"):
            hf[f"experts.{e}.{name}_proj.weight"] = flat[f"experts.{name}"][e].T
            if cfg.expert_bias:
                hf[f"experts.{e}.{name}_proj.bias"] = flat[f"experts.{name}_bias"][e]
    return hf


# -------------------------------------------------------------------------------------------------------------
# Safetensors
# -------------------------------------------------------------------------------------------------------------

_INDEX = "model.safetensors.index.json"
# Dtypes numpy has only through ml_dtypes: safetensors' numpy reader handles them in some versions and fails in
# others (0.4 raises AttributeError), so they are always read from the bytes (header offsets) and viewed.
_ML_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _keys_by_file(files: str | os.PathLike | Iterable[str | os.PathLike], prefix: str) -> dict[str, list[str]]:
    """{file: [keys under prefix]} from one file, a list of files, an index json, or a directory."""
    if isinstance(files, str | os.PathLike):
        path = os.fspath(files)
        if os.path.isdir(path):
            index = os.path.join(path, _INDEX)
            if os.path.exists(index):
                return _keys_from_index(index, prefix)
            paths = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not paths:
                raise ValueError(f"{path} holds neither {_INDEX} nor .safetensors files")
            return _keys_from_files(paths, prefix)
        if path.endswith(".json"):
            return _keys_from_index(path, prefix)
        return _keys_from_files([path], prefix)
    return _keys_from_files([os.fspath(f) for f in files], prefix)


def _keys_from_index(index: str, prefix: str) -> dict[str, list[str]]:
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    folder = os.path.dirname(index)
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        if key.startswith(prefix):
            by_file.setdefault(os.path.join(folder, file), []).append(key)
    return by_file


def _keys_from_files(paths: list[str], prefix: str) -> dict[str, list[str]]:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for path in paths:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not key.startswith(prefix):
                    continue
                if key in seen:
                    raise ValueError(f"tensor {key!r} is in both {seen[key]} and {path}")
                seen[key] = path
                by_file.setdefault(path, []).append(key)
    return by_file


def _header(path: str) -> tuple[int, dict[str, Any]]:
    """(offset of the data, the JSON header) of a safetensors file: 8-byte little-endian size, header, data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _read_file(path: str, keys: list[str]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    data_start, header = _header(path)
    tensors = {}
    with safe_open(path, framework="numpy") as f, open(path, "rb") as raw:
        for key in keys:
            info = header[key]
            if info["dtype"] not in _ML_DTYPES:
                tensors[key] = f.get_tensor(key)
                continue
            start, end = info["data_offsets"]
            raw.seek(data_start + start)
            data = np.frombuffer(raw.read(end - start), _ML_DTYPES[info["dtype"]])
            tensors[key] = data.reshape(info["shape"])
    return tensors


def load_safetensors(
    files: str | os.PathLike | Iterable[str | os.PathLike], cfg: MoEConfig, prefix: str, *, layout: Layout = "auto"
) -> MoEParams:
    """Load one MoE block from a (sharded) safetensors checkpoint.

    Args:
      files: a `.safetensors` file, a list of them, a `model.safetensors.index.json`, or a directory holding an
        index (else all its `.safetensors` files are read). Only the files holding keys under `prefix` are opened
        and only those tensors read.
      cfg: the block's config (see `params_from_hf`).
      prefix: the block's key prefix, e.g. `"model.layers.3.mlp."` (a missing trailing dot is added); for
        Gemma-4 and Step-3.7 checkpoints the decoder layer's, e.g. `"model.layers.3."`.
    Returns:
      `params_from_hf` of the tensors under `prefix`, with the prefix stripped.
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    by_file = _keys_by_file(files, prefix)
    if not by_file:
        raise ValueError(f"no tensors under prefix {prefix!r} in {files}")
    tensors: dict[str, np.ndarray] = {}
    for path, keys in by_file.items():
        tensors |= _read_file(path, keys)
    return params_from_hf({key[len(prefix) :]: value for key, value in tensors.items()}, cfg, layout=layout)
