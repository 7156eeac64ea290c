"""Quantized expert weights as the tile kernels read them: packed codes + scales, dequantized in registers.

`QuantizedWeight` carries one stacked projection `[E, in, out]` exactly as `moejax.quantized` stores it (this
package never imports moejax; moejax's `backends.pallas` wraps its arrays, no copy):

    kind        codes                          scale                                  extra
    int8        uint8 [E, in, out] (q + 128)   f32 [E, in/g, out]                     zero int8 [E, in/g, out]?
    int4        uint8 [E, in/2, out] (q + 8)   f32 [E, in/g, out]                     zero int8 [E, in/g, out]?
    fp8_block   float8_e4m3fn [E, in, out]     f32 [E, ceil(in/128), ceil(out/128)]
    mxfp4       uint8 [E, in/2, out] e2m1      uint8 e8m0 [E, in/32, out]
    nvfp4       uint8 [E, in/2, out] e2m1      float8_e4m3fn [E, in/16, out]          scale2 f32 [E]

A 4-bit byte holds two consecutive `in` elements (low nibble = even element). Dequantized value:
int `(u - 2^(b-1) - zero) · scale`, FP8 `q · scale[i/128, o/128]`, MXFP4 `e2m1 · 2^(s-127)`, NVFP4
`e2m1 · scale · scale2`, all in float32.

Inside a kernel (`dequantize_tile`) one pipeline step holds a `[rows, block_n]` tile of codes in shared memory
(TMA-loaded, a quarter or half of the bytes of bf16) and the scale rows of its groups; the codes are loaded into
registers, decoded with integer/float32 arithmetic (Hopper has no FP4 tensor cores and no e8m0 conversion; e4m3
converts through f16, exactly), multiplied by their float32 scales, rounded to bf16 and stored to a shared-memory
tile that the bf16 wgmma reads. 4-bit tiles give two halves: the even `in` elements (low nibbles) and the odd ones
(high nibbles), each multiplied with the matching half of the activation columns (the callers reorder the
activation columns of each contraction block into [even | odd] once per call: `split_even_odd`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.codecs import e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, split_nibbles

Array = jax.Array

KINDS = ("int8", "int4", "fp8_block", "mxfp4", "nvfp4")
FP8_BLOCK = 128
COMPUTE_DTYPE = jnp.dtype(jnp.bfloat16)  # what the wgmma multiplies: dequantized weights and activations


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One stacked quantized projection `[E, in, out]` (the table of the module docstring)."""

    codes: Array
    scale: Array
    zero: Array | None = None
    scale2: Array | None = None
    kind: str = dataclasses.field(default="int8", metadata={"static": True})

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QuantizedWeight.kind={self.kind!r} is not one of {KINDS}")

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte along `in`."""
        return self.kind in ("int4", "mxfp4", "nvfp4")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical `(E, in, out)`."""
        E, rows, out = self.codes.shape
        return E, rows * (2 if self.packed else 1), out

    @property
    def group(self) -> int:
        """Elements of `in` per scale row."""
        if self.kind == "fp8_block":
            return FP8_BLOCK
        return self.shape[1] // self.scale.shape[1]

    @property
    def dtype(self):
        return self.codes.dtype

    @property
    def ndim(self) -> int:
        return 3


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["codes", "scale", "zero", "scale2"], meta_fields=["kind"]
)


