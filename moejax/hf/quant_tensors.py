"""The on-disk codecs of quantized projections: compressed-tensors (pack-quantized int, FP8_BLOCK, NVFP4A16,
MXFP4A16), DeepSeek-V3's FP8 and ModelOpt's NVFP4, one Linear `[out, in]` at a time <-> a format's fields `[in, out]`.

The stored dtype decides how bytes decode: a tensor of another dtype is refused, never cast. docs/FORMATS.md has the
layouts and the sources they were checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.hf.keys import GATE_UP_DOWN, linear_names
from moejax.hf.quant_config import HfQuant, Source
from moejax.quantized.formats import FP8_BLOCK, PROJECTIONS, Scheme, quantized_format
from pallas_kernels.codecs import pack_nibbles, unpack_nibbles

# The dtypes each on-disk tensor may have. The stored dtype decides how the bytes are decoded: a tensor of another
# dtype is refused, never cast or reinterpreted (an FP8 e5m2 weight read as e4m3 gives other values, a float32
# weight_packed cast to int32 loses its bit pattern).
FLOATS = tuple(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16))  # exact in float32
E4M3 = (np.dtype(ml_dtypes.float8_e4m3fn),)
BYTES = (np.dtype(np.uint8),)  # packed e2m1 nibble pairs
E8M0 = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu))  # the same encoding either way
INT32 = (np.dtype(np.int32), np.dtype(np.uint32))  # compressed-tensors' packed int32 words
INTS = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def take(
    tensors: Mapping[str, Any],
    key: str,
    shape: tuple[int, ...] | None,
    what: str = "",
    dtypes: tuple[np.dtype, ...] | None = None,
) -> np.ndarray:
    """`tensors[key]` as numpy, checked to have `shape` (None: any) and one of `dtypes` (None: any); the
    ValueError names the key (`what` is added to the missing-key message)."""
    if key not in tensors:
        raise ValueError(f"missing tensor {key!r}{what}")
    value = np.asarray(tensors[key])
    if dtypes is not None and value.dtype not in dtypes:
        expected = " or ".join(d.name for d in dtypes)
        raise ValueError(f"{key}: dtype {value.dtype.name}, expected {expected} (the stored dtype decides decoding)")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{key}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def _bytes_of_int32_rows(packed: np.ndarray) -> np.ndarray:
    """int32 `[rows, n]` -> uint8 `[rows, 4n]`, each row's little-endian bit stream as bytes."""
    return np.ascontiguousarray(packed.astype("<i4")).view(np.uint8)


