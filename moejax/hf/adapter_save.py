"""Writing one MoE block's LoRA adapter into a PEFT adapter directory (`save_adapter`, a transaction), merged into
an existing adapter; `load_adapter` and peft 0.21 read it back."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from moejax.config import MoEConfig
from moejax.hf import adapter_config as peft
from moejax.hf import files, transaction
from moejax.hf.adapter_config import AdapterConfig, BlockNames, candidates, refuse_rank_zero
from moejax.hf.expert_tensors import join_gate_up
from moejax.hf.families import BY_NAME
from moejax.lora import LoRAPair, LoRAParams


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
    refuse_rank_zero(lora, "save_adapter")
    if family not in BY_NAME:
        raise ValueError(f"save_adapter: unknown family {family!r}; one of {sorted(BY_NAME)}")
    fam = BY_NAME[family]
    names = candidates(fam, layer_idx)[0]
    if lora.experts is not None and (names.keys.experts != "standard" or names.keys.zero_expert_rows):
        raise NotImplementedError(f"save_adapter: routed-expert adapters of {family} (its expert layout)")
    targets = _targets(lora, cfg, names)
    if not targets:
        raise ValueError("save_adapter: the adapter has no targets")
    library = f"transformers.models.{fam.model_types[0]}.modeling_{fam.model_types[0]}"
    path = os.fspath(adapter_dir)
    with transaction.Transaction(path) as tx:
        config_path, weights_path = os.path.join(path, peft.CONFIG), os.path.join(path, peft.WEIGHTS)
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
            mine = candidates(fam, layer_idx)  # the layer's old block goes; everything else stays
            kept = [k for k in head if not any(n.owns(_module_of(k.removeprefix(peft.PREFIX))) for n in mine)]
            tensors = files.read_file(weights_path, kept) if kept else {}
        tensors |= _tensors(targets, names, config)
        if config != old:  # first: it only adds what the old weights lack (docstring)
            tx.replace_json(peft.CONFIG, config, indent=2)
        from safetensors.numpy import save

        data = save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata={"format": "pt"})
        tx.replace(peft.WEIGHTS, data)
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
    match = peft.LORA_KEY.match(key)
    return match.group(1) if match else key


def _targets(lora: LoRAParams, cfg: MoEConfig, names: BlockNames) -> list[_Target]:
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
        spelling = dict(zip(peft.GUD, names.keys.shared_names, strict=True))
        for target in ("gate", "up", "down", "gate_kernel"):
            p = getattr(lora.shared, target)
            if p is None:
                continue
            if target == "gate_kernel":
                module = names.prefix + peft.SHARED_GATE
            else:
                module = names.prefix + names.keys.shared_prefix + spelling[target]
            # as a 2-D parameter: peft would take a module name ending in gate_proj / up_proj / down_proj for the
            # routed experts' on the families it converts (docs/LORA.md)
            out.append(_Target(module, module + ".weight", host(p.a), host(p.b), p.rank, float(p.scale)))
    return out


def _alpha(s: float, r: int, use_rslora: bool) -> float:
    return s * (math.sqrt(r) if use_rslora else r)


def _fresh(targets: list[_Target], names: BlockNames, use_rslora: bool, library: str) -> dict[str, Any]:
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
    names: BlockNames,
    layer: int,
    use_rslora: bool,
    library: str,
    held: set[str],
) -> dict[str, Any]:
    """The existing adapter config with the targets added (ValueError naming a field that conflicts). A target the
    old weights (keys `held`) already hold at the same rank keeps its alpha: its B is rescaled in place."""
    if old.get("peft_type") != "LORA":
        raise ValueError(f"save_adapter: {where} has peft_type={old.get('peft_type')!r}; only a LoRA adapter merges")
    for name, default in peft.UNSUPPORTED.items():
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
    targeted = {p for p in peft.FUSED if after.targets_parameter(f"{names.experts()}.{p}")}
    if fused and fused != targeted:
        raise ValueError(
            f"save_adapter: {where} has target_parameters={params} naming {sorted(targeted)} of layer {layer}'s "
            f"experts; this adapter has {sorted(fused)} (peft nests the wrappers by that list)"
        )
    targeted_before = {p for p in peft.FUSED if before.targets_parameter(f"{names.experts()}.{p}")}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for t in targets:
        name = _lookup(after, t)
        r0, alpha0 = before.rank_alpha(name)
        s0 = before.scale(r0, alpha0) if r0 > 0 else 0.0
        if r0 == t.r and math.isclose(s0, t.s, rel_tol=1e-6):  # the same, up to the float32 of a loaded scale
            continue
        if f"{peft.PREFIX}{_module_for(t, targeted_before)}.lora_A.weight" in held and r0 == t.r and s0 != 0:
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


def _tensors(targets: list[_Target], names: BlockNames, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    after = AdapterConfig.from_json(config)
    targeted = {p for p in peft.FUSED if after.targets_parameter(f"{names.experts()}.{p}")}
    out = {}
    for t in targets:
        module = _module_for(t, targeted)
        out[f"{peft.PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(t.a)
        out[f"{peft.PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(t.b)
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
        return np.asarray(gate.a), join_gate_up("standard", np.asarray(gate.b), np.asarray(up.b), 1), scale
    parts_a, blocks = [], []
    for half, p in enumerate((gate, up)):
        if p is None:
            continue
        b = np.zeros((*p.b.shape[:1], 2 * I, p.rank), np.asarray(p.b).dtype)
        b[:, half * I : (half + 1) * I] = np.asarray(p.b)
        parts_a.append(np.asarray(p.a))
        blocks.append(b)
    return np.concatenate(parts_a, axis=1), np.concatenate(blocks, axis=2), scale
