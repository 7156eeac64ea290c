"""Quantized expert weights in the Mosaic TPU tile kernels (tpu_tiles.py): what one grid step copies from HBM to
VMEM, and how the kernel body dequantizes it for the MXU.

One step holds a `[block_k, block_n]` tile of one expert's projection as stored (`QuantizedWeight`: codes, scale
rows, zero points, NVFP4's per-expert scale2), never dequantized in HBM. In the body (`quantized_dot`) the tile is
decoded a chunk of about 256 code rows at a time: codes and the chunk's scale rows loaded from VMEM, decoded with the
one decoder per code (`quantized_weights.decode_codes` / `scale_to_f32`, codecs.py), multiplied in float32, rounded
to bf16 (what the references multiply), and fed to the MXU with the activation columns of the chunk, accumulating in
float32. 4-bit codes give two halves per chunk (even and odd contraction elements); the callers reorder each
contraction block of the activations into [even | odd] once per call (`split_even_odd`).

FP8 blocks (one scale per 128x128 block) are read as 128-row groups with one scale per column: the callers expand
the scale grid of the experts a call reads (`expand_fp8_scale`: 1/32 of the codes' bytes as float32) so that every
kind has the same `[in / group, out]` scale rows. Scales in one 8-bit dtype (MXFP4's e8m0, NVFP4's e4m3) are tiled
32 rows to a VMEM tile, float32 ones 8 (`TpuQuant.step`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.codecs import e4m3_to_f32
from pallas_kernels.quantized_weights import (
    COMPUTE_DTYPE,
    FP8_BLOCK,
    QuantizedWeight,
    decode_codes,
    scale_to_f32,
    split_even_odd,
)

Array = jax.Array

_CHUNK_ROWS = 256  # code rows decoded at once: bounds the float32 temporaries of the body


@dataclasses.dataclass(frozen=True)
class TpuQuant:
    """Static description of one quantized projection as a tile kernel reads it.

    kind: a `QuantizedWeight.kind`; group: elements of `in` per scale row; has_zero / has_scale2: the optional
    arrays; scale_itemsize: bytes of one scale (1 for MXFP4 / NVFP4, 4 otherwise: FP8's expanded scale is float32).
    """

    kind: str
    group: int
    has_zero: bool
    has_scale2: bool
    scale_itemsize: int

    @classmethod
    def of(cls, w: QuantizedWeight) -> TpuQuant:
        itemsize = 4 if w.kind == "fp8_block" else jnp.dtype(w.scale.dtype).itemsize
        return cls(w.kind, w.group, w.zero is not None, w.scale2 is not None, itemsize)

    @property
    def packed(self) -> bool:
        return self.kind in ("int4", "mxfp4", "nvfp4")

    @property
    def code_bytes(self) -> float:
        """Bytes of codes per weight element."""
        return 0.5 if self.packed else 1.0

    @property
    def rows_per_group(self) -> int:
        """Code rows per scale row."""
        return self.group // 2 if self.packed else self.group

    @property
    def step(self) -> int:
        """What a contraction tile must be a multiple of (unless it is the whole dimension): whole groups, as many
        as fill the scale's VMEM tile (8 float32 rows, 32 8-bit ones), and 128 lanes of activations."""
        return math.lcm(128, (32 // self.scale_itemsize) * self.group)

    def check(self, name: str, dim: int, block: int) -> None:
        """`NotImplementedError` unless `block` (a contraction tile over `dim`) holds whole groups and divides
        `dim`, as a multiple of `step` or `dim` itself (quantized tiles have no masked partial blocks)."""
        if block != dim and (block % self.step or dim % block):
            raise NotImplementedError(
                f"{name}: a {self.kind} contraction tile of {block} over {dim} must be {dim} or a multiple of "
                f"{self.step} dividing it"
            )


def expand_fp8_scale(scale: Array, n_in: int, n_out: int) -> Array:
    """FP8 block scales `[X, ceil(in/128), ceil(out/128)]` -> float32 `[X, ceil(in/128), out]` (one per column)."""
    return jnp.repeat(scale.astype(jnp.float32), FP8_BLOCK, axis=2)[:, :, :n_out]


def tile_arrays(w: QuantizedWeight, slot_experts: Array | None = None) -> tuple[tuple[Array, ...], tuple[bool, ...]]:
    """The arrays a tile kernel reads for `w`, in ref order (codes, scale, [zero], [scale2 as `[E, 1, 1]`]), and
    for each whether it is indexed by the call's slot (FP8's expanded scale gathered for `slot_experts`, the
    experts of the slots: decode reads a few experts, so only theirs are expanded) rather than by expert."""
    E, n_in, n_out = w.shape
    scale, by_slot = w.scale, False
    if w.kind == "fp8_block":
        by_slot = slot_experts is not None
        scale = expand_fp8_scale(scale if slot_experts is None else scale[slot_experts], n_in, n_out)
    arrays = [w.codes, scale] + ([] if w.zero is None else [w.zero])
    arrays += [] if w.scale2 is None else [w.scale2.astype(jnp.float32).reshape(E, 1, 1)]
    slots = [False, by_slot] + [False] * (len(arrays) - 2)
    return tuple(arrays), tuple(slots)


def block_shapes(q: TpuQuant, block_k: int, block_n: int) -> tuple[tuple[int, int], ...]:
    """The VMEM block of each of `tile_arrays` for a `[block_k, block_n]` tile (block index (k, j) for all but
    scale2, whose `[1, 1]` block is the expert's)."""
    codes = (block_k // (2 if q.packed else 1), block_n)
    scale = (-(-block_k // q.group), block_n)
    return (codes, scale) + ((scale,) if q.has_zero else ()) + (((1, 1),) if q.has_scale2 else ())


def reorder_for(q: TpuQuant | None, rows: Array, block_k: int) -> Array:
    """Activations `[..., in]` in the column order the tile kernel multiplies: for 4-bit codes each contraction
    block as [even | odd] elements (the two halves of a code row), else unchanged."""
    if q is None or not q.packed:
        return rows
    shape = rows.shape
    return split_even_odd(rows.reshape(-1, shape[-1]), block_k).reshape(shape)


def _per_code_row(s: Array, rows_per_group: int, rows: int) -> Array:
    """Scale rows `[G, n]` -> one per code row `[rows, n]` (group j covers code rows j·rows_per_group ...)."""
    G, n = s.shape
    if G == 1:
        return s
    return jnp.broadcast_to(s[:, None, :], (G, rows_per_group, n)).reshape(G * rows_per_group, n)[:rows]


def _chunk_rows(q: TpuQuant) -> int:
    """Code rows decoded at once: whole groups (`_CHUNK_ROWS` of them at most) or a part of one large group."""
    rpg = q.rows_per_group
    if rpg >= _CHUNK_ROWS:
        return _CHUNK_ROWS if rpg % _CHUNK_ROWS == 0 else rpg
    return rpg * (_CHUNK_ROWS // rpg)


def quantized_dot(rows: Array, q: TpuQuant, refs: tuple) -> Array:
    """`rows @ W` float32 for one quantized tile in VMEM (module docstring).

    rows: `[R, block_k]` bf16 activations (4-bit: each block as [even | odd]); refs: the tile's refs in
    `tile_arrays` order.
    """
    codes_ref, scale_ref, *rest = refs
    zero_ref = rest.pop(0) if q.has_zero else None
    scale2 = rest.pop(0)[...] if q.has_scale2 else None  # [1, 1] float32
    n_codes, rpg = codes_ref.shape[0], q.rows_per_group
    chunk = _chunk_rows(q)
    acc = None
    for c0 in range(0, n_codes, chunk):
        c1 = min(c0 + chunk, n_codes)
        g0, g1 = c0 // rpg, -(-c1 // rpg)  # the chunk's scale rows
        s = scale_ref[g0:g1, :]
        # Mosaic TPU has no float16 vectors: e4m3 (FP8 codes, NVFP4 scales) straight to float32 (exact)
        s = e4m3_to_f32(s, direct=True) if q.kind == "nvfp4" else scale_to_f32(q.kind, s)
        if scale2 is not None:
            s = s * scale2
        s = _per_code_row(s, rpg, c1 - c0)
        codes = codes_ref[c0:c1, :]
        if q.kind == "fp8_block":
            values = [e4m3_to_f32(codes, direct=True)]
        else:
            zero = None if zero_ref is None else _per_code_row(zero_ref[g0:g1, :].astype(jnp.float32), rpg, c1 - c0)
            values = decode_codes(q.kind, codes, zero)
        for half, v in enumerate(values):  # 4-bit: the even elements' columns, then the odd ones'
            lhs = rows[:, half * n_codes + c0 : half * n_codes + c1]
            part = jnp.dot(lhs, (v * s).astype(COMPUTE_DTYPE), preferred_element_type=jnp.float32)
            acc = part if acc is None else acc + part
    return acc
