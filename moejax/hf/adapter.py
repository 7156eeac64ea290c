"""PEFT LoRA adapters (peft 0.21, transformers 5 module names) <-> `moejax.lora.LoRAParams` of one MoE block.

`load_adapter(adapter_dir, cfg, layer_idx)` reads `adapter_config.json` + `adapter_model.safetensors` as
`PeftModel.save_pretrained` writes them and returns the adapter of layer `layer_idx`'s MoE block: the router, the
routed experts' gate / up / down, the shared expert and its sigmoid gate. The file's other layers and other
modules (attention) are ignored. `save_adapter` writes one block's adapter back in the same layout.

The layout (docs/LORA.md, "PEFT layout", has the sources): keys `base_model.model.<module>.lora_A.weight`
`[r, in]` and `.lora_B.weight` `[out, r]`, s = lora_alpha / r (alpha / √r with `use_rslora`), r and alpha per
target from `rank_pattern` / `alpha_pattern`. A fused 3-D expert tensor targeted through `target_parameters` has
`A [r·E, in]` (expert-major) and `B [out, r·E]` (expert-minor); both expert tensors targeted nest two wrappers
(`experts.base_layer.lora_*` is gate_up_proj, `experts.lora_*` down_proj). Where the names live comes from the
family records (`moejax.hf.families`): the block's prefix and its router / shared-expert names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from moejax.config import Activation, MoEConfig, SharedExpert
from moejax.hf import files, transaction
from moejax.hf.families import BY_MODEL_TYPE, BY_NAME, FAMILY_RECORDS, Block, Family
from moejax.hf.layouts import GATE_UP_DOWN, W1_W3_W2, KeyLayout
from moejax.lora import LoRAPair, LoRAParams, from_pairs

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PeftModel's state dict puts before the transformers model's module names

# LoraConfig fields that change what the weights mean; any value but these defaults is refused.
_UNSUPPORTED: dict[str, Any] = {
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
_LORA_KEY = re.compile(r"^(.*)\.lora_([AB])\.weight$")
_LAYER_KEY = re.compile(r"\blayers\.(\d+)\.")
_SHARED_GATE = "shared_expert_gate"  # Qwen2-MoE / Qwen3-Next / Qwen3.5: nn.Linear(H, 1) on the block
_FUSED = ("gate_up_proj", "down_proj")  # the routed experts' 3-D parameters, in registration order
_GUD = ("gate", "up", "down")


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
        for name, default in _UNSUPPORTED.items():
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
class _Names:
    """The module names of one layer's block in a PEFT file (without `base_model.model.`), in one key layout."""

    prefix: str  # "model.layers.1.mlp."
    layout: KeyLayout

    def router(self) -> str:
        return self.prefix + self.layout.router.removesuffix(".weight")

    def experts(self) -> str:
        return self.prefix + "experts"

    def shared(self) -> tuple[str, ...]:
        return (
            self.prefix + self.layout.shared_prefix,
            self.prefix + "shared_expert.",
            self.prefix + "shared_experts.",
        )

    def owns(self, module: str) -> bool:
        if not module.startswith(self.prefix):
            return False
        return self.layout.owns(module[len(self.prefix) :])


def _peft_block(family: Family) -> Block:
    """The block as transformers 5 holds it in memory (the module names PEFT writes): a fused in-memory block of
    the text model, else the text model's block in the in-memory layout, else the first in that layout."""
    memory = [b for b in family.blocks if b.layout == family.memory]
    text = [b for b in memory if b.composite is not True]
    fused = [b for b in text if b.experts == "fused"]
    return (fused or text or memory or list(family.blocks))[0]


def _candidates(family: Family, layer: int) -> list[_Names]:
    """Every place PEFT files name layer `layer`'s block: the in-memory prefix under the text model (`model.`)
    and under a multimodal model (`model.language_model.`), then the family's checkpoint prefixes (adapters
    trained on transformers 4 name its modules, e.g. Mixtral's `block_sparse_moe.`)."""
    memory = _peft_block(family)
    marker = f"layers.{layer}."
    sub = memory.at(layer).split(marker, 1)[1]
    out = [_Names(head + marker + sub, family.memory) for head in ("model.", "model.language_model.")]
    out += [_Names(b.at(layer), b.layout) for b in family.blocks]
    unique: list[_Names] = []
    for n in out:
        if all(n.prefix != u.prefix for u in unique):
            unique.append(n)
    return unique


# -- reading -----------------------------------------------------------------------------------------------------


