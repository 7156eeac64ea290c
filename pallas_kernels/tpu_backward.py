"""The grouped backward's two products on Mosaic TPU: jax's megablox `gmm` (with `transpose_rhs`) and `tgmm`.

The TPU variants of gpu_backward.py's `grouped_matmul` and `tgmm_tiles` (same arguments, lowered in their place
where a program is built for TPU: `pallas_kernels.platform`). They read the same block-aligned rows: each expert's
rows are consecutive, `64 · tiles` of them, which are megablox's groups (`group_sizes [E]`); rows past the tiles in
use are in no group. megablox visits only the tiles of non-empty groups and accumulates in float32 in VMEM;
`gmm(..., transpose_rhs=True)` reads each weight tile in its stored orientation (no transposed copy), `tgmm` takes
the rows' transpose `aᵀ [K, R]` (activation-sized, in XLA), as megablox's own backward does.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.gpu_backward import expert_tile_ranges
from pallas_kernels.gpu_tile_kernels import TILE_ROWS
from pallas_kernels.tpu_tiles import block_along, interpret_params, vmem_limit

Array = jax.Array
# The module, not the function of the same name that the megablox package exports (tgmm is not exported).
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _row_tile(rows: int) -> int:
    """megablox's row tile: 128 where it divides the rows (a multiple of 64 here), else 64."""
    return 128 if rows % 128 == 0 else TILE_ROWS


def _tiling(rows: int, k: int, n: int, itemsize: int, device_kind: str | None) -> tuple[int, int, int]:
    """`(tm, tk, tn)`: tn up to 512, tk as long as a quarter of the scoped VMEM holds the double-buffered tiles."""
    tm = _row_tile(rows)
    tn = block_along(n, 512, partial=True)
    tk = block_along(k, max(128, vmem_limit(device_kind) // 4 // (2 * itemsize * (tm + tn))), partial=True)
    return tm, tk, tn


def tpu_grouped_matmul(
    lhs: Array,
    w: Array,
    tile_expert: Array,
    num_tiles: Array,
    *,
    bias: Array | None = None,
    transpose_rhs: bool = False,
    device_kind: str | None = None,
    interpret: bool = False,
) -> Array:
    """`grouped_matmul` (gpu_backward.py) on megablox `gmm`: `[R, N]` float32, rows past the tiles in use
    undefined."""
    E = w.shape[0]
    N, K = (w.shape[1], w.shape[2]) if transpose_rhs else (w.shape[2], w.shape[1])
    _, tiles = expert_tile_ranges(tile_expert, num_tiles, E)
    tiling = _tiling(lhs.shape[0], K, N, jnp.dtype(lhs.dtype).itemsize, device_kind)
    out = megablox.gmm(
        lhs,
        w,
        tiles * TILE_ROWS,
        preferred_element_type=jnp.float32,
        tiling=tiling,
        transpose_rhs=transpose_rhs,
        interpret=interpret_params(interpret),
    )
    if bias is not None:
        row_expert = jnp.repeat(tile_expert, TILE_ROWS)  # [R]
        out = out + bias.astype(jnp.float32)[row_expert]
    return out


def tpu_tgmm_tiles(
    a: Array,
    b: Array,
    tile_expert: Array,
    num_tiles: Array,
    *,
    num_experts: int,
    out_dtype: Any = jnp.float32,
    device_kind: str | None = None,
    interpret: bool = False,
) -> Array:
    """`tgmm_tiles` (gpu_backward.py) on megablox `tgmm`: `[E, K, N]` float32, zero for experts with no tile."""
    _, tiles = expert_tile_ranges(tile_expert, num_tiles, num_experts)
    K, N = a.shape[1], b.shape[1]
    tm, _, tn = _tiling(a.shape[0], K, N, jnp.dtype(a.dtype).itemsize, device_kind)
    out = megablox.tgmm(
        a.T,
        b,
        tiles * TILE_ROWS,
        preferred_element_type=out_dtype,
        tiling=(tm, block_along(K, 512, partial=True), tn),
        interpret=interpret_params(interpret),
    )
    # megablox leaves the output of a group with no rows unwritten: zero it.
    return jnp.where((tiles > 0)[:, None, None], out, 0.0)
