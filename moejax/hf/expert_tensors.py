"""The routed experts of one block in a state dict, both ways: one codec per expert tensor scheme.

A key layout's `experts` names the scheme: "standard" (`gate_up_proj [E, 2I, H]`, gate rows first), "gpt_oss"
(`[E, H, 2I]`, gate in the even columns, biases; on disk MXFP4 `_blocks` / `_scales` with gate the even rows),
"llama4" (`[E, H, 2I]`, halves), "stacked_moe" (Step-3.7 on disk: `moe.{gate,up,down}_proj.weight [E, out, in]`);
per-expert Linear keys `experts.{e}.{gate,up,down}_proj.*` are read in every scheme but Step-3.7's. Dense tensors
give `ExpertWeights` fields; quantized ones stay in their format (`moejax.hf.quant_tensors`). The adapter codecs
(`moejax.hf.adapter_load`) split a fused gate_up the same way (`split_gate_up`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from moejax.config import MoEConfig
from moejax.hf.keys import GATE_UP_DOWN, W1_W3_W2, BlockKeys, ExpertsKind, linear_names
from moejax.hf.quant_config import HfQuant
from moejax.hf.quant_tensors import BYTES, E8M0, per_expert_fields, per_expert_to_hf, take
from moejax.hf.state_dict import Reads, StateDict, activation_scales, to_numpy
from moejax.quantized.formats import QuantizedExperts, quantized_format
from moejax.weights import (
    ExpertFormat,
    Experts,
    ExpertWeights,
    PerExpert,
    as_stacked,
    check_experts,
    format_of,
    from_host,
)

_PER_EXPERT_KEY = re.compile(r"experts\.(\d+)\.")


# -- the fused gate_up tensor ----------------------------------------------------------------------------------


def split_gate_up(kind: ExpertsKind, fused: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) of a fused gate_up tensor along `axis`: gpt-oss interleaves them (gate the even entries, up the
    odd ones), every other scheme concatenates them (gate the first half)."""
    axis = axis % fused.ndim
    n = fused.shape[axis]
    pick = lambda s: fused[(slice(None),) * axis + (s,)]
    if kind == "gpt_oss":
        return pick(slice(0, None, 2)), pick(slice(1, None, 2))
    return pick(slice(0, n // 2)), pick(slice(n // 2, None))


def join_gate_up(kind: ExpertsKind, gate: np.ndarray, up: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of `split_gate_up`."""
    axis = axis % gate.ndim
    if kind == "gpt_oss":
        shape = (*gate.shape[:axis], 2 * gate.shape[axis], *gate.shape[axis + 1 :])
        return np.stack([gate, up], axis=axis + 1).reshape(shape)
    return np.concatenate([gate, up], axis=axis)


# -- quantized experts (host arrays <-> a quantized format) -------------------------------------------------------


def format_from_hf_tensors(
    tensors: Mapping[str, Any], cfg, quant: HfQuant, *, layout: str = "auto"
) -> QuantizedExperts | PerExpert:
    """One MoE block's routed experts from its checkpoint tensors (keys relative to the block) in `quant`'s format.

    Per-expert keys `experts.{e}.{gate,up,down}_proj.<suffix>` (Mixtral `w1/w3/w2`), or gpt-oss's fused
    `experts.gate_up_proj_blocks/_scales` (gate and up rows interleaved) and `experts.down_proj_blocks/_scales`
    with `experts.gate_up_proj_bias`, `experts.down_proj_bias`. Every array is checked against `cfg` (the message
    names the key). Host arrays (numpy, or anything `np.asarray` reads); the result is placed in `layout`.
    """
    fields = fields_from_hf_tensors(tensors, cfg, quant)
    experts = from_host(fields, quant.fmt, layout)
    check_experts(experts, cfg, "experts")
    return experts


def fields_from_hf_tensors(tensors: Mapping[str, Any], cfg, quant: HfQuant) -> dict[str, np.ndarray]:
    """`format_from_hf_tensors` on the host: `{field: np.ndarray [E, ...]}` for `moejax.weights.from_host`."""
    if quant.source != "gpt-oss":
        return per_expert_fields(tensors, cfg, quant)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    scheme = quant.fmt.scheme
    if scheme.kind != "mxfp4":
        raise ValueError(f"the gpt-oss layout holds MXFP4, not {scheme.name}")
    fields: dict[str, np.ndarray] = {}
    for fused, parts, (n_out, n_in) in (
        ("experts.gate_up_proj", ("gate", "up"), (2 * I, H)),
        ("experts.down_proj", ("down",), (H, I)),
    ):
        scheme.check_dims(n_in, f"{fused}_blocks (in={n_in})")
        blocks = take(tensors, f"{fused}_blocks", (E, n_out, n_in // 32, 16), dtypes=BYTES)
        scales = take(tensors, f"{fused}_scales", (E, n_out, n_in // 32), dtypes=E8M0).view(np.uint8)
        for k, arr in (("q", blocks.reshape(E, n_out, n_in // 2)), ("scale", scales)):
            split = split_gate_up("gpt_oss", arr, 1) if len(parts) == 2 else (arr,)  # [E, out, ...] each
            for p, part in zip(parts, split, strict=True):
                fields[f"{p}_{k}"] = np.ascontiguousarray(part.transpose(0, 2, 1))  # [E, in(/2 or /32), out]
    if cfg.expert_bias:
        bias = take(tensors, "experts.gate_up_proj_bias", (E, 2 * I))
        fields["gate_bias"], fields["up_bias"] = split_gate_up("gpt_oss", bias, 1)
        fields["down_bias"] = take(tensors, "experts.down_proj_bias", (E, H))
    return fields


def format_to_hf_tensors(experts: Experts, quant: HfQuant) -> dict[str, np.ndarray]:
    """The inverse of `format_from_hf_tensors`: routed experts (either layout) -> checkpoint tensors (host numpy),
    keys relative to the block, in `quant.source`'s layout."""
    fmt = format_of(experts)
    if fmt is not quant.fmt:
        raise ValueError(f"experts are {fmt.__name__}, the checkpoint layout holds {quant.fmt.__name__}")
    fields = {name: np.asarray(v) for name, v in as_stacked(experts).fields().items()}
    if quant.source != "gpt-oss":
        return per_expert_to_hf(fields, quant)
    out: dict[str, np.ndarray] = {}
    E = fields["gate_q"].shape[0]
    for fused, parts in (("experts.gate_up_proj", ("gate", "up")), ("experts.down_proj", ("down",))):
        for k, suffix in (("q", "blocks"), ("scale", "scales")):
            arrays = [fields[f"{p}_{k}"].transpose(0, 2, 1) for p in parts]  # [E, out, ...]
            v = join_gate_up("gpt_oss", *arrays, 1) if len(parts) == 2 else arrays[0]
            out[f"{fused}_{suffix}"] = np.ascontiguousarray(v.reshape(E, v.shape[1], -1, 16) if k == "q" else v)
    if "gate_bias" in fields:
        out["experts.gate_up_proj_bias"] = join_gate_up("gpt_oss", fields["gate_bias"], fields["up_bias"], 1)
        out["experts.down_proj_bias"] = fields["down_bias"]
    return out


# -- reading a block's experts ---------------------------------------------------------------------------------


def experts_from_hf(
    sd: StateDict, block_keys: BlockKeys, cfg: MoEConfig, quant: HfQuant | None = None
) -> tuple[type[ExpertFormat], dict[str, np.ndarray]]:
    """The routed experts of one block: (their weight format, its fields as host arrays `[E, ...]`).

    The one place a checkpoint's expert tensors become a format: dense tensors give `ExpertWeights`
    (`[in, out]`, gate and up apart); with `quant` (the checkpoint's quantization) the experts stay in its
    quantized format (`fields_from_hf_tensors`). gpt-oss's MXFP4 blocks are read as the MXFP4 format without
    `quant` too (their keys say what they are).
    """
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    if quant is None and block_keys.experts == "gpt_oss" and "experts.gate_up_proj_blocks" in sd:
        quant = HfQuant(quantized_format("mxfp4"), "gpt-oss")
    if quant is not None:
        return quant.fmt, _quantized_experts(sd, block_keys, cfg, quant)
    if block_keys.experts == "stacked_moe":  # Step-3.7 on disk: stacked per layer, Linear [out, in] per expert
        return ExpertWeights, {
            "gate": sd.take("moe.gate_proj.weight", (E, I, H)).transpose(0, 2, 1),
            "up": sd.take("moe.up_proj.weight", (E, I, H)).transpose(0, 2, 1),
            "down": sd.take("moe.down_proj.weight", (E, H, I)).transpose(0, 2, 1),
        }
    if any(_PER_EXPERT_KEY.match(k) for k in sd.raw):
        return ExpertWeights, _per_expert(sd, cfg)
    if block_keys.experts == "gpt_oss":
        return ExpertWeights, _gpt_oss_experts(sd, cfg)
    if block_keys.experts == "llama4":  # transposed [in, out], concatenated halves
        gate_up = sd.take("experts.gate_up_proj", (E, H, 2 * I))
        gate, up = split_gate_up("llama4", gate_up, -1)
        return ExpertWeights, {"gate": gate, "up": up, "down": sd.take("experts.down_proj", (E, I, H))}
    # LongCat sizes gate_up_proj with the zero experts too; their rows are never used (docs/FAMILIES.md §11).
    rows = (E, cfg.num_selectable) if block_keys.zero_expert_rows else (E,)
    gate_up = sd.take("experts.gate_up_proj", *((r, 2 * I, H) for r in rows))[:E]
    down = sd.take("experts.down_proj", (E, H, I))
    gate, up = split_gate_up("standard", gate_up, 1)
    return ExpertWeights, {
        "gate": gate.transpose(0, 2, 1),
        "up": up.transpose(0, 2, 1),
        "down": down.transpose(0, 2, 1),
    }


def _quantized_experts(sd: StateDict, block_keys: BlockKeys, cfg: MoEConfig, quant: HfQuant) -> dict[str, np.ndarray]:
    """`fields_from_hf_tensors` of the expert keys; the keys it read are marked used, and so are the activation
    scales (weight-only: known and left unread); anything else under `experts.` is left for the unused-key check."""
    if block_keys.experts == "stacked_moe":
        raise NotImplementedError(
            f"quantized experts in the {block_keys.name} layout (stacked moe.*) are not supported"
        )
    if (quant.source == "gpt-oss") != (block_keys.experts == "gpt_oss"):
        what = "gpt-oss's fused MXFP4 blocks" if quant.source == "gpt-oss" else f"{quant.source} per-expert keys"
        raise ValueError(f"the {block_keys.name} layout does not hold {what}")
    tensors = Reads({k: to_numpy(v) for k, v in sd.raw.items() if k.startswith("experts.")})
    fields = fields_from_hf_tensors(tensors, cfg, quant)
    modules = [f"experts.{e}.{n}." for e in range(cfg.num_experts) for n in GATE_UP_DOWN + W1_W3_W2]
    sd.used |= tensors.read | activation_scales(tensors, modules)
    return fields


def _per_expert(sd: StateDict, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """`experts.{e}.{gate,up,down}_proj.weight` (or w1/w3/w2), Linear `[out, in]`, stacked on E."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    names = linear_names(sd.raw, "experts.0.")
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
    return {k: np.stack(v) for k, v in out.items() if v}


def _gpt_oss_experts(sd: StateDict, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """gpt-oss: `gate_up_proj [E, H, 2I]` with gate in the even columns and up in the odd ones, plus biases."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    gate, up = split_gate_up("gpt_oss", sd.take("experts.gate_up_proj", (E, H, 2 * I)), -1)
    gate_bias, up_bias = split_gate_up("gpt_oss", sd.take("experts.gate_up_proj_bias", (E, 2 * I)), -1)
    return {
        "gate": gate,
        "up": up,
        "down": sd.take("experts.down_proj", (E, I, H)),
        "gate_bias": gate_bias,
        "up_bias": up_bias,
        "down_bias": sd.take("experts.down_proj_bias", (E, H)),
    }


# -- writing a block's experts ---------------------------------------------------------------------------------


def experts_to_hf(
    flat: dict[str, np.ndarray], block_keys: BlockKeys, cfg: MoEConfig, experts: Literal["fused", "per_expert"]
) -> dict[str, np.ndarray]:
    """Dense routed experts (moejax's flat stacked arrays, `experts.gate` ...) -> the layout's keys."""
    if experts == "per_expert":
        if block_keys.experts == "stacked_moe":
            raise ValueError(f"the {block_keys.name} layout stores experts stacked: per-expert keys do not exist there")
        hf = _per_expert_to_hf(flat, block_keys, cfg)
    else:
        hf = _fused_to_hf(flat, block_keys)
    return hf | _zero_expert_rows(hf, block_keys, cfg) if block_keys.zero_expert_rows else hf


def _zero_expert_rows(hf: dict[str, np.ndarray], block_keys: BlockKeys, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """LongCat's gate_up_proj has rows for the zero experts too (never used; docs/FAMILIES.md §19.2): transformers
    refuses a checkpoint without them, so they are written as zeros."""
    zeros = cfg.num_zero_experts
    if "experts.gate_up_proj" in hf:
        gate_up = hf["experts.gate_up_proj"]
        return {"experts.gate_up_proj": np.concatenate([gate_up, np.zeros((zeros, *gate_up.shape[1:]), gate_up.dtype)])}
    pad = {}
    for e in range(cfg.num_experts, cfg.num_selectable):
        for name in block_keys.expert_names[:2]:
            weight = hf[f"experts.0.{name}.weight"]
            pad[f"experts.{e}.{name}.weight"] = np.zeros_like(weight)
    return pad


def _fused_to_hf(flat: dict[str, np.ndarray], block_keys: BlockKeys) -> dict[str, np.ndarray]:
    gate, up, down = flat["experts.gate"], flat["experts.up"], flat["experts.down"]
    if block_keys.experts == "gpt_oss":
        return {
            "experts.gate_up_proj": join_gate_up("gpt_oss", gate, up, -1),
            "experts.gate_up_proj_bias": join_gate_up(
                "gpt_oss", flat["experts.gate_bias"], flat["experts.up_bias"], -1
            ),
            "experts.down_proj": down,
            "experts.down_proj_bias": flat["experts.down_bias"],
        }
    if block_keys.experts == "llama4":
        return {"experts.gate_up_proj": join_gate_up("llama4", gate, up, -1), "experts.down_proj": down}
    if block_keys.experts == "stacked_moe":
        return {
            "moe.gate_proj.weight": gate.transpose(0, 2, 1),
            "moe.up_proj.weight": up.transpose(0, 2, 1),
            "moe.down_proj.weight": down.transpose(0, 2, 1),
        }
    gate_up = join_gate_up("standard", gate, up, -1).transpose(0, 2, 1)  # [E, 2I, H]
    return {"experts.gate_up_proj": gate_up, "experts.down_proj": down.transpose(0, 2, 1)}


def _per_expert_to_hf(flat: dict[str, np.ndarray], block_keys: BlockKeys, cfg: MoEConfig) -> dict[str, np.ndarray]:
    hf = {}
    for e in range(cfg.num_experts):
        for name, hf_name in zip(("gate", "up", "down"), block_keys.expert_names, strict=True):
            hf[f"experts.{e}.{hf_name}.weight"] = flat[f"experts.{name}"][e].T
            if cfg.expert_bias:
                hf[f"experts.{e}.{hf_name}.bias"] = flat[f"experts.{name}_bias"][e]
    return hf


def quantized_experts_to_hf(experts: Any, block_keys: BlockKeys, quant: HfQuant | None) -> dict[str, np.ndarray]:
    """Quantized routed experts -> `quant`'s on-disk keys under the layout's expert names (`quant` may be None for
    MXFP4 experts in the gpt-oss layout)."""
    fmt = type(as_stacked(experts))
    if quant is None:
        if block_keys.experts != "gpt_oss" or fmt.scheme.kind != "mxfp4":
            raise ValueError(f"experts are quantized ({fmt.__name__}): pass quant= (the checkpoint's on-disk layout)")
        quant = HfQuant(fmt, "gpt-oss")
    if (quant.source == "gpt-oss") != (block_keys.experts == "gpt_oss"):
        raise ValueError(f"the {block_keys.name} layout cannot hold quantized experts in the {quant.source} layout")
    if block_keys.experts == "stacked_moe":
        raise NotImplementedError(
            f"quantized experts in the {block_keys.name} layout (stacked moe.*) are not supported"
        )
    tensors = format_to_hf_tensors(experts, quant)
    if quant.source == "gpt-oss" or block_keys.expert_names == GATE_UP_DOWN:
        return tensors
    rename = dict(zip(GATE_UP_DOWN, block_keys.expert_names, strict=True))
    renamed = {}
    for key, value in tensors.items():
        _, e, name, suffix = key.split(".", 3)
        renamed[f"experts.{e}.{rename[name]}.{suffix}"] = value
    return renamed