def _read(adapter_dir: str | os.PathLike) -> tuple[AdapterConfig, str, dict[str, Any]]:
    path = os.fspath(adapter_dir)
    config_path, weights_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not os.path.isdir(path):
        raise ValueError(f"load_adapter: {path} is not a directory (expected {CONFIG} and {WEIGHTS} in it)")
    if not os.path.exists(config_path):
        raise ValueError(f"load_adapter: {path} has no {CONFIG}")
    if not os.path.exists(weights_path):
        bin_path = os.path.join(path, "adapter_model.bin")
        also = " (it has adapter_model.bin, torch's pickle format: save it with safe_serialization=True)"
        raise ValueError(f"load_adapter: {path} has no {WEIGHTS}" + (also if os.path.exists(bin_path) else ""))
    config = AdapterConfig.from_json(_read_json(config_path), config_path)
    _, head = files.header(weights_path)
    head.pop("__metadata__", None)
    return config, weights_path, head


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; `ValueError` naming the file when it is not UTF-8, not JSON, or not an object."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"load_adapter: {path} is not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"load_adapter: {path} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"load_adapter: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _family_of(config: AdapterConfig, adapter_dir: str) -> Family | None:
    """The family named by the adapter's config: `auto_mapping` (written when task_type is None), else the
    config.json of a local `base_model_name_or_path`; None when neither says."""
    library = (config.raw.get("auto_mapping") or {}).get("parent_library", "")
    match = re.fullmatch(r"transformers\.models\.(\w+)\.modeling_\w+", library)
    if match and match.group(1) in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[match.group(1)]
    base = config.raw.get("base_model_name_or_path")
    if base:
        for folder in (base, os.path.join(adapter_dir, base)):
            path = os.path.join(folder, "config.json")
            if os.path.isfile(path):
                hf = _read_json(path)
                model_type = hf.get("model_type")
                if model_type not in BY_MODEL_TYPE and isinstance(hf.get("text_config"), dict):
                    model_type = hf["text_config"].get("model_type")
                if model_type in BY_MODEL_TYPE:
                    return BY_MODEL_TYPE[model_type]
    return None


def _fits_config(family: Family, cfg: MoEConfig) -> bool:
    """Families whose expert tensors look alike but are laid out differently, told apart by their math."""
    if family.name == "gpt_oss":
        return cfg.activation == Activation.GPT_OSS
    if family.name == "llama4":
        return cfg.weights_on_input
    return cfg.activation != Activation.GPT_OSS and not cfg.weights_on_input


def load_adapter(
    adapter_dir: str | os.PathLike, cfg: MoEConfig, layer_idx: int, *, family: str | None = None
) -> LoRAParams:
    """The LoRA adapter of layer `layer_idx`'s MoE block from a PEFT adapter directory (one adapter).

    Args:
      adapter_dir: what `PeftModel.save_pretrained` wrote: `adapter_config.json`, `adapter_model.safetensors`.
      cfg: the block's config (e.g. from `moejax.hf.load_layer`): the expected shapes.
      layer_idx: the decoder layer.
      family: the moejax family of the base model (`moejax.FAMILIES`); None: from the adapter config
        (`auto_mapping`, or a local `base_model_name_or_path`), else from the keys and `cfg`.

    Returns:
      `LoRAParams` with the targets the adapter has in this block (none: an adapter that trains the layer but
      not its MoE block), arrays in the file's dtype, scales float32.

    Raises:
      ValueError: missing files; an adapter_config.json that is not UTF-8 JSON of an object, or whose r, alpha,
        patterns (a bad regex) or flags have the wrong type (the message names the file and the field); r <= 0 for
        a target; no key of the file names layer `layer_idx` (the message lists the layers it has); a key of the
        block that is not a LoRA target moejax knows; a shape that does not fit `cfg` or the config's rank (the
        message names the key and both shapes).
      NotImplementedError: a PEFT method or option other than plain LoRA (DoRA, lora_bias, ...), an
        `init_lora_weights` that assumes a modified base model (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA), per-expert
        keys with different ranks or scales.
    """
    adapter_dir = os.fspath(adapter_dir)
    config, weights_path, head = _read(adapter_dir)
    keys = {k.removeprefix(PREFIX): k for k in head}
    if family is not None:
        if family not in BY_NAME:
            raise ValueError(f"load_adapter: unknown family {family!r}; one of {sorted(BY_NAME)}")
        families = [BY_NAME[family]]
    else:
        named = _family_of(config, adapter_dir)
        families = [named] if named is not None else [f for f in FAMILY_RECORDS if _fits_config(f, cfg)]

    layers = sorted({int(m.group(1)) for k in keys if (m := _LAYER_KEY.search(k))})
    if layer_idx not in layers:
        only = config.raw.get("layers_to_transform")
        note = f" (layers_to_transform={only})" if only is not None else ""
        raise ValueError(
            f"load_adapter: {adapter_dir} has no weights for layer {layer_idx}; it has layers {layers}{note}"
        )

    plans, errors = [], []
    for fam in families:
        for names in _candidates(fam, layer_idx):
            mine = sorted(k for k in keys if names.owns(k))
            if not mine:
                continue
            try:
                plans.append((fam, names, _plan(mine, names, cfg, config)))
            except _Unknown as e:
                errors.append(f"{fam.name} ({names.prefix}): {e}")
            break  # the first prefix with keys is the family's block
    if not plans:
        if errors:
            raise ValueError(f"load_adapter: {adapter_dir} layer {layer_idx}: " + "; ".join(errors))
        return LoRAParams()
    zero_rows = lambda layout: layout.zero_expert_rows and cfg.num_zero_experts > 0
    readings = {(names.layout.experts, zero_rows(names.layout), plan.signature()) for _, names, plan in plans}
    if len(readings) > 1:  # families that would read the same keys differently
        which = sorted({fam.name for fam, _, _ in plans})
        raise ValueError(f"load_adapter: the keys of layer {layer_idx} fit the families {which}; pass family=")
    _, names, plan = plans[0]
    wanted = plan.keys()
    arrays = files.read_file(weights_path, [keys[k] for k in wanted])
    tensors = {k: arrays[keys[k]] for k in wanted}
    return plan.build(tensors, cfg, config, names)