def check_quantized(name: str, w: QuantizedWeight) -> None:
    """`ValueError` naming `name` when the arrays of `w` do not fit its kind (shapes, dtypes, extras)."""
    E, n_in, n_out = w.shape
    code_dtype = jnp.float8_e4m3fn if w.kind == "fp8_block" else jnp.uint8
    if w.codes.ndim != 3 or w.codes.dtype != code_dtype:
        raise ValueError(f"{name}: {w.kind} codes must be {jnp.dtype(code_dtype)} [E, in, out], got {w.codes.shape=}")
    if w.kind == "fp8_block":
        want = (E, -(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK))
    else:
        if w.scale.ndim != 3 or w.scale.shape[1] == 0 or n_in % w.scale.shape[1]:
            raise ValueError(f"{name}: scale must be [E, in/group, out] for in={n_in}, got {w.scale.shape=}")
        want = (E, n_in // w.group, n_out)
    scale_dtype = {"mxfp4": jnp.uint8, "nvfp4": jnp.float8_e4m3fn}.get(w.kind, jnp.float32)
    if tuple(w.scale.shape) != want or w.scale.dtype != scale_dtype:
        raise ValueError(f"{name}: {w.kind} scale must be {jnp.dtype(scale_dtype)} {want}, got {w.scale.shape=}")
    if w.zero is not None and (w.kind not in ("int8", "int4") or w.zero.shape != w.scale.shape):
        raise ValueError(f"{name}: a zero point is int8 like the scale {w.scale.shape} (int kinds), got {w.zero.shape}")
    if (w.scale2 is not None) != (w.kind == "nvfp4") or (w.scale2 is not None and w.scale2.shape != (E,)):
        raise ValueError(f"{name}: scale2 [E={E}] goes with nvfp4 only, got {getattr(w.scale2, 'shape', None)}")


# -- decoding (plain jnp: used both inside the kernels and by the references; the codes in `codecs`) -----------


def scale_to_f32(kind: str, scale: Array) -> Array:
    """A scale array of `kind` -> float32 (without NVFP4's scale2)."""
    if kind == "mxfp4":
        return e8m0_to_f32(scale)
    if kind == "nvfp4":
        return e4m3_to_f32(scale)
    return scale.astype(jnp.float32)


def decode_codes(kind: str, codes: Array, zero: Array | None) -> list[Array]:
    """Codes -> float32 values before scaling; 4-bit kinds give `[even elements, odd elements]`.

    `zero` (int kinds, broadcastable to codes, or None) is subtracted with the `2^(b-1)` offset of the codes.
    """
    if kind == "fp8_block":
        return [e4m3_to_f32(codes)]
    # Mosaic GPU shifts no 8-bit vectors: 4-bit kinds unpack the nibbles in int32
    parts = [codes] if kind == "int8" else list(split_nibbles(codes.astype(jnp.int32)))
    if kind in ("mxfp4", "nvfp4"):
        return [e2m1_to_f32(p) for p in parts]
    offset = 128.0 if kind == "int8" else 8.0
    sub = offset if zero is None else zero.astype(jnp.float32) + offset
    return [p.astype(jnp.float32) - sub for p in parts]


def dequantize_weight(w: QuantizedWeight) -> Array:
    """The whole projection as float32 `[E, in, out]` (plain jnp: the references' oracle, not a kernel path)."""
    E, n_in, n_out = w.shape
    scale = scale_to_f32(w.kind, w.scale)
    if w.kind == "nvfp4":
        scale = scale * w.scale2[:, None, None]
    if w.kind == "fp8_block":
        full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=1)[:, :n_in], FP8_BLOCK, axis=2)[:, :, :n_out]
        return decode_codes(w.kind, w.codes, None)[0] * full
    rows_per_group = w.group // (2 if w.packed else 1)
    rep = lambda a: jnp.repeat(a, rows_per_group, axis=1)  # [E, in/g, out] -> [E, code rows, out]
    zero = None if w.zero is None else rep(w.zero)
    parts = [p * rep(scale) for p in decode_codes(w.kind, w.codes, zero)]
    if len(parts) == 1:
        return parts[0]
    return jnp.stack(parts, axis=2).reshape(E, n_in, n_out)  # byte j holds elements 2j, 2j + 1


