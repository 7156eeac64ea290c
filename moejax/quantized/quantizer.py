"""The host quantizer: dense routed experts -> a quantized format (min-max scales, round-to-nearest-even, numpy),
and back (`dequantize`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.quantized.formats import FP4_MAX, FP8_BLOCK, FP8_MAX, PROJECTIONS, QuantizedExperts, Scheme, format_by_name
from moejax.weights import Experts, ExpertWeights, PerExpert, as_stacked, to_layout
from pallas_kernels.codecs import pack_nibbles


def _round_bf16(v: np.ndarray) -> np.ndarray:
    return v.astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize_projection(
    w: np.ndarray, scheme: Scheme, *, tensor_amax: float | None = None, name: str = "the weight"
) -> dict[str, np.ndarray]:
    """One projection of one expert, float `[in, out]` -> the format's arrays `{q, scale, zero?, scale2?}`.

    Min-max scales, round-to-nearest-even.
      * int: symmetric `scale = max|w| / (2^(b-1) - 1)`; asymmetric `scale = (max(w, 0) - min(w, 0)) / (2^b - 1)`
        and `zp = round(-2^(b-1) - min/scale)`.
      * FP8: `scale = max|w| / 448` per 128x128 block, values clipped to ±448.
      * MXFP4: `scale = 2^(floor(log2 max|w|) - 2)` (OCP MX), values saturate at ±6.
      * NVFP4: per-tensor `scale2 = max|w| / (448·6)`, block `scale = e4m3(max|w_block| / (6·scale2))`.
    Int and FP8 scales are rounded to bfloat16 first (compressed-tensors stores them in bfloat16, DeepSeek in
    float32: a save is exact in both). `tensor_amax` overrides NVFP4's per-tensor max (gate and up share one, as
    ModelOpt and llm-compressor fuse them).

    Raises:
      ValueError: `w` holds NaN or inf (naming `name` and the first position): min-max scales would turn them into
        finite codes and zero the rest of their group, where the dense forward gives NaN.
    """
    w = np.asarray(w, np.float32)
    n_in, n_out = w.shape
    bad = ~np.isfinite(w)
    if bad.any():
        i, o = np.argwhere(bad)[0]
        raise ValueError(
            f"quantize: {name} [{n_in}, {n_out}] has {int(bad.sum())} non-finite values (first w[{i}, {o}] = "
            f"{w[i, o]}); quantized codes cannot represent them"
        )
    scheme.check_dims(n_in, name)
    if scheme.kind == "fp8_block":
        gi, go = -(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK)
        padded = np.zeros((gi * FP8_BLOCK, go * FP8_BLOCK), np.float32)
        padded[:n_in, :n_out] = w
        blocks = padded.reshape(gi, FP8_BLOCK, go, FP8_BLOCK)
        scale = _round_bf16(np.abs(blocks).max(axis=(1, 3)) / FP8_MAX)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(padded.shape)[:n_in, :n_out]
        return {"q": q.astype(ml_dtypes.float8_e4m3fn), "scale": scale}
    g = scheme.group(n_in)
    wg = w.reshape(n_in // g, g, n_out)
    out: dict[str, np.ndarray] = {}
    if scheme.kind == "int":
        lo, hi = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
        if scheme.symmetric:
            scale = _round_bf16(np.abs(wg).max(axis=1) / hi)
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
            q = np.clip(np.round(wg / scale[:, None]), lo, hi)
        else:
            mn, mx = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
            scale = _round_bf16((mx - mn) / (hi - lo))
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
            zero = np.clip(np.round(lo - mn / scale), lo, hi)
            q = np.clip(np.round(wg / scale[:, None]) + zero[:, None], lo, hi)
            out["zero"] = zero.astype(np.int8)
        q = q.reshape(n_in, n_out).astype(np.int8)
        codes = (q.astype(np.int16) + (1 << (scheme.bits - 1))).astype(np.uint8)
        out["q"] = pack_nibbles(codes) if scheme.packed else codes
        out["scale"] = scale
        return out
    amax = np.abs(wg).max(axis=1)  # [G, out]
    if scheme.kind == "mxfp4":
        exp = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
        exp = np.clip(np.where(amax > 0, exp, -127), -127, 127).astype(np.int32)
        scale_f = np.ldexp(np.float32(1), exp).astype(np.float32)
        out["scale"] = (exp + 127).astype(np.uint8)
    else:  # nvfp4
        tensor_amax = float(np.abs(w).max()) if tensor_amax is None else tensor_amax
        scale2 = np.float32(tensor_amax / (FP8_MAX * FP4_MAX)) if tensor_amax > 0 else np.float32(1.0)
        block = (amax / (FP4_MAX * scale2)).astype(ml_dtypes.float8_e4m3fn)
        scale_f = block.astype(np.float32) * scale2
        scale_f = np.where(scale_f > 0, scale_f, 1.0).astype(np.float32)
        out["scale"], out["scale2"] = block, np.asarray(scale2, np.float32)
    v = np.clip(wg / scale_f[:, None], -FP4_MAX, FP4_MAX).reshape(n_in, n_out)
    out["q"] = pack_nibbles(v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15)
    return out


def quantize_experts(experts: Experts, fmt: type[QuantizedExperts]) -> QuantizedExperts:
    """Dense routed experts (either layout) -> `fmt`, stacked, one expert and projection at a time on the host."""
    dense = as_stacked(experts)
    if not isinstance(dense, ExpertWeights):
        raise TypeError(f"quantize takes dense experts (ExpertWeights), got {type(dense).__name__}")
    fields: dict[str, list[np.ndarray]] = {}
    for e in range(dense.num_experts):
        ws = {p: np.asarray(getattr(dense, p)[e], np.float32) for p in PROJECTIONS}
        gate_up_amax = float(max(np.abs(ws["gate"]).max(), np.abs(ws["up"]).max()))
        for p, w in ws.items():
            amax = gate_up_amax if p != "down" and fmt.scheme.kind == "nvfp4" else None
            for k, v in quantize_projection(w, fmt.scheme, tensor_amax=amax, name=f"expert {e} {p}").items():
                fields.setdefault(f"{p}_{k}", []).append(v)
    stacked = {name: jnp.asarray(np.stack(vs)) for name, vs in fields.items()}
    biases = {k: getattr(dense, k) for k in ("gate_bias", "up_bias", "down_bias") if getattr(dense, k) is not None}
    return fmt(**stacked, **biases)


def quantize(params, cfg, format_name: str, **options: Any):
    """`MoEParams` with dense routed experts -> the same params with the routed experts in a quantized format.

    Args:
      params: `moejax.MoEParams` (routed experts dense, either layout); the router and shared expert are kept.
      cfg: the `MoEConfig` (shapes are checked against it).
      format_name: "int8", "int4" (options `group_size=128` (None: per channel), `symmetric=True`),
        "fp8_block", "mxfp4", "nvfp4". Min-max scales, round-to-nearest-even (`quantize_projection`). Every name
        takes `activations="float32"` (the default: weight-only) or, for the 4-bit formats, `activations="int8"`:
        each projection's input quantized to int8 per group (`moejax.quantized.activations`, the error stated there).

    Returns:
      `MoEParams` whose experts are in the quantized format, in the layout the input had.
    """
    from moejax.params import check_params  # params imports weights; this module stays below params

    fmt = format_by_name(format_name, **options)
    check_params(params, cfg)
    fmt.declare(cfg)  # raises for a group that does not divide in
    q = quantize_experts(params.experts, fmt)
    layout = "per_expert" if isinstance(params.experts, PerExpert) else "stacked"
    return dataclasses.replace(params, experts=to_layout(q, layout))


def dequantize(qparams):
    """`MoEParams` (or routed experts) in any format -> the same with float32 dense `ExpertWeights`, same layout."""
    experts = getattr(qparams, "experts", qparams)
    per_expert = isinstance(experts, PerExpert)
    dense = as_stacked(experts).dequantize()
    dense = to_layout(dense, "per_expert" if per_expert else "stacked")
    if experts is qparams:
        return dense
    return dataclasses.replace(qparams, experts=dense)
