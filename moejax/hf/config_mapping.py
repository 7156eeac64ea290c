"""A Hugging Face text config read with every spelling of its fields (`HFConfig`), and per family how it maps to
`MoEConfig` fields and which decoder layers hold an MoE block.

transformers renames fields between versions and families (transformers 5 saves Qwen3-MoE's `num_experts` as
`num_local_experts`; DeepSeek says `n_routed_experts`, Step-3.7 `moe_num_experts`, ...). The expert count and
top-k have one meaning in every family, so every spelling of them is read everywhere: a size present under any
spelling never falls back to a default, and two spellings that disagree are an error.

The family records (`moejax.hf.families`) name the mapping functions below; each reads the config through
`HFConfig` and takes the transformers class defaults where a field is absent (docs/FAMILIES.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from moejax.config import Activation, ClampOrder, ScalingTarget, ScoreOrder, Scoring, SharedExpert

# Spellings of the same quantity across families and transformers versions.
NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "moe_topk", "top_k_experts")

_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}


class HFConfig:
    """A flat HF text config with spelling-aware lookups; a value of None counts as absent (HF treats it so)."""

    def __init__(self, values: Mapping[str, Any], model_type: str):
        self.values = values
        self.model_type = model_type

    def get(self, *names: str, default: Any = None) -> Any:
        """The value of the first of `names` that is set, else `default`."""
        for name in names:
            if self.values.get(name) is not None:
                return self.values[name]
        return default

    def one_of(self, names: tuple[str, ...], default: Any = None) -> Any:
        """The value under any of `names` (spellings of one field); ValueError when two spellings disagree."""
        found = {name: self.values[name] for name in names if self.values.get(name) is not None}
        if len(set(map(repr, found.values()))) > 1:
            raise ValueError(f"{self.model_type} config spells one field differently: {found}")
        return next(iter(found.values()), default)

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

    def sizes(self, intermediate: tuple[str, ...], defaults: tuple[int, int, int]) -> dict[str, int]:
        """hidden size, expert count, top-k and the expert intermediate size (the family's own spellings of it);
        `defaults` (E, k, I) are the transformers class defaults, used only when no spelling is present."""
        e_default, k_default, i_default = defaults
        return {
            "hidden_size": self.require("hidden_size"),
            "num_experts": self.one_of(NUM_EXPERTS, e_default),
            "top_k": self.one_of(TOP_K, k_default),
            "intermediate_size": self.one_of(intermediate, i_default),
        }


def as_dict(hf_config: Any) -> dict[str, Any]:
    """A config dict from a transformers config (`to_dict()`), a mapping or an object with attributes."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    if hasattr(hf_config, "__dict__"):
        return {k: v for k, v in vars(hf_config).items() if not k.startswith("_")}
    raise TypeError(f"hf_config must be a transformers config, a mapping or an object, got {type(hf_config).__name__}")


def text_part(hf_config: Any) -> tuple[dict[str, Any], str]:
    """(the text config's values, the outer model_type): multimodal configs nest the text part as `text_config`."""
    values = as_dict(hf_config)
    outer_type = values.get("model_type")
    if values.get("text_config") is not None:
        try:
            values = as_dict(values["text_config"])
        except TypeError:
            raise ValueError(
                f"text_config must be a config object, got {type(values['text_config']).__name__}"
            ) from None
        values.setdefault("model_type", outer_type)
    return values, outer_type


LayerKind = Literal["moe", "hash_moe", "dense"]


# -- which layers are MoE --------------------------------------------------------------------------------------


def every_layer(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    return "moe", "every layer is MoE"


def _from_type_list(c: HFConfig, name: str, layer: int) -> str:
    types = c.values[name]
    if layer >= len(types):
        raise ValueError(f"layer_idx={layer} is out of range for {name} of length {len(types)}")
    return types[layer]


def first_k_dense(default: int) -> Callable[[HFConfig, int], tuple[LayerKind, str]]:
    """DeepSeek-style: `mlp_layer_types` when the config has it, else the first `first_k_dense_replace` dense."""

    def kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
        if c.get("mlp_layer_types") is not None:
            name = _from_type_list(c, "mlp_layer_types", layer)
            return ("dense" if name == "dense" else "moe"), f"mlp_layer_types[{layer}]={name!r}"
        k = c.get("first_k_dense_replace", default=default)
        return ("dense" if layer < k else "moe"), f"first_k_dense_replace={k}"

    return kind


def qwen_sparse_step(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    only, step = c.get("mlp_only_layers", default=[]), c.get("decoder_sparse_step", default=1)
    sparse = layer not in only and c.one_of(NUM_EXPERTS, 1) > 0 and (layer + 1) % step == 0
    return ("moe" if sparse else "dense"), f"mlp_only_layers={only}, decoder_sparse_step={step}"


def _moe_layers_enum(c: HFConfig) -> list[int] | None:
    enum = c.get("moe_layers_enum")
    if isinstance(enum, str):
        return [int(i) for i in enum.split(",") if i.strip()]
    return None if enum is None else [int(i) for i in enum]


def step3p7_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    if c.get("mlp_layer_types") is not None:
        name = _from_type_list(c, "mlp_layer_types", layer)
        return ("dense" if name == "dense" else "moe"), f"mlp_layer_types[{layer}]={name!r}"
    enum = _moe_layers_enum(c)
    if enum is not None:
        return ("moe" if layer in enum else "dense"), "moe_layers_enum"
    return ("dense" if layer < 3 else "moe"), "the default (layers 0-2 dense)"


def deepseek_v4_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    if c.get("mlp_layer_types") is not None:
        return _from_type_list(c, "mlp_layer_types", layer), f"mlp_layer_types[{layer}]"
    n_hash = c.get("num_hash_layers", default=3)
    return ("hash_moe" if layer < n_hash else "moe"), f"num_hash_layers={n_hash}"


def llama4_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
    moe_layers = c.get("moe_layers")
    if moe_layers is not None:
        return ("moe" if layer in moe_layers else "dense"), f"moe_layers={moe_layers}"
    step = c.get("interleave_moe_layer_step", default=1)
    return ("moe" if (layer + 1) % step == 0 else "dense"), f"interleave_moe_layer_step={step}"


def gemma4_kind(c: HFConfig, layer: int) -> tuple[LayerKind, str]:
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


def mixtral(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("intermediate_size",), (8, 2, 14336)),
        "normalize": True,
        "router_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


def qwen(defaults: tuple[int, int, int, int, bool], *, always_normalize: bool = False, shared: bool = True):
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


def olmoe(c: HFConfig, layer: int | None) -> dict:
    return {
        **c.sizes(("intermediate_size",), (64, 8, 2048)),
        "normalize": bool(c.get("norm_topk_prob", default=False)),
        "router_dtype": "input",
        "weights_dtype": "input",
        "activation": c.activation("hidden_act"),
    }


def deepseek(defaults: tuple[int, int, int, int, int, float]):
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


def minimax_m2(c: HFConfig, layer: int | None) -> dict:
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


def step3p7(c: HFConfig, layer: int | None) -> dict:
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
        fields["swiglu_limit"] = _per_layer(c, step3p7_kind, layer, "swiglu_limits", [_limit(v) for v in limits])
    shared = c.one_of(("share_expert_dim", "share_expert_dims"), 1280)
    if isinstance(shared, list | tuple):
        shared = _per_layer(c, step3p7_kind, layer, "share_expert_dims", list(shared))
    if shared:
        fields["shared_expert"] = SharedExpert.UNGATED
        fields["shared_intermediate_size"] = shared
        shared_limits = c.get("swiglu_limits_shared")
        if shared_limits is not None:
            values = [_limit(v) for v in shared_limits]
            fields["shared_swiglu_limit"] = _per_layer(c, step3p7_kind, layer, "swiglu_limits_shared", values)
    return fields


def longcat_flash(c: HFConfig, layer: int | None) -> dict:
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
        kinds = {deepseek_v4_kind(c, i)[0] for i in range(n)}
    else:
        kinds = {"hash_moe", "moe"} if c.get("num_hash_layers", default=3) else {"moe"}
    if len(kinds) > 1:
        raise ValueError(
            f"{c.model_type}: layers differ ({sorted(kinds)}: hash routing or top-k); pass layer_idx to choose"
        )
    return kinds.pop()


def deepseek_v4(c: HFConfig, layer: int | None) -> dict:
    if c.get("mlp_bias", default=False):
        raise NotImplementedError("deepseek_v4 with mlp_bias=True (biases on the shared expert) is not supported")
    scoring = c.get("scoring_func", default="sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        # transformers raises KeyError for "softmax" too (ACT2FN has no softmax; docs/FAMILIES.md §19.3).
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
    kind = deepseek_v4_kind(c, layer)[0] if layer is not None else _deepseek_v4_uniform_kind(c)
    if kind == "hash_moe":
        fields |= {"hash_routing": True, "vocab_size": c.get("vocab_size", default=129280)}
    else:
        fields["correction_bias"] = True
    return fields


def gemma4(c: HFConfig, layer: int | None) -> dict:
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


def gpt_oss(c: HFConfig, layer: int | None) -> dict:
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


def llama4(c: HFConfig, layer: int | None) -> dict:
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