def split_even_odd(x: Array, block: int) -> Array:
    """Reorder the columns of `x [R, N]` within each `block` into [even columns | odd columns] (N % block == 0):
    the activation order that 4-bit tiles of `block` contraction elements multiply against."""
    R, N = x.shape
    return x.reshape(R, N // block, block // 2, 2).swapaxes(2, 3).reshape(R, N)


def pad_quantized(w: QuantizedWeight, n_in: int, n_out: int) -> QuantizedWeight:
    """Zero-pad the logical `[E, in, out]` to `[E, n_in, n_out]`: padded codes and scales are 0, so every padded
    weight dequantizes to exactly 0 (int: scale 0; FP8/FP4: code 0). A no-op when already there."""
    _, i, o = w.shape
    if (i, o) == (n_in, n_out):
        return w
    div = 2 if w.packed else 1
    codes = jnp.pad(w.codes, ((0, 0), (0, (n_in - i) // div), (0, n_out - o)))
    if w.kind == "fp8_block":
        grid = (-(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK))
        pads = ((0, 0), (0, grid[0] - w.scale.shape[1]), (0, grid[1] - w.scale.shape[2]))
        return dataclasses.replace(w, codes=codes, scale=jnp.pad(w.scale, pads))
    g = w.group
    if n_in % g:
        raise NotImplementedError(f"padding in={i} to {n_in} is not a whole number of groups of {g}")
    pads = ((0, 0), (0, n_in // g - w.scale.shape[1]), (0, n_out - o))
    zero = None if w.zero is None else jnp.pad(w.zero, pads)
    return dataclasses.replace(w, codes=codes, scale=jnp.pad(w.scale, pads), zero=zero)


def tile_plan(w: QuantizedWeight, block_k: int, block_n: int) -> tuple[int, int]:
    """`(code rows per step, scale rows per step)` for contraction blocks of `block_k` elements of `in`.

    `NotImplementedError` (the caller's fallback) unless a step's scales are whole rows: the group divides
    `block_k` or `block_k` divides the group (FP8: `block_k` and `block_n` divide 128).
    """
    rows = block_k // 2 if w.packed else block_k
    if w.kind == "fp8_block":
        if FP8_BLOCK % block_k or FP8_BLOCK % block_n:
            raise NotImplementedError(f"fp8_block: block_k={block_k} and block_n={block_n} must divide 128")
        return rows, 1
    g = w.group
    if g % block_k and block_k % g:
        raise NotImplementedError(f"{w.kind}: group {g} and contraction block {block_k} must divide one another")
    if w.packed and g < block_k and g % 2:
        raise NotImplementedError(f"{w.kind}: odd group {g}")
    return rows, max(1, block_k // g)


def dequantize_tile(
    kind: str,
    codes: Array,
    scale_rows: list[Array] | Array,
    zero_rows: list[Array] | None,
    scale2: Array | None,
    rows_per_group: int,
) -> list[Array]:
    """One step's tile in registers: codes `[rows, n]` -> float32 `[rows, n]` (4-bit: [even, odd] halves).

    `scale_rows`: the step's scale rows `[n]` each, in their stored dtype (fp8_block: one float32 scalar);
    `zero_rows` likewise (int asymmetric) or None; `scale2` a float32 scalar (NVFP4) or None. Code row r of the
    tile uses scale row `r // rows_per_group`: with several rows, each is broadcast and picked per row by a select
    on the row index (register arrays cannot be sliced by row in Mosaic GPU's warpgroup lowering).
    """
    rows, n = codes.shape
    if kind == "fp8_block":
        return [v * scale_rows for v in decode_codes(kind, codes, None)]

    def per_row(parts: list[Array]) -> Array:  # G rows [n] -> [rows, n]: row r takes parts[r // rows_per_group]
        out = jax.lax.broadcast_in_dim(parts[0], (rows, n), (1,))
        if len(parts) == 1:
            return out
        group_of_row = jax.lax.broadcasted_iota(jnp.int32, (rows, n), 0) // rows_per_group
        for j in range(1, len(parts)):
            out = jnp.where(group_of_row == j, jax.lax.broadcast_in_dim(parts[j], (rows, n), (1,)), out)
        return out

    scales = [scale_to_f32(kind, r) for r in scale_rows]
    if scale2 is not None:
        scales = [r * scale2 for r in scales]
    zero = None if zero_rows is None else per_row([z.astype(jnp.float32) for z in zero_rows])
    s = per_row(scales)
    return [v * s for v in decode_codes(kind, codes, zero)]


__all__ = [
    "COMPUTE_DTYPE",
    "KINDS",
    "QuantizedWeight",
    "check_quantized",
    "dequantize_tile",
    "dequantize_weight",
    "pad_quantized",
    "split_even_odd",
    "tile_plan",
]
