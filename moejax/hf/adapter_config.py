"""PEFT LoRA adapters (peft 0.21, transformers 5 module names): what `adapter_config.json` says (`AdapterConfig`),
and where a family's block sits in a PEFT file (`BlockNames`). Loading: `moejax.hf.adapter_load`; saving:
`moejax.hf.adapter_save`; the layout and its sources: docs/LORA.md, "PEFT layout".
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from moejax.hf.families import Block, Family
from moejax.hf.keys import SHARED_PREFIXES, BlockKeys
from moejax.lora import LoRAParams

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PeftModel's state dict puts before the transformers model's module names

# LoraConfig fields that change what the weights mean; any value but these defaults is refused.
UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,  # DoRA: a magnitude vector rescales W + ΔW
    "lora_bias": False,  # a bias on lora_B
    "bias": "none",  # base biases trained and saved beside the adapter
    "fan_in_fan_out": False,  # transposed (Conv1D) base weights
    "layer_replication": None,  # layer indices remapped
    "alora_invocation_tokens": None,  # activated LoRA: only after the invocation tokens
    "use_qalora": False,
    "use_bdlora": None,
    "velora_config": None,
    "kasa_config": None,
    "arrow_config": None,
    "monteclora_config": None,
}
# init_lora_weights values whose saved A and B apply to the unmodified base weights (peft 0.21,
# `LoraLayer.update_layer`): the default (True), random (False), "gaussian"; "eva" (B = 0, A from activations),
# "orthogonal" and "mica" (B·A = 0 at init, the base left untouched). The others ("pissa", "pissa_niter_<n>", "olora",
# "corda", "loftq", "lora_ga", and any value peft adds later) move part of W into the initial A and B, or quantize W:
# such an adapter only fits that modified base, so it is refused (as peft's own merge would be wrong on the original).
_BASE_KEPT_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
_PEFT_DEFAULT_R = 8  # LoraConfig.r
_PEFT_DEFAULT_ALPHA = 8  # LoraConfig.lora_alpha
LORA_KEY = re.compile(r"^(.*)\.lora_([AB])\.weight$")
_LAYER_KEY = re.compile(r"\blayers\.(\d+)\.")
SHARED_GATE = "shared_expert_gate"  # Qwen2-MoE / Qwen3-Next / Qwen3.5: nn.Linear(H, 1) on the block
FUSED = ("gate_up_proj", "down_proj")  # the routed experts' 3-D parameters, in registration order
GUD = ("gate", "up", "down")


# -- the adapter's config ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What `load_adapter` reads of `adapter_config.json`.

    r / lora_alpha: the defaults (peft's 8 and 8 when the file has none); rank_pattern / alpha_pattern: per target,
    the first pattern p (in the file's order) with `re.match(rf"(.*\\.)?({p})$", name)` wins
    (peft.utils.other.get_pattern_key), where name is the module name (`model.layers.1.mlp.shared_expert.up_proj`)
    or, for a parameter target, module + parameter (`model.layers.1.mlp.experts.gate_up_proj`).
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    path: str = CONFIG

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], path: str = CONFIG) -> AdapterConfig:
        """Raises `NotImplementedError` for a PEFT method or option moejax does not apply (DoRA, PiSSA-like
        initialisations, ...) and `ValueError` naming `path` and the field for a malformed value."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
        peft_type = raw.get("peft_type")
        if peft_type != "LORA":
            raise NotImplementedError(f"{path}: peft_type={peft_type!r}; only LoRA adapters (peft_type='LORA') load")
        for name, default in UNSUPPORTED.items():
            value = raw.get(name, default)
            if value and value != default:  # None, False, {} and the default are all "off"
                raise NotImplementedError(f"{path}: {name}={value!r} is not supported (only {name}={default!r})")
        _check_init(raw.get("init_lora_weights", True), path)
        use_rslora = raw.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ValueError(f"{path}: use_rslora={use_rslora!r} must be true or false")
        target_parameters = raw.get("target_parameters") or ()
        if not isinstance(target_parameters, list | tuple) or not all(isinstance(t, str) for t in target_parameters):
            raise ValueError(f"{path}: target_parameters={target_parameters!r} must be a list of names")
        return cls(
            r=_number(raw.get("r", _PEFT_DEFAULT_R), f"{path}: r", integer=True),
            lora_alpha=float(_number(raw.get("lora_alpha", _PEFT_DEFAULT_ALPHA), f"{path}: lora_alpha")),
            use_rslora=use_rslora,
            rank_pattern=_patterns(raw, "rank_pattern", path, integer=True),
            alpha_pattern=_patterns(raw, "alpha_pattern", path, integer=False),
            target_parameters=tuple(target_parameters),
            raw=dict(raw),
            path=path,
        )

    def rank_alpha(self, name: str) -> tuple[int, float]:
        """(r, alpha) of the target `name` (peft.tuners.lora.model.LoraModel._create_and_replace).

        Raises:
          ValueError: r <= 0 for this target (peft's `update_layer` refuses it), naming the target.
        """
        r = int(_pattern(self.rank_pattern, name, self.r))
        if r <= 0:
            raise ValueError(
                f"load_adapter: {self.path}: target {name} has r={r} (r / rank_pattern); peft refuses r <= 0"
            )
        return r, float(_pattern(self.alpha_pattern, name, self.lora_alpha))

    def scale(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets_parameter(self, key: str) -> bool:
        """Whether `target_parameters` names the parameter `key` (peft's `_inject_parameters` match)."""
        return any(key == t or key.endswith("." + t) for t in self.target_parameters)


def _check_init(init: Any, path: str) -> None:
    """Refuse an `init_lora_weights` whose adapter assumes a modified base model (see `_BASE_KEPT_INITS`)."""
    if init is None or isinstance(init, bool):
        return
    if isinstance(init, str) and init.lower() in _BASE_KEPT_INITS:
        return
    raise NotImplementedError(
        f"{path}: init_lora_weights={init!r} is not supported: moejax adds the adapter to the unmodified base "
        "weights, which only init_lora_weights true, false, 'gaussian', 'eva', 'orthogonal' and 'mica' keep "
        "(PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA modify the base to match their initial A and B). Convert it to a "
        "plain LoRA first: peft's save_pretrained(..., path_initial_model_for_weight_conversion=...)"
    )


def _number(value: Any, what: str, *, integer: bool = False) -> int | float:
    """A JSON number (an int where `integer`), or `ValueError` naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what}={value!r} must be {'an integer' if integer else 'a finite number'}")
    if integer:
        if int(value) != value:
            raise ValueError(f"{what}={value!r} must be an integer")
        return int(value)
    return value


def _patterns(raw: Mapping[str, Any], field: str, path: str, *, integer: bool) -> dict[str, int | float]:
    """`rank_pattern` / `alpha_pattern`: a JSON object of regex -> number; each regex compiled here, so a bad one is
    a `ValueError` naming it (peft would fail on it with a raw `re.error` at the first module it matches)."""
    patterns = raw.get(field) or {}
    if not isinstance(patterns, Mapping):
        raise ValueError(f"{path}: {field} must be an object of pattern -> value, got {type(patterns).__name__}")
    out = {}
    for p, value in patterns.items():
        try:
            re.compile(rf"(.*\.)?({p})$")
        except re.error as e:
            raise ValueError(f"{path}: {field} pattern {p!r} is not a valid regular expression ({e})") from e
        out[p] = _number(value, f"{path}: {field}[{p!r}]", integer=integer)
    return out


def _pattern(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", name):
            return patterns[p]
    return default


# -- where a family's block sits -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockNames:
    """The module names of one layer's block in a PEFT file (without `base_model.model.`), in one key layout."""

    prefix: str  # "model.layers.1.mlp."
    keys: BlockKeys

    def router(self) -> str:
        return self.prefix + self.keys.router.removesuffix(".weight")

    def experts(self) -> str:
        return self.prefix + "experts"

    def shared(self) -> tuple[str, ...]:
        return (self.prefix + self.keys.shared_prefix, *(self.prefix + p for p in SHARED_PREFIXES))

    def owns(self, module: str) -> bool:
        if not module.startswith(self.prefix):
            return False
        return self.keys.owns(module[len(self.prefix) :])


def _peft_block(family: Family) -> Block:
    """The block as transformers 5 holds it in memory (the module names PEFT writes): a fused in-memory block of
    the text model, else the text model's block in the in-memory layout, else the first in that layout."""
    memory = [b for b in family.blocks if b.keys == family.memory]
    text = [b for b in memory if b.composite is not True]
    fused = [b for b in text if b.experts == "fused"]
    return (fused or text or memory or list(family.blocks))[0]


def candidates(family: Family, layer: int) -> list[BlockNames]:
    """Every place PEFT files name layer `layer`'s block: the in-memory prefix under the text model (`model.`)
    and under a multimodal model (`model.language_model.`), then the family's checkpoint prefixes (adapters
    trained on transformers 4 name its modules, e.g. Mixtral's `block_sparse_moe.`)."""
    memory = _peft_block(family)
    marker = f"layers.{layer}."
    sub = memory.at(layer).split(marker, 1)[1]
    out = [BlockNames(head + marker + sub, family.memory) for head in ("model.", "model.language_model.")]
    out += [BlockNames(b.at(layer), b.keys) for b in family.blocks]
    unique: list[BlockNames] = []
    for n in out:
        if all(n.prefix != u.prefix for u in unique):
            unique.append(n)
    return unique


def refuse_rank_zero(lora: LoRAParams, who: str) -> None:
    """`ValueError` naming the target when a target of `lora` has rank 0: peft refuses r <= 0, so `save_adapter`
    writes no such file and `load_adapter` reads none (`AdapterConfig.rank_alpha`)."""
    for name, pair in lora.pairs().items():
        if pair.rank <= 0:
            raise ValueError(
                f"{who}: target {name} has rank {pair.rank} (A {tuple(pair.a.shape)}); peft refuses r <= 0: "
                "leave the target out (None) instead"
            )