class _Unknown(Exception):
    """A key of the block that this layout does not name."""


@dataclasses.dataclass
class _Plan:
    """Which modules of the block hold what: target name -> module name (without `.lora_A.weight`)."""

    router: str | None = None
    fused: dict[str, str] = dataclasses.field(default_factory=dict)  # "gate_up_proj" / "down_proj" -> module
    per_expert: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)  # (e, gate|up|down) -> module
    shared: dict[str, str] = dataclasses.field(default_factory=dict)  # gate|up|down|gate_kernel -> module

    def modules(self) -> list[str]:
        return [m for m in (self.router, *self.fused.values(), *self.per_expert.values(), *self.shared.values()) if m]

    def keys(self) -> list[str]:
        return [f"{m}.lora_{ab}.weight" for m in self.modules() for ab in "AB"]

    def signature(self) -> tuple:
        return (self.router is not None, tuple(sorted(self.fused)), len(self.per_expert), tuple(sorted(self.shared)))

    def build(self, tensors: dict[str, np.ndarray], cfg: MoEConfig, config: AdapterConfig, names: _Names) -> LoRAParams:
        pairs: dict[str, LoRAPair] = {}
        if self.router is not None:
            pairs["router"] = _plain(tensors, self.router, cfg.hidden_size, cfg.num_selectable, config)
        for projection, module in self.fused.items():
            pairs |= _fused(tensors, module, projection, cfg, config, names)
        if self.per_expert:
            pairs |= _per_expert(tensors, self.per_expert, cfg, config)
        for target, module in self.shared.items():
            n_in, n_out = _shared_shape(target, cfg)
            pairs[f"shared.{target}"] = _plain(tensors, module, n_in, n_out, config)
        return from_pairs(pairs)


def _plan(mine: list[str], names: _Names, cfg: MoEConfig, config: AdapterConfig) -> _Plan:
    """Sort the block's keys into targets (ValueError / _Unknown for keys that are not LoRA on a known target)."""
    modules: dict[str, set[str]] = {}
    for key in mine:
        match = _LORA_KEY.match(key)
        if match is None:
            raise ValueError(
                f"load_adapter: key {key!r} of the block is not a lora_A / lora_B weight (modules_to_save, DoRA's "
                "magnitude or a LoRA bias are not supported)"
            )
        modules.setdefault(match.group(1), set()).add(match.group(2))
    for module, ab in modules.items():
        if ab != {"A", "B"}:
            missing = ({"A", "B"} - ab).pop()
            raise ValueError(f"load_adapter: {module}.lora_{missing}.weight is missing (its lora_{ab.pop()} is there)")

    plan = _Plan()
    experts = names.experts()
    shared_names = {}
    for prefix in names.shared():
        for spelling in (names.layout.shared_names, GATE_UP_DOWN, W1_W3_W2):
            for target, name in zip(_GUD, spelling, strict=True):
                shared_names[prefix + name] = target
    per_expert = re.compile(re.escape(experts) + r"\.(\d+)\.(\w+)$")
    expert_names = {n: t for spelling in (GATE_UP_DOWN, W1_W3_W2) for n, t in zip(spelling, _GUD, strict=True)}
    nested = []
    for module in modules:
        if module == names.router():
            plan.router = module
        elif module in (experts, experts + ".base_layer"):
            nested.append(module)
        elif module in shared_names:
            plan.shared[shared_names[module]] = module
        elif module == names.prefix + _SHARED_GATE:
            plan.shared["gate_kernel"] = module
        elif (m := per_expert.match(module)) and m.group(2) in expert_names:
            plan.per_expert[(int(m.group(1)), expert_names[m.group(2)])] = module
        else:
            raise _Unknown(f"{module}.lora_A.weight is not a LoRA target of this block")
    if nested:
        plan.fused = _fused_order(nested, experts, config)
    if plan.shared and cfg.shared_expert == SharedExpert.NONE:
        raise ValueError(f"load_adapter: {sorted(plan.shared.values())} adapt a shared expert, but cfg has none")
    if "gate_kernel" in plan.shared and cfg.shared_expert != SharedExpert.SIGMOID_GATED:
        raise ValueError(f"load_adapter: {plan.shared['gate_kernel']} adapts a shared-expert gate; cfg has none")
    return plan