def _int32_rows_of_bytes(b: np.ndarray) -> np.ndarray:
    """uint8 `[rows, m]` -> int32 `[rows, ceil(m/4)]` (zero padded), the inverse of `_bytes_of_int32_rows`."""
    rows, m = b.shape
    padded = np.zeros((rows, -(-m // 4) * 4), np.uint8)
    padded[:, :m] = b
    return padded.view("<i4").astype(np.int32)


def _codes_of_stream(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Bytes `[rows, m]` (a bit stream per row) -> unsigned codes `[rows, n]` of `bits` bits."""
    return (b if bits == 8 else unpack_nibbles(b, axis=1))[:, :n]


def _stream_of_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `_codes_of_stream` (an odd count of 4-bit codes padded with a zero)."""
    if bits == 8:
        return codes.astype(np.uint8)
    return pack_nibbles(np.pad(codes, ((0, 0), (0, codes.shape[1] % 2))), axis=1)


def projection_from_hf(
    tensors: Mapping[str, Any], prefix: str, scheme: Scheme, source: Source, n_out: int, n_in: int
) -> dict[str, np.ndarray]:
    """One projection's on-disk tensors (`{prefix}weight_packed`, ...; weight `[out, in]`) -> in-memory fields
    `{q, scale, zero?, scale2?}` (`[in, out]` orientation). Raises `ValueError` naming the key on a mismatch."""
    scheme.check_dims(n_in, f"{prefix}weight (in={n_in})")
    zp_key = f"{prefix}weight_zero_point"
    if (scheme.kind != "int" or scheme.symmetric) and zp_key in tensors:
        raise ValueError(
            f"{zp_key}: the checkpoint holds a zero point but the {scheme.name} scheme is symmetric (the config's "
            "`symmetric` contradicts the tensors)"
        )
    if scheme.kind == "fp8_block":
        grid = (-(-n_out // FP8_BLOCK), -(-n_in // FP8_BLOCK))
        q = take(tensors, f"{prefix}weight", (n_out, n_in), dtypes=E4M3)
        scale_key = f"{prefix}weight_scale_inv" if source == "deepseek" else f"{prefix}weight_scale"
        scale = take(tensors, scale_key, None, dtypes=FLOATS)
        if tuple(scale.shape) != grid:
            raise ValueError(
                f"{scale_key}: scale grid {tuple(scale.shape)} does not match weight [{n_out}, {n_in}] in 128x128 "
                f"blocks, expected {grid}"
            )
        return {"q": q.T, "scale": scale.astype(np.float32).T}
    G = n_in // scheme.group(n_in)
    scale_key = f"{prefix}weight_scale"
    if scheme.kind == "int":
        bits = scheme.bits
        packed = take(tensors, f"{prefix}weight_packed", (n_out, -(-n_in * bits // 32)), dtypes=INT32)
        if f"{prefix}weight_shape" in tensors:
            shape = tuple(int(v) for v in take(tensors, f"{prefix}weight_shape", None, dtypes=INTS).reshape(-1))
            if shape != (n_out, n_in):
                raise ValueError(f"{prefix}weight_shape: {shape}, expected {(n_out, n_in)}")
        g_idx_key = f"{prefix}weight_g_idx"
        if g_idx_key in tensors:
            g_idx = take(tensors, g_idx_key, None, dtypes=INTS).reshape(-1)
            if not np.array_equal(g_idx, np.arange(n_in) // scheme.group(n_in)):
                raise NotImplementedError(f"{g_idx_key}: act-order (a permuted group index) is not supported")
        codes = _codes_of_stream(_bytes_of_int32_rows(packed), bits, n_in)  # [out, in] unsigned q + 2^(b-1)
        q = np.ascontiguousarray(codes.T) if bits == 8 else pack_nibbles(codes.T)
        scale = take(tensors, scale_key, None, dtypes=FLOATS)
        if tuple(scale.shape) != (n_out, G):
            raise ValueError(
                f"{scale_key}: scale grid {tuple(scale.shape)} does not match weight [{n_out}, {n_in}] in groups "
                f"of {scheme.group(n_in)}, expected {(n_out, G)}"
            )
        out = {"q": q, "scale": scale.astype(np.float32).T}
        if not scheme.symmetric:
            zp_shape = (-(-n_out * bits // 32), G)
            zp = take(tensors, zp_key, zp_shape, " (asymmetric scheme: a zero point is required)", INT32)
            zp_codes = _codes_of_stream(_bytes_of_int32_rows(zp.T), bits, n_out)  # [G, out]
            out["zero"] = (zp_codes.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
        return out
    weight_key = f"{prefix}weight" if source == "modelopt" else f"{prefix}weight_packed"
    packed = take(tensors, weight_key, (n_out, n_in // 2), dtypes=BYTES)
    scale = take(tensors, scale_key, None, dtypes=E8M0 if scheme.kind == "mxfp4" else E4M3)
    if tuple(scale.shape) != (n_out, G):
        raise ValueError(
            f"{scale_key}: scale grid {tuple(scale.shape)} does not match weight [{n_out}, {n_in}] in groups of "
            f"{scheme.group(n_in)}, expected {(n_out, G)}"
        )
    out = {"q": np.ascontiguousarray(packed.T)}
    if scheme.kind == "mxfp4":
        out["scale"] = scale.view(np.uint8).T
        return out
    out["scale"] = scale.T
    if source == "modelopt":
        key = f"{prefix}weight_scale_2"
        s2 = take(tensors, key, None, " (NVFP4: the per-tensor scale is required)", FLOATS)
        s2 = s2.astype(np.float32).reshape(-1)
        if s2.size != 1:
            raise ValueError(f"{key}: expected one value, got shape {s2.shape}")
        out["scale2"] = np.asarray(s2[0], np.float32)
    else:
        key = f"{prefix}weight_global_scale"
        gs = take(tensors, key, None, " (NVFP4: the global scale is required)", FLOATS)
        gs = gs.astype(np.float32).reshape(-1)
        if gs.size != 1:
            raise ValueError(f"{key}: expected one value, got shape {gs.shape}")
        out["scale2"] = np.asarray(np.float32(1) / gs[0], np.float32)  # w = fp4·scale/global
    return out


def projection_to_hf(fields: Mapping[str, np.ndarray], prefix: str, scheme: Scheme, source: Source):
    """The inverse of `projection_from_hf` for one projection of one expert."""
    q = np.asarray(fields["q"])
    scale = np.asarray(fields["scale"])
    if scheme.kind == "fp8_block":
        key = f"{prefix}weight_scale_inv" if source == "deepseek" else f"{prefix}weight_scale"
        s = scale.T.astype(np.float32 if source == "deepseek" else ml_dtypes.bfloat16)
        return {f"{prefix}weight": np.ascontiguousarray(q.T), key: np.ascontiguousarray(s)}
    if scheme.kind == "int":
        bits = scheme.bits
        codes = q.T if bits == 8 else unpack_nibbles(q).T  # [out, in], q + 2^(b-1)
        n_out, n_in = codes.shape
        out = {
            f"{prefix}weight_packed": _int32_rows_of_bytes(_stream_of_codes(codes, bits)),
            f"{prefix}weight_scale": np.ascontiguousarray(scale.T.astype(ml_dtypes.bfloat16)),
            f"{prefix}weight_shape": np.array([n_out, n_in], np.int64),
        }
        if not scheme.symmetric:
            zp = (np.asarray(fields["zero"]).astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)  # [G, out]
            out[f"{prefix}weight_zero_point"] = np.ascontiguousarray(_int32_rows_of_bytes(_stream_of_codes(zp, bits)).T)
        return out
    weight_key = f"{prefix}weight" if source == "modelopt" else f"{prefix}weight_packed"
    out = {weight_key: np.ascontiguousarray(q.T)}
    out[f"{prefix}weight_scale"] = np.ascontiguousarray(scale.T)
    if scheme.kind == "nvfp4":
        s2 = np.float32(np.asarray(fields["scale2"]))
        if source == "modelopt":
            out[f"{prefix}weight_scale_2"] = np.asarray(s2, np.float32)
        else:
            out[f"{prefix}weight_global_scale"] = np.asarray([np.float32(1) / s2], np.float32)
    return out


def per_expert_fields(tensors: Mapping[str, Any], cfg, quant: HfQuant) -> dict[str, np.ndarray]:
    """The routed experts' per-expert keys `experts.{e}.{gate,up,down}_proj.<suffix>` (or `w1/w3/w2`) ->
    `{field: np.ndarray [E, ...]}` of `quant`'s format (biases `.bias` when `cfg.expert_bias`)."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    names = dict(zip(PROJECTIONS, linear_names(tensors, "experts.0."), strict=True))
    per: dict[str, list[np.ndarray]] = {}
    for p in PROJECTIONS:
        for e in range(E):
            prefix = f"experts.{e}.{names[p]}."
            for k, v in projection_from_hf(tensors, prefix, quant.fmt.scheme, quant.source, *dims[p]).items():
                per.setdefault(f"{p}_{k}", []).append(np.asarray(v))  # (ascontiguousarray makes 0-d 1-d)
    fields = {name: np.stack(vs) for name, vs in per.items()}
    if cfg.expert_bias:
        for p in PROJECTIONS:
            fields[f"{p}_bias"] = np.stack(
                [take(tensors, f"experts.{e}.{names[p]}.bias", (dims[p][0],)) for e in range(E)]
            )
    return fields


def per_expert_to_hf(fields: Mapping[str, np.ndarray], quant: HfQuant) -> dict[str, np.ndarray]:
    """The inverse of `per_expert_fields` (stacked host fields -> `experts.{e}.{gate,up,down}_proj.*`)."""
    out: dict[str, np.ndarray] = {}
    for p, name in zip(PROJECTIONS, GATE_UP_DOWN, strict=True):
        for e in range(fields[f"{p}_q"].shape[0]):
            one = {k.removeprefix(f"{p}_"): v[e] for k, v in fields.items() if k.startswith(f"{p}_")}
            bias = one.pop("bias", None)
            prefix = f"experts.{e}.{name}."
            out |= projection_to_hf(one, prefix, quant.fmt.scheme, quant.source)
            if bias is not None:
                out[f"{prefix}bias"] = bias
    return out


def dequantize_projection(fields: Mapping[str, np.ndarray], scheme: Scheme) -> np.ndarray:
    """One projection's in-memory fields (`projection_from_hf`: `q [in(/2), out]`, `scale`, `zero`, `scale2`) ->
    float32 `[in, out]`, by the format's own dequantization (`QuantizedExperts.weight`, the math the plans run),
    on the default device (a quantized shared expert: moejax holds it dense)."""
    fmt = quantized_format(scheme.kind, bits=scheme.bits, group_size=scheme.group_size, symmetric=scheme.symmetric)
    one = fmt(**{f"gate_{name}": jnp.asarray(value) for name, value in fields.items()})
    return np.asarray(one.weight("gate"))
