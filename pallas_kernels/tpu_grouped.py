"""Grouped prefill on Mosaic TPU: (token, slot) pairs sorted by expert, multiplied tile by tile.

Lowering: **Mosaic TPU**. The TPU counterpart of `gpu_grouped.py` (Mosaic GPU), same signature, same reference;
`pallas_kernels.platform` lowers it where a program is built for TPU. Two paths:

Dense weights (bf16/float32) through jax's megablox `gmm` (a Pallas TPU grouped matmul: per m-tile of sorted rows
the group's `[tk, tn]` weight tiles, pipelined HBM -> VMEM, MXU with a float32 VMEM accumulator; tiles of empty
groups are never visited):

1. Stable argsort of the T·K pairs by expert (ids outside [0, E) last, in no group); `group_sizes [E]`; rows
   gathered in that order (scaled by their input scales) and padded to a multiple of the row tile.
2. `gmm(rows, gate)`, `gmm(rows, up)` float32; biases added per row; the activation; h in the weight dtype;
   `gmm(h, down)` float32. Rows in no group are never written by gmm (their values are undefined).
3. Each pair's row gathered back; each token's slots summed with their weights in slot order (rows of ids
   outside, and slots of weight 0, contribute exactly 0). The activation runs in XLA between the products (h makes
   one round trip through HBM: `T·K·I` elements, small next to the weights at prefill sizes).

Quantized weights (every `QuantizedWeight` kind), and dense ones when `TpuGroupedBlockSizes.tiles` is given, through
the tile kernels of tpu_tiles.py, which dequantize each weight tile in VMEM (bf16 MXU, float32 accumulation) and fuse
the activation into the gate/up kernel (h written once, in the multiply dtype):

1. The block-aligned tile table of gpu_grouped.py (`block_aligned_layout`, in tiles of `tm` rows): every tile holds
   rows of one expert; the rows gathered into it (scaled; padding rows zero).
2. `tpu_tiles.gate_up` (gate and up in one pass, the activation on the last contraction step) -> h in bf16 ->
   `tpu_tiles.down` -> float32 rows; tiles past those in use copy and compute nothing.
3. As step 3 above.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from pallas_kernels.gpu_grouped import block_aligned_layout, block_aligned_rows
from pallas_kernels.gpu_tiles import round_up
from pallas_kernels.moe_op import MoEProblem, combine_slots, compute_dtype, moe_op, moe_reference
from pallas_kernels.tpu_fused import tile_ffn
from pallas_kernels.tpu_quant import TpuQuant, reorder_for
from pallas_kernels.tpu_tiles import (
    TpuTileBlockSizes,
    block_along,
    check_tpu_weights,
    interpret_params,
    quant_pair,
    vmem_limit,
)

Array = jax.Array

# The MXU's side by `device_kind`: row tiles of 256 fill v6e's 256x256 MXU, 128 the 128x128 ones.
_MXU = {"TPU v6 lite": 256, "TPU v6e": 256, "TPU7x": 256}


@dataclasses.dataclass(frozen=True)
class TpuGroupedBlockSizes:
    """Tiles `(tm, tk, tn)` of gmm for gate/up (`gate_up`, over [rows, H] x [H, I]) and down ([rows, I] x [I, H]).

    tm: rows per tile (a multiple of 8); tk, tn: multiples of 128 (gmm masks a partial last block), or the whole
    dimension.
    """

    gate_up: tuple[int, int, int]
    down: tuple[int, int, int]
    # The tile kernels' tiles (rows: gate_up's tm): quantized weights always run them (default tiles when None);
    # dense weights run them, with the activation fused into the gate/up kernel, only when these are given.
    tiles: TpuTileBlockSizes | None = None

    def __post_init__(self) -> None:
        for name in ("gate_up", "down"):
            t = getattr(self, name)
            if len(t) != 3 or not all(isinstance(v, int) and v > 0 for v in t) or t[0] % 8:
                raise ValueError(f"TpuGroupedBlockSizes.{name} must be 3 positive ints, tm % 8 == 0, got {t!r}")

    @classmethod
    def default(
        cls,
        rows: int,
        hidden: int,
        inter: int,
        dtype: Any,
        device_kind: str | None = None,
        quant: tuple[TpuQuant, TpuQuant] | None = None,
    ) -> TpuGroupedBlockSizes:
        """tm: the MXU side (at most the rows, rounded to 8); tn up to 512; tk as long as a quarter of the scoped
        VMEM holds the double-buffered lhs and rhs tiles. `quant` (quantized projections): also the tile kernels'
        tiles for `tm` rows (`TpuTileBlockSizes.default`)."""
        item = jnp.dtype(dtype).itemsize
        budget = vmem_limit(device_kind) // 4
        tm = min(_MXU.get(device_kind or "", 128), round_up(rows, 8))

        def tiles(k: int, n: int) -> tuple[int, int, int]:
            # gmm masks a partial last block of k and clips one of n.
            tn = block_along(n, 512, partial=True)
            tk = block_along(k, max(128, budget // (2 * item * (tm + tn))), partial=True)
            return tm, tk, tn

        quantized = None if quant is None else TpuTileBlockSizes.default(hidden, inter, dtype, device_kind, quant, tm)
        return cls(tiles(hidden, inter), tiles(inter, hidden), quantized)


@moe_op
def moe_tpu_grouped(
    p: MoEProblem,
    *,
    block_sizes: TpuGroupedBlockSizes | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> Array:
    """Routed experts for any number of rows (`MoEProblem`) on Mosaic TPU, `[T, H]` float32 (module docstring).

    Weights bf16 or float32 (megablox `gmm`), or `QuantizedWeight`s of any kind (the tile kernels). in_scale:
    each pair is scaled on its own.
    block_sizes: `TpuGroupedBlockSizes`, default `TpuGroupedBlockSizes.default(T·K, H, I, dtype, device_kind,
      quant)`.
    device_kind: the TPU the program is compiled for (sizes the tiles; `pallas_kernels.platform` passes it).
    interpret: run under Pallas's TPU interpreter (on CPU, for tests).
    """
    check_tpu_weights("moe_tpu_grouped", p.gate)
    T, H, _, I, K = p.dims
    quant = quant_pair(p.gate, p.down)
    bs = block_sizes or TpuGroupedBlockSizes.default(T * K, H, I, compute_dtype(p.gate), device_kind, quant)
    if quant is not None or bs.tiles is not None:
        return _tiled_grouped(p, quant, bs, device_kind, interpret)
    return _dense_grouped(p, bs, interpret)


def _dense_grouped(p: MoEProblem, bs: TpuGroupedBlockSizes, interpret: bool) -> Array:
    """Dense weights on megablox `gmm` (module docstring, first path)."""
    T, H, E, _, K = p.dims
    x, gate, up, down, indices, weights, in_scale = p.x, p.gate, p.up, p.down, p.indices, p.weights, p.in_scale
    gate_bias, up_bias, down_bias = p.biases
    M = T * K
    dtype = gate.dtype
    rows_padded = round_up(M, math.lcm(bs.gate_up[0], bs.down[0]))

    ids = indices.reshape(-1).astype(jnp.int32)
    expert_of_pair = jnp.where((ids >= 0) & (ids < E), ids, E)  # [M]; outside -> E, sorted last
    order = jnp.argsort(expert_of_pair, stable=True)  # [M] the pair at each sorted row
    sorted_expert = jnp.minimum(expert_of_pair[order], E - 1)  # for bias gathers only
    group_sizes = jnp.bincount(expert_of_pair, length=E + 1)[:E].astype(jnp.int32)  # [E]
    rows = x[order // K].astype(jnp.float32)  # [M, H]
    if in_scale is not None:
        rows = rows * in_scale.reshape(-1).astype(jnp.float32)[order][:, None]
    rows = jnp.pad(rows.astype(dtype), ((0, rows_padded - M), (0, 0)))  # [R, H]
    run = dict(preferred_element_type=jnp.float32, interpret=interpret_params(interpret))

    g = gmm(rows, gate, group_sizes, tiling=bs.gate_up, **run)[:M]  # [M, I]
    u = gmm(rows, up, group_sizes, tiling=bs.gate_up, **run)[:M]
    if gate_bias is not None:
        g = g + gate_bias.astype(jnp.float32)[sorted_expert]
        u = u + up_bias.astype(jnp.float32)[sorted_expert]
    h = jnp.pad(p.activation(g, u).astype(dtype), ((0, rows_padded - M), (0, 0)))  # [R, I]
    y = gmm(h, down, group_sizes, tiling=bs.down, **run)[:M]  # [M, H]
    if down_bias is not None:
        y = y + down_bias.astype(jnp.float32)[sorted_expert]
    # Un-sort by a gather: XLA:TPU compiles a [M, H] scatter far more slowly (28 s against 5 s at M=16384).
    sorted_row = jnp.zeros(M, jnp.int32).at[order].set(jnp.arange(M, dtype=jnp.int32))  # [M] each pair's row
    per_pair = y[sorted_row]  # [M, H]
    return combine_slots(per_pair.reshape(T, K, H), indices, weights, E)


def _tiled_grouped(p: MoEProblem, quant, bs: TpuGroupedBlockSizes, device_kind, interpret: bool) -> Array:
    """Quantized weights, or dense ones given `bs.tiles`, on the tile kernels (module docstring, second path)."""
    T, H, E, I, K = p.dims
    tm, dtype = bs.gate_up[0], compute_dtype(p.gate)
    tiles = bs.tiles or TpuTileBlockSizes.default(H, I, dtype, device_kind, quant, tm)
    tiles.check(H, I, quant)
    pair_row, row_pair, tile_expert, num_tiles = block_aligned_layout(p.indices, E, tm)
    R = row_pair.shape[0]
    rows = block_aligned_rows(p.x, p.in_scale, row_pair, K, dtype)  # [R, H]
    fused = tiles.fused_block_i is not None  # one kernel, contraction over the whole H
    rows = reorder_for(quant and quant[0], rows, H if fused else tiles.block_h).reshape(R // tm, tm, H)
    tables = (tile_expert, num_tiles)
    biases = () if p.gate_bias is None else tuple(b[:, None] for b in p.biases)  # [E, 1, I] x 2, [E, 1, H]
    run = dict(scales_by_tile=False, interpret=interpret)
    y = tile_ffn(rows, None, p, biases, tables, quant, dtype, tiles, name="moe_tpu_grouped", **run)  # [tiles, tm, H]
    y = y.reshape(R, H)
    per_pair = y[jnp.minimum(pair_row, R - 1)]  # [M, H]; rows of ids outside are masked by combine_slots
    return combine_slots(per_pair.reshape(T, K, H), p.indices, p.weights, E)


moe_tpu_grouped_reference = moe_reference(moe_tpu_grouped)