def _fused_order(nested: list[str], experts: str, config: AdapterConfig) -> dict[str, str]:
    """Which of gate_up_proj / down_proj the wrappers at `experts.lora_*` and `experts.base_layer.lora_*` adapt.

    peft wraps a module's targeted parameters in their registration order (gate_up_proj, then down_proj), each
    wrapper around the previous one (tuners_utils.BaseTuner._inject_parameters): with both targeted the inner
    one, `experts.base_layer`, is gate_up_proj and the outer, `experts`, down_proj; with one, it is at `experts`.
    Which ones are targeted is read from `target_parameters`.
    """
    targeted = [p for p in _FUSED if config.targets_parameter(f"{experts}.{p}")]
    if experts + ".base_layer" in nested:
        if experts not in nested:
            raise ValueError(f"load_adapter: {experts}.base_layer.lora_A.weight without {experts}.lora_A.weight")
        return {"gate_up_proj": experts + ".base_layer", "down_proj": experts}
    if len(targeted) == 1:
        return {targeted[0]: experts}
    raise ValueError(
        f"load_adapter: {experts}.lora_A.weight adapts one expert tensor, but target_parameters="
        f"{list(config.target_parameters)} names {targeted or 'neither'} of {list(_FUSED)} for it"
    )


def _check(key: str, array: np.ndarray, expected: tuple[int, ...], what: str) -> None:
    if array.shape != expected:
        raise ValueError(f"load_adapter: {key} has shape {array.shape}, expected {expected} ({what})")


def _refuse_rank_zero(lora: LoRAParams, who: str) -> None:
    """`ValueError` naming the target when a target of `lora` has rank 0: peft refuses r <= 0, so `save_adapter`
    writes no such file and `load_adapter` reads none (`AdapterConfig.rank_alpha`)."""
    for name, pair in lora.pairs().items():
        if pair.rank <= 0:
            raise ValueError(
                f"{who}: target {name} has rank {pair.rank} (A {tuple(pair.a.shape)}); peft refuses r <= 0: "
                "leave the target out (None) instead"
            )


def _plain(tensors: dict[str, np.ndarray], module: str, n_in: int, n_out: int, config: AdapterConfig) -> LoRAPair:
    """A 2-D target (nn.Linear, or a 2-D parameter): A [r, in], B [out, r].

    Its name for rank_pattern / alpha_pattern: `module.weight` when `target_parameters` names that parameter (a
    ParamWrapper), else the module name (a lora.Linear)."""
    a, b = tensors[module + ".lora_A.weight"], tensors[module + ".lora_B.weight"]
    weight = module + ".weight"
    r, alpha = config.rank_alpha(weight if config.targets_parameter(weight) else module)
    _check(module + ".lora_A.weight", a, (r, n_in), f"[r, in] with r={r} from the adapter config")
    _check(module + ".lora_B.weight", b, (n_out, r), f"[out, r] with r={r}")
    return LoRAPair(jnp.asarray(a), jnp.asarray(b), jnp.float32(config.scale(r, alpha)))


def _shared_shape(target: str, cfg: MoEConfig) -> tuple[int, int]:
    H, Is = cfg.hidden_size, cfg.shared_intermediate_size
    return {"gate": (H, Is), "up": (H, Is), "down": (Is, H), "gate_kernel": (H, 1)}[target]


