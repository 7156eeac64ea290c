"""qwix interop (optional: qwix is not a dependency): quantized routed experts <-> `qwix.QArray`s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moejax.quantized.formats import FP8_BLOCK, PROJECTIONS, QuantizedExperts
from moejax.weights import Experts, as_stacked
from pallas_kernels.codecs import e8m0_to_f32, pack_nibbles, unpack_nibbles


def to_qwix(experts: Experts) -> dict[str, Any]:
    """Routed experts -> `{"gate" | "up" | "down": qwix.QArray}`, each `[E, in, out]` (stacked).

    qwix 0.1.8 holds one unpacked code per element (`int8`, `int4`, `float8_e4m3fn`, `float4_e2m1fn` qvalues), a
    float scale tiled evenly over the array and a zero point of the qvalue's dtype: `w = (q - zp) · scale`.
    int8/int4 (symmetric or not) and MXFP4 convert exactly. NVFP4's two scales are multiplied into one float32 scale
    (rounded to float32). FP8 blocks convert when 128 divides both dims (qwix tiles evenly; partial edge blocks raise
    `NotImplementedError`). Biases are not part of a QArray.
    """
    from qwix._src.core.qarray import QArray  # qwix 0.1.8 exports QArray from here

    stacked = as_stacked(experts)
    s = getattr(stacked, "scheme", None)
    if s is None:
        raise TypeError(f"to_qwix takes quantized experts, got {type(stacked).__name__}")
    out = {}
    for p in PROJECTIONS:
        q = getattr(stacked, f"{p}_q")
        scale = getattr(stacked, f"{p}_scale")
        zero = getattr(stacked, f"{p}_zero")
        if s.kind == "fp8_block":
            if any(d % FP8_BLOCK for d in q.shape[1:]):
                raise NotImplementedError(f"{p}: qwix tiles evenly; FP8 {q.shape[1:]} has partial 128-blocks")
            out[p] = QArray(q, scale, None, jnp.float8_e4m3fn)
            continue
        codes = unpack_nibbles(q, axis=1) if s.packed else q  # [E, in, out]
        if s.kind == "int":
            signed = (codes.astype(jnp.int16) - (1 << (s.bits - 1))).astype(jnp.int8)
            qvalue = signed.astype(jnp.int4) if s.packed else signed
            zp = None if zero is None else zero.astype(qvalue.dtype)
            out[p] = QArray(qvalue, scale, zp, qvalue.dtype)
            continue
        qvalue = jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
        if s.kind == "mxfp4":
            sf = e8m0_to_f32(scale)
        else:
            sf = scale.astype(jnp.float32) * getattr(stacked, f"{p}_scale2")[:, None, None]
        out[p] = QArray(qvalue, sf, None, jnp.float4_e2m1fn)
    return out


def from_qwix(qarrays: Mapping[str, Any], fmt: type[QuantizedExperts]) -> QuantizedExperts:
    """The inverse of `to_qwix` for int8/int4 (symmetric or not), FP8 block and MXFP4 formats.

    Raises:
      ValueError: a QArray's qvalue dtype, scale tiling or zero point does not fit `fmt` (naming the projection).
    """
    s = fmt.scheme
    if s.kind == "nvfp4":
        raise NotImplementedError("NVFP4 keeps two scales; a qwix QArray has one (to_qwix multiplies them)")
    fields = {}
    for p in PROJECTIONS:
        qa = qarrays[p]
        qvalue, scale, zp = qa.qvalue, qa.scale, qa.zero_point
        E, n_in, n_out = qvalue.shape
        want = {"int": jnp.int8 if s.bits == 8 else jnp.int4, "fp8_block": jnp.float8_e4m3fn}.get(
            s.kind, jnp.float4_e2m1fn
        )
        if qvalue.dtype != want:
            raise ValueError(f"{p}: qvalue dtype {qvalue.dtype}, {fmt.__name__} needs {jnp.dtype(want)}")
        grid = (E, -(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK)) if s.kind == "fp8_block" else None
        grid = grid or (E, n_in // s.group(n_in), n_out)
        if tuple(scale.shape) != grid:
            raise ValueError(f"{p}: scale shape {tuple(scale.shape)}, {fmt.__name__} needs {grid}")
        if (zp is not None) != (s.kind == "int" and not s.symmetric):
            raise ValueError(f"{p}: zero point {'given' if zp is not None else 'missing'} for {fmt.__name__}")
        if s.kind == "fp8_block":
            fields |= {f"{p}_q": qvalue, f"{p}_scale": scale.astype(jnp.float32)}
            continue
        if s.kind == "int":
            codes = (qvalue.astype(jnp.int16) + (1 << (s.bits - 1))).astype(jnp.uint8)
            fields[f"{p}_scale"] = scale.astype(jnp.float32)
            if zp is not None:
                fields[f"{p}_zero"] = zp.astype(jnp.int8)
        else:  # mxfp4: the float32 scale must be a power of two
            exp = jnp.frexp(scale.astype(jnp.float32))[1] - 1
            fields[f"{p}_scale"] = jnp.clip(exp + 127, 0, 254).astype(jnp.uint8)
            codes = jax.lax.bitcast_convert_type(qvalue, jnp.uint4).astype(jnp.uint8)
        fields[f"{p}_q"] = pack_nibbles(codes, axis=1) if s.packed else codes
    return fmt(**fields)
