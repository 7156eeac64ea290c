"""Grouped prefill on Mosaic GPU: (token, slot) pairs sorted by expert in 64-row block-aligned tiles.

Lowering: Mosaic GPU, through the two tile kernels of gpu_tiles.py (shared with the decode op): this module
builds the block-aligned tile table on device and the combine. Prefill is bound by arithmetic: pairs of the same
expert are multiplied together in 64-row tiles.

1. Metadata on device, static shapes: per expert its pair count and `ceil(count / 64)` tiles; a stable
   argsort of the pairs by expert; each pair's row in the block-aligned layout (`64 · first tile of its
   expert + rank within the expert`), so that every tile holds rows of one expert only; the table
   `tile_expert[tile]` (a searchsorted of the tile offsets: one lookup per tile, done once, read by the kernels
   in constant time) and the number of tiles in use. Ids outside [0, E) (zero-computation experts) get no row.
2. Rows gathered into that layout (padding rows are zero) -> `gate_up_tiles` (gate and up in one pass, two
   float32 accumulators, activation in the epilogue) -> h -> `down_tiles` -> float32 rows. The kernels' loop
   runs `num_tiles · column blocks` work items, a device value: no program exists for an empty expert, and at
   most `ceil(T·K / 64) + min(E, T·K)` tiles exist at all.
3. Each pair's row is gathered back and the slots of a token are summed with their weights in slot order.
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


class GroupedBlockSizes(TilePairBlockSizes):
    """Blocks of the two grouped kernels (see `TileBlockSizes`); rows per tile are fixed at 64. Default: the
    largest of 128/64 columns dividing I (gate/up) and H (down)."""


def max_tiles(num_pairs: int, num_experts: int, tile_rows: int = TILE_ROWS) -> int:
    """Static bound on `Σ_e ceil(count_e / tile_rows)`: each non-empty expert wastes less than one tile."""
    return max(1, min(num_pairs, -(-num_pairs // tile_rows) + min(num_experts, num_pairs)))


def block_aligned_layout(
    indices: Array, num_experts: int, tile_rows: int = TILE_ROWS
) -> tuple[Array, Array, Array, Array]:
    """The tile table of step 1 (module docstring), on device, in tiles of `tile_rows` rows (64 here; the
    Mosaic TPU grouped kernel's own).

    Returns:
      pair_row `[T·K] int32`: each pair's row in the block-aligned layout (R = tile_rows·max_tiles for ids
        outside).
      row_pair `[R] int32`: the pair in each row (T·K for padding rows).
      tile_expert `[max_tiles] int32`: the expert of each tile (clamped into [0, E) past the tiles in use).
      num_tiles `[1] int32`: tiles in use.
    """
    M = indices.size
    E = num_experts
    n_tiles = max_tiles(M, E, tile_rows)
    R = n_tiles * tile_rows
    ids = indices.reshape(-1).astype(jnp.int32)
    expert_of_pair = jnp.where((ids >= 0) & (ids < E), ids, E)  # [M]; outside -> bucket E, sorted last
    counts = jnp.bincount(expert_of_pair, length=E + 1)[:E]  # [E]
    tiles = (counts + tile_rows - 1) // tile_rows
    tile_end = jnp.cumsum(tiles)
    first_tile = tile_end - tiles
    first_sorted = jnp.cumsum(counts) - counts  # [E] first sorted position of each expert
    order = jnp.argsort(expert_of_pair, stable=True)  # [M] the pair at each sorted position
    sorted_expert = expert_of_pair[order]
    safe = jnp.minimum(sorted_expert, E - 1)
    rank = jnp.arange(M, dtype=jnp.int32) - first_sorted[safe]
    row_of_sorted = jnp.where(sorted_expert < E, first_tile[safe] * tile_rows + rank, R)
    pair_row = jnp.zeros(M, jnp.int32).at[order].set(row_of_sorted.astype(jnp.int32))
    row_pair = jnp.full(R, M, jnp.int32).at[row_of_sorted].set(order.astype(jnp.int32), mode="drop")
    tile_ids = jnp.arange(n_tiles, dtype=jnp.int32)
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, tile_ids, side="right"), E - 1).astype(jnp.int32)
    return pair_row, row_pair, tile_expert, tile_end[-1:].astype(jnp.int32)


def block_aligned_rows(x: Array, in_scale: Array | None, row_pair: Array, num_slots: int, dtype) -> Array:
    """The rows of the block-aligned layout `[R, H]` in `dtype`: row r holds the token of pair `row_pair[r]`
    (`x [T, H]`, `num_slots` = K pairs per token) scaled by that pair's input scale (`in_scale [T, K]` or None);
    padding rows (`row_pair >= T·K`) are zero. Shared with the Mosaic TPU grouped op (tpu_grouped.py)."""
    T, H = x.shape
    M = T * num_slots
    padding = row_pair >= M
    token_of_row = jnp.where(padding, T, row_pair // num_slots)  # row T of x_ext is zeros
    if in_scale is None:
        x_ext = jnp.concatenate([x.astype(dtype), jnp.zeros((1, H), dtype)])
        return x_ext[token_of_row]
    x_ext = jnp.concatenate([x.astype(jnp.float32), jnp.zeros((1, H), jnp.float32)])
    scale = jnp.where(padding, 0.0, in_scale.reshape(-1).astype(jnp.float32)[jnp.minimum(row_pair, M - 1)])
    return (x_ext[token_of_row] * scale[:, None]).astype(dtype)


@interpret_by_platform
@moe_op
def moe_grouped(p: MoEProblem, *, block_sizes: GroupedBlockSizes | None = None, interpret: bool | None = None) -> Array:
    """Routed experts (`MoEProblem`) for any number of rows: `[T, H]` float32. Weights and `interpret` as for
    `moe_decode`; block_sizes: default `GroupedBlockSizes.for_problem`."""
    T, H, E, _, K = p.dims
    dtype = compute_dtype(p.gate)  # bf16 for quantized weights
    bs = block_sizes or GroupedBlockSizes.for_problem(p, interpret)

    pair_row, row_pair, tile_expert, num_tiles = block_aligned_layout(p.indices, E)
    padded = pad_problem(p, bs)
    rows = block_aligned_rows(padded.x, p.in_scale, row_pair, K, dtype)  # [R, H]
    tile_block = jnp.arange(tile_expert.shape[0], dtype=jnp.int32)
    y = tiles_ffn(rows, padded, (tile_expert, tile_block, num_tiles), bs, TILE_ROWS, interpret)
    per_pair = y[jnp.minimum(pair_row, y.shape[0] - 1), :H]  # [M, H]; rows of ids outside are masked below
    return combine_slots(per_pair.reshape(T, K, H), p.indices, p.weights, E)


moe_grouped_reference = moe_reference(moe_grouped)