def _fused(
    tensors: dict[str, np.ndarray], module: str, projection: str, cfg: MoEConfig, config: AdapterConfig, names: _Names
) -> dict[str, LoRAPair]:
    """The pairs of one fused 3-D expert tensor (peft.tuners.lora.layer.ParamWrapper).

    PEFT's (in, out) of a parameter [E, d1, d2] is (d2, d1) (swapped) unless the experts module has
    `is_transposed` (gpt-oss), then (d1, d2). A [r·E, in] reshapes to [E, r, in]; B [out, r·E] to [out, r, E];
    the parameter's delta is `s · einsum("ore,eri->eoi")` (swapped) or `->eio`. In moejax's [out, in] terms:
    standard and gpt-oss: a = A_e, b = B_e; Llama-4 (`[E, H, 2I]` without `is_transposed`): a = B_eᵀ, b = A_eᵀ.
    """
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    kind = names.layout.experts
    if kind not in ("standard", "gpt_oss", "llama4"):
        raise NotImplementedError(f"load_adapter: fused experts in the {names.layout.name!r} layout ({kind})")
    # rows of the parameter: LongCat's gate_up_proj has rows for its zero experts
    E_param = cfg.num_selectable if (names.layout.zero_expert_rows and projection == "gate_up_proj") else E
    width = 2 * I if projection == "gate_up_proj" else I
    # (in, out) as PEFT sees them, and whether PEFT's A is moejax's a
    if kind == "llama4":
        peft_in, peft_out = (width, H) if projection == "gate_up_proj" else (H, width)
    else:
        peft_in, peft_out = (H, width) if projection == "gate_up_proj" else (width, H)
    ka, kb = module + ".lora_A.weight", module + ".lora_B.weight"
    a, b = tensors[ka], tensors[kb]
    param = f"{names.experts()}.{projection}"
    r, alpha = config.rank_alpha(param)
    _check(ka, a, (r * E_param, peft_in), f"{param}: [r·E, in] with r={r}, E={E_param}")
    _check(kb, b, (peft_out, r * E_param), f"{param}: [out, r·E] with r={r}, E={E_param}")
    a_e = a.reshape(E_param, r, peft_in)[:E]  # [E, r, in]
    b_e = b.reshape(peft_out, r, E_param).transpose(2, 0, 1)[:E]  # [E, out, r]
    if kind == "llama4":
        a_e, b_e = b_e.transpose(0, 2, 1), a_e.transpose(0, 2, 1)
    s = jnp.float32(config.scale(r, alpha))
    pair = lambda bb: LoRAPair(jnp.asarray(a_e), jnp.asarray(np.ascontiguousarray(bb)), s)
    if projection == "down_proj":
        return {"experts.down": pair(b_e)}
    if kind == "gpt_oss":  # gate in the even columns of gate_up_proj, up in the odd
        return {"experts.gate": pair(b_e[:, 0::2]), "experts.up": pair(b_e[:, 1::2])}
    return {"experts.gate": pair(b_e[:, :I]), "experts.up": pair(b_e[:, I:])}


