"""A Hugging Face text config read with every spelling of its fields: what the family records build from.

transformers renames fields between versions and families (transformers 5 saves Qwen3-MoE's `num_experts` as
`num_local_experts`; DeepSeek says `n_routed_experts`, Step-3.7 `moe_num_experts`, ...). The expert count and
top-k have one meaning in every family, so every spelling of them is read everywhere: a size present under any
spelling never falls back to a default, and two spellings that disagree are an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moejax.config import Activation

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
