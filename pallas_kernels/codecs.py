"""The numeric codes of the quantized formats, decoded in one place: e2m1 (FP4 elements), e8m0 (MX scales), e4m3
(FP8 elements and NVFP4 scales), and the nibble packing of 4-bit codes.

A leaf module (numpy, jax and ml_dtypes only) imported by the formats (`moejax.quantized`: the in-memory formats,
the host quantizer, the Hugging Face codecs) and by the kernels (`quantized_weights`), so the two never disagree.

Every function works on numpy arrays (on the host) and on jax arrays (traced, also inside Pallas kernels): the
namespace follows the input, as in the array API's `array_namespace`, and the expression is the same for both.
The decoders use integer and float32 arithmetic only (Mosaic GPU has no FP4 types and no e8m0 conversion):

    code   bits                       value                                        special
    e2m1   s ee m (4 bits)            e > 0: ±2^(e-1)·(1 + m/2); e = 0: ±m/2      none (no inf, no NaN)
    e8m0   eeeeeeee (8 bits)          2^(e-127)                                    e = 0: 2^-127; e = 255: NaN
    e4m3   s eeee mmm (float8_e4m3fn) ±2^(e-7)·(1 + m/8); e = 0: ±2^-6·m/8         0x7F, 0xFF: NaN (no inf)

e8m0's byte 255 is NaN, as the OCP Microscaling Formats spec (v1.0) and `ml_dtypes.float8_e8m0fnu` define it.
A 4-bit byte holds two consecutive elements: the even one in the low nibble, the odd one in the high nibble (as on
disk in every 4-bit checkpoint format moejax reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

Array = jax.Array


def _namespace(a):
    """`(xp, a as an xp array)`: jax.numpy for jax arrays and tracers, numpy for anything else (host arrays,
    scalars, lists)."""
    if isinstance(a, jax.Array):
        return jnp, a  # as it is: no conversion traced inside a kernel
    return np, np.asarray(a)


def _as_float32(bits, xp):
    """int32 bit patterns -> the float32 values they encode."""
    if xp is np:
        return np.asarray(bits, np.int32).view(np.float32)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def e2m1_to_f32(codes):
    """4-bit e2m1 codes (any int dtype, values < 16) -> float32, exactly, from bits (no table gather).

    A normal code (exponent e > 0) becomes the float32 with exponent e + 126 and the mantissa bit on top,
    `2^(e-1)·(1 + m/2)`; a subnormal one is `m·0.5` (`m · 0x3F000000` is 0.0 or 0.5); then the sign bit 3 -> 31.
    """
    xp, codes = _namespace(codes)
    c = codes.astype(xp.int32)
    mag = c & 7
    bits = xp.where(mag < 2, mag * 0x3F000000, (mag << 22) + (126 << 23))
    return _as_float32(bits | ((c & 8) << 28), xp)


def e8m0_to_f32(scales):
    """e8m0 scale bytes (uint8) -> float32: `2^(s-127)` as the float32 exponent field, s = 0 the subnormal 2^-127
    (bits 0x00400000), s = 255 NaN (bits 0x7FC00000)."""
    xp, scales = _namespace(scales)
    s = scales.astype(xp.int32)
    bits = xp.where(s == 0, 0x00400000, xp.where(s == 255, 0x7FC00000, s << 23))
    return _as_float32(bits, xp)


def e4m3_to_f32(q, *, direct: bool = False):
    """float8_e4m3fn values (or their bytes as uint8) -> float32, exactly, through float16: every e4m3 value is a
    float16 (Mosaic GPU converts e4m3 to f16 with Hopper's `cvt.f16x2.e4m3x2`). `direct`: convert straight to
    float32, as exact (Mosaic TPU has no float16 vectors)."""
    xp, q = _namespace(q)
    if q.dtype == np.uint8:
        q = q.view(ml_dtypes.float8_e4m3fn) if xp is np else jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn)
    return q.astype(xp.float32) if direct else q.astype(xp.float16).astype(xp.float32)


def split_nibbles(packed):
    """Bytes -> `(low, high)` nibbles, each shaped like `packed` and of its dtype: the even and the odd elements."""
    return packed & 15, packed >> 4


def unpack_nibbles(packed, axis: int = 0):
    """Bytes `[..., n/2, ...]` -> 4-bit codes `[..., n, ...]` (uint8) along `axis`: byte j holds elements 2j (low
    nibble) and 2j + 1 (high nibble)."""
    xp, packed = _namespace(packed)
    axis = axis % packed.ndim
    low, high = split_nibbles(packed.astype(xp.uint8))
    shape = (*packed.shape[:axis], 2 * packed.shape[axis], *packed.shape[axis + 1 :])
    return xp.stack([low, high], axis=axis + 1).reshape(shape)


def pack_nibbles(codes, axis: int = 0):
    """4-bit codes `[..., n, ...]` (values < 16, n even) -> bytes `[..., n/2, ...]` (uint8) along `axis`, element 2j
    in the low nibble of byte j; the inverse of `unpack_nibbles`."""
    xp, codes = _namespace(codes)
    axis = axis % codes.ndim
    codes = codes.astype(xp.uint8)
    even = codes[(slice(None),) * axis + (slice(0, None, 2),)]
    odd = codes[(slice(None),) * axis + (slice(1, None, 2),)]
    return (even | (odd << 4)).astype(xp.uint8)


E2M1_VALUES = e2m1_to_f32(np.arange(16, dtype=np.uint8))  # [16] float32: the value of each code


__all__ = [
    "E2M1_VALUES",
    "e2m1_to_f32",
    "e4m3_to_f32",
    "e8m0_to_f32",
    "pack_nibbles",
    "split_nibbles",
    "unpack_nibbles",
]