def _per_expert(
    tensors: dict[str, np.ndarray], modules: dict[tuple[int, str], str], cfg: MoEConfig, config: AdapterConfig
) -> dict[str, LoRAPair]:
    """Per-expert nn.Linear targets (`experts.{e}.gate_proj` / `w1`, adapters of transformers-4 models); experts
    the adapter lacks get zeros."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    out = {}
    for target in ("gate", "up", "down"):
        present = {e: m for (e, t), m in modules.items() if t == target}
        if not present:
            continue
        if max(present) >= E:
            raise ValueError(
                f"load_adapter: {present[max(present)]}.lora_A.weight names expert {max(present)}; cfg has {E}"
            )
        ranks = {config.rank_alpha(m) for m in present.values()}
        scales = {config.scale(r, alpha) for r, alpha in ranks}
        if len({r for r, _ in ranks}) > 1 or len(scales) > 1:
            raise NotImplementedError(
                f"load_adapter: the experts' {target} targets have different (r, alpha) {sorted(ranks)}"
            )
        pairs = {e: _plain(tensors, m, *shapes[target], config) for e, m in present.items()}
        first = next(iter(pairs.values()))
        zero_a, zero_b = np.zeros(first.a.shape, first.a.dtype), np.zeros(first.b.shape, first.b.dtype)
        a = jnp.stack([pairs[e].a if e in pairs else zero_a for e in range(E)])
        b = jnp.stack([pairs[e].b if e in pairs else zero_b for e in range(E)])
        out[f"experts.{target}"] = LoRAPair(a, b, first.scale)
    return out


# -- writing -----------------------------------------------------------------------------------------------------


def save_adapter(
    lora: LoRAParams,
    cfg: MoEConfig,
    layer_idx: int,
    adapter_dir: str | os.PathLike,
    *,
    family: str,
    use_rslora: bool = False,
) -> None:
    """Write one block's adapter into a PEFT adapter directory that `load_adapter` (and peft 0.21) reads.

    The block's module names are the family's transformers-5 in-memory names, and every target is a
    `target_parameters` entry: the router's and the shared expert's 2-D weights, the routed experts' fused
    gate_up_proj and down_proj (each written when one of its projections is set). gate
    and up become one gate_up_proj target: with the same A and scale it is shared (rank r), otherwise A is
    the concatenation `[A_gate; A_up]` and B block-diagonal (rank r_gate + r_up; peft's PeftConcatenate does the
    same), both exact. r and alpha per target go to `rank_pattern` / `alpha_pattern` (alpha = s·r, or s·√r).

    An existing adapter in `adapter_dir` is merged into, as `save_layer` does: its tensors for other layers and
    other modules stay; the layer's old block tensors are replaced; its config keeps its own defaults and
    patterns. A target it already holds at the same rank keeps the config's alpha (B is rescaled by s / s_old,
    so the config need not change), other targets get `rank_pattern` / `alpha_pattern` entries that match only
    their own name, ahead of the existing ones.

    The write is a transaction (`moejax.hf.transaction`: lock, temporary files fsynced, `os.replace`). The
    config is swapped in first, then the weights: the new config only adds descriptions of tensors the old
    weights lack, so the old weights read the same under it, and a failed or killed save leaves the old adapter
    with the alphas of its own weights. (A target whose rank changes, or a layer that gains a second fused expert
    target, cannot be described for both: between the two renames `load_adapter` refuses that layer, naming the
    key, until a retry completes.)

    Raises:
      ValueError: a stack instead of one adapter, unknown family, gate and up with different scales; an
        existing adapter it cannot merge into (naming the field of its adapter_config.json: another `peft_type`,
        `use_rslora`, model (`auto_mapping`), `layers_to_transform` without this layer, an option that changes
        what the weights mean, `target_parameters` that fuse differently).
      NotImplementedError: the family's experts are not in the standard layout (gpt-oss, Llama-4).
      TimeoutError: another writer held the directory's lock for `transaction.LOCK_TIMEOUT_S` seconds.
    """
    if lora.is_stack:
        raise ValueError("save_adapter: pass one adapter, not a stack")
    _refuse_rank_zero(lora, "save_adapter")
    if family not in BY_NAME:
        raise ValueError(f"save_adapter: unknown family {family!r}; one of {sorted(BY_NAME)}")
    fam = BY_NAME[family]
    names = _candidates(fam, layer_idx)[0]
    if lora.experts is not None and (names.layout.experts != "standard" or names.layout.zero_expert_rows):
        raise NotImplementedError(f"save_adapter: routed-expert adapters of {family} (its expert layout)")
    targets = _targets(lora, cfg, names)
    if not targets:
        raise ValueError("save_adapter: the adapter has no targets")
    library = f"transformers.models.{fam.model_types[0]}.modeling_{fam.model_types[0]}"
    path = os.fspath(adapter_dir)
    with transaction.Transaction(path) as tx:
        config_path, weights_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
        old = None
        if os.path.exists(config_path):
            with open(config_path) as f:
                old = json.load(f)
        if old is None:  # weights without a config cannot be merged into: their ranks and alphas are unknown
            config, tensors = _fresh(targets, names, use_rslora, library), {}
        else:
            head: dict[str, Any] = {}
            if os.path.exists(weights_path):
                _, head = files.header(weights_path)
                head.pop("__metadata__", None)
            config = _merged(old, config_path, targets, names, layer_idx, use_rslora, library, set(head))
            mine = _candidates(fam, layer_idx)  # the layer's old block goes; everything else stays
            kept = [k for k in head if not any(n.owns(_module_of(k.removeprefix(PREFIX))) for n in mine)]
            tensors = files.read_file(weights_path, kept) if kept else {}
        tensors |= _tensors(targets, names, config)
        if config != old:  # first: it only adds what the old weights lack (docstring)
            tx.replace_json(CONFIG, config, indent=2)
        from safetensors.numpy import save

        tx.replace(WEIGHTS, save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata={"format": "pt"}))
        tx.commit()


@dataclasses.dataclass
class _Target:
    """One target of the block to write: `module` holds `lora_A` / `lora_B` (a fused one's module is decided by
    which fused tensors the config targets), `param` its `target_parameters` entry and the name its rank and
    alpha are looked up by, a `[r, in]` and b `[out, r]` as PEFT stores them, s the scale."""

    module: str
    param: str
    a: np.ndarray
    b: np.ndarray
    r: int
    s: float
    fused: str | None = None  # "gate_up_proj" / "down_proj"


def _module_of(key: str) -> str:
    match = _LORA_KEY.match(key)
    return match.group(1) if match else key


def _targets(lora: LoRAParams, cfg: MoEConfig, names: _Names) -> list[_Target]:
    """The block's targets in PEFT's layout (module names without `base_model.model.`)."""
    out = []
    host = np.asarray
    if lora.router is not None:
        p = lora.router
        out.append(_Target(names.router(), names.router() + ".weight", host(p.a), host(p.b), p.rank, float(p.scale)))
    if lora.experts is not None:
        E, I = cfg.num_experts, cfg.intermediate_size
        ex = lora.experts
        fused = {}
        if ex.gate is not None or ex.up is not None:
            fused["gate_up_proj"] = _gate_up(ex.gate, ex.up, I)
        if ex.down is not None:
            fused["down_proj"] = (host(ex.down.a), host(ex.down.b), float(ex.down.scale))
        for projection, (a, b, s) in fused.items():
            r, n_in, n_out = a.shape[1], a.shape[2], b.shape[1]
            a_flat = a.reshape(E * r, n_in)  # expert-major
            b_flat = b.transpose(1, 2, 0).reshape(n_out, r * E)  # expert-minor
            param = f"{names.experts()}.{projection}"
            out.append(_Target(names.experts(), param, a_flat, b_flat, r, s, projection))
    if lora.shared is not None:
        spelling = dict(zip(_GUD, names.layout.shared_names, strict=True))
        for target in ("gate", "up", "down", "gate_kernel"):
            p = getattr(lora.shared, target)
            if p is None:
                continue
            if target == "gate_kernel":
                module = names.prefix + _SHARED_GATE
            else:
                module = names.prefix + names.layout.shared_prefix + spelling[target]
            # as a 2-D parameter: peft would take a module name ending in gate_proj / up_proj / down_proj for the
            # routed experts' on the families it converts (docs/LORA.md)
            out.append(_Target(module, module + ".weight", host(p.a), host(p.b), p.rank, float(p.scale)))
    return out


def _alpha(s: float, r: int, use_rslora: bool) -> float:
    return s * (math.sqrt(r) if use_rslora else r)


def _fresh(targets: list[_Target], names: _Names, use_rslora: bool, library: str) -> dict[str, Any]:
    ranks = {re.escape(t.param): t.r for t in targets}
    alphas = {re.escape(t.param): _alpha(t.s, t.r, use_rslora) for t in targets}
    return {
        "peft_type": "LORA",
        "r": targets[0].r,
        "lora_alpha": _alpha(targets[0].s, targets[0].r, use_rslora),
        "use_rslora": use_rslora,
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "target_modules": [],
        "target_parameters": [t.param for t in targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "lora_bias": False,
        "fan_in_fan_out": False,
        "auto_mapping": {"parent_library": library},
    }


def _targets_module(config: Mapping[str, Any], module: str) -> bool:
    """Whether `target_modules` names `module` (peft's check_target_module_exists: a regex string matches the whole
    name; a list matches a name or a suffix after a dot)."""
    wanted = config.get("target_modules") or []
    if isinstance(wanted, str):
        return re.fullmatch(wanted, module) is not None
    return any(module == t or module.endswith("." + t) for t in wanted)


def _lookup(config: AdapterConfig, target: _Target) -> str:
    """The name `load_adapter` looks the target's rank and alpha up by (see `_plain`)."""
    if target.fused is None and not config.targets_parameter(target.param):
        return target.module
    return target.param


