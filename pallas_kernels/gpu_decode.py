"""Fused union-of-experts decode on Mosaic GPU: T <= 8 rows, T·K <= 64 slots, each selected expert read once.

Lowering: Mosaic GPU, through the two tile kernels of gpu_tiles.py (shared with the grouped op): this module
builds the decode tile table and the combine. Decode is bound by weight bytes: every union expert's gate/up/down
must cross HBM once, and nothing else of that size may. The steps, all on device:

1. Union of the T·K selected ids by pairwise comparison (no sort): `union_ids[:n_union]` in first-seen order
   and each slot's position in it. Ids outside [0, E) (zero-computation experts) are not in the union.
2. `gate_up_tiles` with one tile per union expert, the trip count `n_union · I/block` read on device: each work
   item streams one column block of that expert's gate and up for all T rows at once (the rows sit in one
   64-row wgmma tile, zero-padded: at T <= 8 the padding costs no bytes, only idle tensor-core lanes) and
   applies the activation to the float32 accumulators -> h `[n_union·64, I]`.
3. `down_tiles` over the same table -> `y [n_union, 8, H]` float32 (only the 8 row slots leave the SM).
4. Row t sums `w[t,k] · y[position of slot k, t]` over its own slots in slot order, so a row's output does not
   depend on its batch neighbours (batch invariance).

Quantized weights stream each union expert's codes and scales (a half or a quarter of the bf16 bytes). Input
scales (Llama-4, `in_scale`) give each union expert its own scaled copy of the rows (a tile per union expert).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gpu_tiles import (
    TILE_ROWS,
    TilePairBlockSizes,
    pad_problem,
    tiles_ffn,
)
from pallas_kernels.moe_op import MoEProblem, combine_slots, compute_dtype, moe_op, moe_reference
from pallas_kernels.platform import interpret_by_platform

Array = jax.Array

MAX_ROWS = 8
MAX_SLOTS = 64
_ROWS_OUT = 8  # rows of each union expert's output stored by the down kernel (>= MAX_ROWS)


class DecodeBlockSizes(TilePairBlockSizes):
    """Blocks of the two decode kernels (see `TileBlockSizes`). Default: 64 intermediate columns per gate/up item
    (at T=1 only 8 experts are live: narrow items keep more SMs streaming), 128 (or 64) hidden columns per down
    item."""

    GATE_UP_BLOCK_N = 64


def union_of_experts(indices: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """Dedupe the ids of `indices [T, K]` on device without sorting.

    Returns union_ids `[T·K] int32` (distinct ids in [0, num_experts) in first-seen order, then zeros),
    n_union `[] int32`, and slot_position `[T, K] int32` (each slot's index in union_ids; 0 for ids outside).
    """
    T, K = indices.shape
    ids = indices.reshape(-1).astype(jnp.int32)
    M = ids.shape[0]
    real = (ids >= 0) & (ids < num_experts)
    same = ids[:, None] == ids[None, :]  # [M, M]
    earlier = jnp.tri(M, k=-1, dtype=bool)  # earlier[m, m'] = m' < m
    is_first = real & ~jnp.any(same & earlier, axis=1)
    position_if_first = jnp.cumsum(is_first) - 1
    union_ids = jnp.zeros(M, jnp.int32).at[jnp.where(is_first, position_if_first, M)].set(ids, mode="drop")
    first_of = jnp.argmax(same & is_first[None, :], axis=1)  # the first slot with my id
    slot_position = jnp.where(real, position_if_first[first_of], 0).astype(jnp.int32)
    return union_ids, jnp.sum(is_first, dtype=jnp.int32), slot_position.reshape(T, K)


def check_decode_rows(name: str, p: MoEProblem) -> None:
    """`ValueError` unless `p` has T <= 8 rows and T·K <= 64 slots (what the decode kernels serve)."""
    T, _, _, _, K = p.dims
    if T > MAX_ROWS or T * K > MAX_SLOTS:
        raise ValueError(f"{name} serves T <= {MAX_ROWS} rows and T·K <= {MAX_SLOTS} slots, got T={T}, K={K}")


def union_row_scale(p: MoEProblem, slot_position: Array) -> Array:
    """`[T·K, T]` float32: row t's input scale for union expert u (summed over its slots that chose u)."""
    T, _, E, _, K = p.dims
    hit = (slot_position[None] == jnp.arange(T * K)[:, None, None]) & ((p.indices >= 0) & (p.indices < E))[None]
    return jnp.einsum("utk,tk->ut", hit.astype(jnp.float32), p.in_scale.astype(jnp.float32))


@interpret_by_platform
@moe_op
def moe_decode(p: MoEProblem, *, block_sizes: DecodeBlockSizes | None = None, interpret: bool | None = None) -> Array:
    """Routed experts (`MoEProblem`) for T <= 8 rows and T·K <= 64 slots: `[T, H]` float32.

    Weights bf16 (the fast path), f16, float32 (TF32 on a GPU), or `QuantizedWeight`s of any kind (each step's
    codes dequantized in registers to bf16). block_sizes: default `DecodeBlockSizes.for_problem`. interpret: None:
    compiled where lowered for CUDA, interpreted where lowered for CPU (`pallas_kernels.platform`); True/False
    force one.
    """
    check_decode_rows("moe_decode", p)
    T, H, E, _, K = p.dims
    dtype = compute_dtype(p.gate)  # bf16 for quantized weights
    bs = block_sizes or DecodeBlockSizes.for_problem(p, interpret)
    M = T * K

    union_ids, n_union, slot_position = union_of_experts(p.indices, E)
    padded = pad_problem(p, bs)
    hidden = padded.x.shape[1]
    if p.in_scale is None:
        rows = jnp.zeros((TILE_ROWS, hidden), dtype).at[:T].set(padded.x.astype(dtype))  # one tile shared by all
        tile_block = jnp.zeros(M, jnp.int32)
    else:
        row_scale = union_row_scale(p, slot_position)  # [M, T]
        scaled = (padded.x.astype(jnp.float32)[None] * row_scale[..., None]).astype(dtype)  # [M, T, H]
        rows = jnp.zeros((M, TILE_ROWS, hidden), dtype).at[:, :T].set(scaled).reshape(M * TILE_ROWS, hidden)
        tile_block = jnp.arange(M, dtype=jnp.int32)
    tables = (union_ids, tile_block, n_union[None])
    y = tiles_ffn(rows, padded, tables, bs, _ROWS_OUT, interpret)
    y = y.reshape(M, _ROWS_OUT, hidden)[:, :T, :H]  # [M, T, H]; entries >= n_union are unwritten
    per_slot = y[slot_position, jnp.arange(T)[:, None]]  # [T, K, H]
    return combine_slots(per_slot, p.indices, p.weights, E)


moe_decode_reference = moe_reference(moe_decode)
