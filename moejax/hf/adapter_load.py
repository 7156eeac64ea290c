"""Reading one MoE block's LoRA adapter from a PEFT adapter directory (`load_adapter`), as
`PeftModel.save_pretrained` writes it: keys `base_model.model.<module>.lora_A.weight` `[r, in]` and `.lora_B.weight`
`[out, r]`; a fused 3-D expert tensor targeted through `target_parameters` has `A [r·E, in]` (expert-major) and
`B [out, r·E]` (expert-minor), both expert tensors targeted nest two wrappers (docs/LORA.md, "PEFT layout").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from moejax.config import Activation, MoEConfig, SharedExpert
from moejax.hf import files
from moejax.hf.adapter_config import (
    CONFIG,
    FUSED,
    GUD,
    LORA_KEY,
    PREFIX,
    SHARED_GATE,
    WEIGHTS,
    AdapterConfig,
    BlockNames,
    candidates,
)
from moejax.hf.expert_tensors import split_gate_up
from moejax.hf.families import BY_MODEL_TYPE, BY_NAME, FAMILY_RECORDS, Family
from moejax.hf.keys import EXPERT_NAMES
from moejax.lora import LoRAPair, LoRAParams, from_pairs

_LAYER_KEY = re.compile(r"\blayers\.(\d+)\.")


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
        for names in candidates(fam, layer_idx):
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
    zero_rows = lambda keys: keys.zero_expert_rows and cfg.num_zero_experts > 0
    readings = {(names.keys.experts, zero_rows(names.keys), plan.signature()) for _, names, plan in plans}
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

    def build(
        self, tensors: dict[str, np.ndarray], cfg: MoEConfig, config: AdapterConfig, names: BlockNames
    ) -> LoRAParams:
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


def _plan(mine: list[str], names: BlockNames, cfg: MoEConfig, config: AdapterConfig) -> _Plan:
    """Sort the block's keys into targets (ValueError / _Unknown for keys that are not LoRA on a known target)."""
    modules: dict[str, set[str]] = {}
    for key in mine:
        match = LORA_KEY.match(key)
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
        for spelling in (names.keys.shared_names, *EXPERT_NAMES):
            for target, name in zip(GUD, spelling, strict=True):
                shared_names[prefix + name] = target
    per_expert = re.compile(re.escape(experts) + r"\.(\d+)\.(\w+)$")
    expert_names = {n: t for spelling in EXPERT_NAMES for n, t in zip(spelling, GUD, strict=True)}
    nested = []
    for module in modules:
        if module == names.router():
            plan.router = module
        elif module in (experts, experts + ".base_layer"):
            nested.append(module)
        elif module in shared_names:
            plan.shared[shared_names[module]] = module
        elif module == names.prefix + SHARED_GATE:
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
    targeted = [p for p in FUSED if config.targets_parameter(f"{experts}.{p}")]
    if experts + ".base_layer" in nested:
        if experts not in nested:
            raise ValueError(f"load_adapter: {experts}.base_layer.lora_A.weight without {experts}.lora_A.weight")
        return {"gate_up_proj": experts + ".base_layer", "down_proj": experts}
    if len(targeted) == 1:
        return {targeted[0]: experts}
    raise ValueError(
        f"load_adapter: {experts}.lora_A.weight adapts one expert tensor, but target_parameters="
        f"{list(config.target_parameters)} names {targeted or 'neither'} of {list(FUSED)} for it"
    )


def _check(key: str, array: np.ndarray, expected: tuple[int, ...], what: str) -> None:
    if array.shape != expected:
        raise ValueError(f"load_adapter: {key} has shape {array.shape}, expected {expected} ({what})")


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
    tensors: dict[str, np.ndarray],
    module: str,
    projection: str,
    cfg: MoEConfig,
    config: AdapterConfig,
    names: BlockNames,
) -> dict[str, LoRAPair]:
    """The pairs of one fused 3-D expert tensor (peft.tuners.lora.layer.ParamWrapper).

    PEFT's (in, out) of a parameter [E, d1, d2] is (d2, d1) (swapped) unless the experts module has
    `is_transposed` (gpt-oss), then (d1, d2). A [r·E, in] reshapes to [E, r, in]; B [out, r·E] to [out, r, E];
    the parameter's delta is `s · einsum("ore,eri->eoi")` (swapped) or `->eio`. In moejax's [out, in] terms:
    standard and gpt-oss: a = A_e, b = B_e; Llama-4 (`[E, H, 2I]` without `is_transposed`): a = B_eᵀ, b = A_eᵀ.
    """
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    kind = names.keys.experts
    if kind not in ("standard", "gpt_oss", "llama4"):
        raise NotImplementedError(f"load_adapter: fused experts in the {names.keys.name!r} layout ({kind})")
    # rows of the parameter: LongCat's gate_up_proj has rows for its zero experts
    E_param = cfg.num_selectable if (names.keys.zero_expert_rows and projection == "gate_up_proj") else E
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
    gate, up = split_gate_up(kind, b_e, 1)  # gpt-oss: gate the even rows of gate_up_proj, up the odd ones
    return {"experts.gate": pair(gate), "experts.up": pair(up)}


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