def _merged(
    old: dict[str, Any],
    where: str,
    targets: list[_Target],
    names: _Names,
    layer: int,
    use_rslora: bool,
    library: str,
    held: set[str],
) -> dict[str, Any]:
    """The existing adapter config with the targets added (ValueError naming a field that conflicts). A target the
    old weights (keys `held`) already hold at the same rank keeps its alpha: its B is rescaled in place."""
    if old.get("peft_type") != "LORA":
        raise ValueError(f"save_adapter: {where} has peft_type={old.get('peft_type')!r}; only a LoRA adapter merges")
    for name, default in _UNSUPPORTED.items():
        value = old.get(name, default)
        if value and value != default:
            raise ValueError(f"save_adapter: {where} has {name}={value!r}; moejax writes only {name}={default!r}")
    if old.get("init_lora_weights", True) not in (True, False, "gaussian"):
        raise ValueError(
            f"save_adapter: {where} has init_lora_weights={old['init_lora_weights']!r}, which assumes a modified "
            "base model; moejax's weights cannot be merged into it"
        )
    if bool(old.get("use_rslora", False)) != use_rslora:
        raise ValueError(f"save_adapter: {where} has use_rslora={old.get('use_rslora')!r}; saving with {use_rslora}")
    theirs = (old.get("auto_mapping") or {}).get("parent_library")
    if theirs and theirs != library:
        raise ValueError(f"save_adapter: {where} has auto_mapping.parent_library={theirs!r}, not {library!r}")
    only = old.get("layers_to_transform")
    if only is not None and layer not in ([only] if isinstance(only, int) else only):
        raise ValueError(f"save_adapter: {where} has layers_to_transform={only!r}, without layer {layer}")
    before = AdapterConfig.from_json(old, where)
    config = json.loads(json.dumps(old))
    params = list(config.get("target_parameters") or [])
    for t in targets:
        described = before.targets_parameter(t.param) or (t.fused is None and _targets_module(old, t.module))
        if not described and t.param not in params:
            params.append(t.param)
    config["target_parameters"] = params
    if config.get("init_lora_weights", True) is not True:
        # peft creates every targeted module; one whose weights are not in the file must start as a zero delta
        config["init_lora_weights"] = True
    after = AdapterConfig.from_json(config, where)
    fused = {t.fused for t in targets if t.fused}
    targeted = {p for p in _FUSED if after.targets_parameter(f"{names.experts()}.{p}")}
    if fused and fused != targeted:
        raise ValueError(
            f"save_adapter: {where} has target_parameters={params} naming {sorted(targeted)} of layer {layer}'s "
            f"experts; this adapter has {sorted(fused)} (peft nests the wrappers by that list)"
        )
    targeted_before = {p for p in _FUSED if before.targets_parameter(f"{names.experts()}.{p}")}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for t in targets:
        name = _lookup(after, t)
        r0, alpha0 = before.rank_alpha(name)
        s0 = before.scale(r0, alpha0) if r0 > 0 else 0.0
        if r0 == t.r and math.isclose(s0, t.s, rel_tol=1e-6):  # the same, up to the float32 of a loaded scale
            continue
        if f"{PREFIX}{_module_for(t, targeted_before)}.lora_A.weight" in held and r0 == t.r and s0 != 0:
            t.b = (t.b.astype(np.float64) * (t.s / s0)).astype(t.b.dtype)
            t.s = s0
            continue
        ranks[re.escape(name)] = t.r
        alphas[re.escape(name)] = _alpha(t.s, t.r, use_rslora)
    # first: the first matching pattern wins (peft.utils.other.get_pattern_key), and these match one name each
    for field, new in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        rest = {k: v for k, v in (config.get(field) or {}).items() if k not in new}
        config[field] = {**new, **rest}
    return config


def _module_for(target: _Target, targeted: set[str]) -> str:
    """A fused target's module: with both fused tensors targeted, peft nests gate_up_proj inside (`_fused_order`)."""
    if target.fused == "gate_up_proj" and len(targeted) == 2:
        return target.module + ".base_layer"
    return target.module


def _tensors(targets: list[_Target], names: _Names, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    after = AdapterConfig.from_json(config)
    targeted = {p for p in _FUSED if after.targets_parameter(f"{names.experts()}.{p}")}
    out = {}
    for t in targets:
        module = _module_for(t, targeted)
        out[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(t.a)
        out[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(t.b)
    return out


def _gate_up(gate: LoRAPair | None, up: LoRAPair | None, I: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(A [E, r, H], B [E, 2I, r], s) of gate_up_proj from the gate and up pairs (one may be None; see
    `save_adapter`)."""
    scale = float((gate or up).scale)
    if gate is not None and up is not None and float(up.scale) != scale:
        raise ValueError(
            f"save_adapter: experts.gate and experts.up have scales {float(gate.scale)}, {float(up.scale)}"
        )
    if gate is not None and up is not None and np.array_equal(np.asarray(gate.a), np.asarray(up.a)):
        return np.asarray(gate.a), np.concatenate([np.asarray(gate.b), np.asarray(up.b)], axis=1), scale
    parts_a, blocks = [], []
    for half, p in enumerate((gate, up)):
        if p is None:
            continue
        b = np.zeros((*p.b.shape[:1], 2 * I, p.rank), np.asarray(p.b).dtype)
        b[:, half * I : (half + 1) * I] = np.asarray(p.b)
        parts_a.append(np.asarray(p.a))
        blocks.append(b)
    return np.concatenate(parts_a, axis=1), np.concatenate(blocks, axis=2), scale
