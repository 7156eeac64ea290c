"""The grouped backward's two products on Mosaic GPU, over the block-aligned tile table of gpu_grouped.py.

1. `grouped_matmul`: `out[tile] = lhs[tile] @ w[e] + bias[e]`, e = `tile_expert[tile]`, float32, or with
   `transpose_rhs` `lhs[tile] @ w[e]ᵀ`: the recomputed pre-activations (`x · gate`, `x · up`, `h · down`) and the
   input gradients (`dh = dy · downᵀ`, `dx = dg · gateᵀ + du · upᵀ`). It is the down tile kernel of
   gpu_tile_kernels.py; transposed, it reads the weights in their stored orientation through a transposed shared
   memory view: no transposed copy of the weights.
2. `tgmm_tiles`: `dW[e] = Σ_{tiles t of e} a[t]ᵀ @ b[t]` (`[R, K], [R, N] -> [E, K, N]` float32): the weight
   gradients (`dgate_e = x_eᵀ · dg_e`, `ddown_e = h_eᵀ · dy_e`), the rows of expert e only. Work item (expert,
   64-row block of K, `block_n` columns of N) on the persistent grid; its contraction runs over the expert's tiles
   only (a device trip count: an empty expert's items store zeros and read nothing), one wgmma accumulator in
   float32 over a TMA pipeline.

Lowering: Mosaic GPU, warpgroup semantics. wgmma's A operand is `[64, k]` in shared memory, so `tgmm_tiles` takes
`aᵀ [K, R]` (an activation-sized transpose in XLA, never a weight-sized one). TF32 (float32 operands) reads
K-major operands only: compiled, the float32 `b` is transposed too and read through a transposed view; the GPU
interpreter has no transposed view, so interpreted runs take the untransposed operands (as gpu_tile_kernels.py).
Shapes must be multiples of the blocks (the callers pad).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_tile_kernels
from pallas_kernels.gpu_tile_kernels import TILE_ROWS, accumulate_tiles
from pallas_kernels.gpu_tiles import TileBlockSizes, _launch
from pallas_kernels.moe_op import FLOAT_DTYPES, signature_of
from pallas_kernels.platform import interpret_by_platform

Array = jax.Array


def _check_tables(name: str, rows: int, tile_expert: Array, num_tiles: Array) -> None:
    if tile_expert.ndim != 1 or num_tiles.shape != (1,) or rows != tile_expert.shape[0] * TILE_ROWS:
        raise ValueError(
            f"{name}: need rows = N_tiles·64, tile_expert [N_tiles], num_tiles [1], got {rows=} "
            f"{tile_expert.shape=} {num_tiles.shape=}"
        )


@interpret_by_platform
def grouped_matmul(
    lhs: Array,
    w: Array,
    tile_expert: Array,
    num_tiles: Array,
    *,
    bias: Array | None = None,
    transpose_rhs: bool = False,
    block_sizes: TileBlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """`out [N_tiles·64, N]` float32: tile t (< num_tiles) holds `lhs[tile t] @ w[e] + bias[e]`, e =
    `tile_expert[t]`, for `lhs [N_tiles·64, K]` and `w [E, K, N]` of lhs's dtype (`transpose_rhs`: `w [E, N, K]`,
    multiplied as `w[e]ᵀ`), `bias [E, N]` or None; tiles >= num_tiles are unwritten. N must be a multiple of
    `block_n` and K of `block_k`."""
    _check_tables("grouped_matmul", lhs.shape[0], tile_expert, num_tiles)
    k_axis = 2 if transpose_rhs else 1
    if lhs.ndim != 2 or w.ndim != 3 or w.shape[k_axis] != lhs.shape[1]:
        raise ValueError(
            f"grouped_matmul: need lhs [R, K] and w [E, K, N] ({transpose_rhs=}), got {lhs.shape=} {w.shape=}"
        )
    if w.dtype != lhs.dtype or w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"grouped_matmul: lhs and w must share one of bf16/f16/f32, got {lhs.dtype=} {w.dtype=}")
    E, N, K = w.shape[0], w.shape[3 - k_axis], lhs.shape[1]
    biases = () if bias is None else (bias.astype(jnp.float32),)
    if bias is not None and tuple(bias.shape) != (E, N):
        raise ValueError(f"grouped_matmul: bias must be {(E, N)}, got {bias.shape=}")
    bs = block_sizes or TileBlockSizes.default(N, K, lhs.dtype, interpret=interpret)
    if N % bs.block_n or K % bs.block_k:
        raise ValueError(f"grouped_matmul: N={N} and K={K} must be multiples of {bs.block_n=} and {bs.block_k=}")
    # The down tile kernel reads `[K, N]` weight tiles, or `[N, K]` ones through a transposed view: compiled, the
    # stored orientation is read as it is, except float32 `[K, N]` weights (TF32 reads K-major operands only, so
    # they are transposed, as in the forward); the interpreter has no transposed view and reads `[K, N]`.
    view = not interpret and (transpose_rhs or lhs.dtype == jnp.float32)
    weights = w if view == transpose_rhs else jnp.swapaxes(w, 1, 2)
    body = functools.partial(gpu_tile_kernels._down_kernel, bs=bs, transposed=view, rows_out=TILE_ROWS)
    tables = (tile_expert.astype(jnp.int32), num_tiles.astype(jnp.int32))
    out_shape = (lhs.shape[0], N)
    return _launch(body, out_shape, jnp.float32, "moe_grouped_matmul", bs, interpret, *tables, lhs, weights, *biases)


@signature_of(grouped_matmul)
def grouped_matmul_reference(lhs, w, tile_expert, num_tiles, bias, transpose_rhs, **_):
    """Plain-jnp `grouped_matmul`; tiles >= num_tiles are zero here (unwritten in the kernel)."""
    lb = lhs.reshape(-1, TILE_ROWS, lhs.shape[1])  # [N_tiles, 64, K]
    spec = "trk,tnk->trn" if transpose_rhs else "trk,tkn->trn"
    out = jnp.einsum(spec, lb, w[tile_expert], preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)[tile_expert][:, None]
    live = jnp.arange(tile_expert.shape[0]) < num_tiles[0]
    return jnp.where(live[:, None, None], out, 0.0).reshape(lhs.shape[0], -1)


def _tgmm_kernel(first_tile_ref, expert_tiles_ref, a_t_ref, b_ref, out_ref, *, bs: TileBlockSizes, transposed: bool):
    """`out[e, kb, nb] = Σ_{s < steps(e)} a_t[kb, first(e) + s] @ b[first(e) + s, nb]` (blocks of 64 x block_k
    and block_k x block_n), float32.

    GMEM refs: first_tile, expert_tiles `[E]` int32 (each expert's first tile and tile count), a_t `[K, R]`, b
    `[R, N]` (`[N, R]` when transposed), out `[E, K, N]` float32.
    """
    E, K, N = out_ref.shape
    n_k, n_n = K // TILE_ROWS, N // bs.block_n
    steps_per_tile = TILE_ROWS // bs.block_k

    @plgpu.nd_loop((E * n_k * n_n,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
        (w,) = info.index
        e, kb, nb = w // (n_k * n_n), (w // n_n) % n_k, w % n_n
        first = first_tile_ref[e] * steps_per_tile
        steps = expert_tiles_ref[e] * steps_per_tile  # 0 for an empty expert: the accumulator stays zero

        def step_of(acc):
            def step(_, a_smem, b_smem):
                plgpu.wgmma(acc, a_smem, plgpu.transpose_ref(b_smem, (1, 0)) if transposed else b_smem)

            return step

        a_spec = plgpu.BlockSpec((TILE_ROWS, bs.block_k), lambda s: (kb, first + s), delay_release=1)
        if transposed:
            b_spec = plgpu.BlockSpec((bs.block_n, bs.block_k), lambda s: (nb, first + s), delay_release=1)
        else:
            b_spec = plgpu.BlockSpec((bs.block_k, bs.block_n), lambda s: (first + s, nb), delay_release=1)
        (acc,) = accumulate_tiles(bs, 1, steps, [a_spec, b_spec], [a_t_ref, b_ref], step_of)

        @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((TILE_ROWS, bs.block_n), out_ref.dtype))
        def _store(out_smem):
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            dst = out_ref.at[e, pl.ds(kb * TILE_ROWS, TILE_ROWS), pl.ds(nb * bs.block_n, bs.block_n)]
            plgpu.copy_smem_to_gmem(out_smem, dst)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def expert_tile_ranges(tile_expert: Array, num_tiles: Array, num_experts: int) -> tuple[Array, Array]:
    """`(first_tile [E], tiles [E])` int32 of a block-aligned tile table: each expert's tiles are consecutive."""
    live = jnp.arange(tile_expert.shape[0]) < num_tiles[0]
    tiles = jnp.zeros(num_experts, jnp.int32).at[tile_expert].add(live.astype(jnp.int32))
    return (jnp.cumsum(tiles) - tiles).astype(jnp.int32), tiles


@interpret_by_platform
def tgmm_tiles(
    a: Array,
    b: Array,
    tile_expert: Array,
    num_tiles: Array,
    *,
    num_experts: int,
    out_dtype: Any = jnp.float32,
    block_sizes: TileBlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """`dW [E, K, N]` in `out_dtype`, summed in float32: `dW[e] = Σ_{t < num_tiles, tile_expert[t] = e} a[tile t]ᵀ
    @ b[tile t]` for `a [R, K]` and `b [R, N]` (R = N_tiles·64, one float dtype); zero for experts with no tile. K
    must be a multiple of 64 and N of `block_n`. The tiles of an expert must be consecutive (the block-aligned
    layout)."""
    _check_tables("tgmm_tiles", a.shape[0], tile_expert, num_tiles)
    if a.ndim != 2 or b.ndim != 2 or b.shape[0] != a.shape[0] or a.dtype != b.dtype or a.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"tgmm_tiles: need a [R, K], b [R, N] of one float dtype, got {a.shape=} {a.dtype=} {b.shape=} {b.dtype=}"
        )
    K, N = a.shape[1], b.shape[1]
    bs = block_sizes or TileBlockSizes.default(N, TILE_ROWS, a.dtype, interpret=interpret)
    if K % TILE_ROWS or N % bs.block_n or TILE_ROWS % bs.block_k:
        raise ValueError(f"tgmm_tiles: K={K} must be a multiple of 64 and N={N} of {bs.block_n=}; {bs.block_k=}")
    transposed = a.dtype == jnp.float32 and not interpret
    first_tile, tiles = expert_tile_ranges(tile_expert, num_tiles, num_experts)
    operands = (a.T, b.T if transposed else b)
    body = functools.partial(_tgmm_kernel, bs=bs, transposed=transposed)
    return _launch(body, (num_experts, K, N), out_dtype, "moe_tgmm_tiles", bs, interpret, first_tile, tiles, *operands)


@signature_of(tgmm_tiles)
def tgmm_tiles_reference(a, b, tile_expert, num_tiles, num_experts, out_dtype, **_):
    """Plain-jnp `tgmm_tiles`."""
    live = jnp.arange(tile_expert.shape[0]) < num_tiles[0]
    onehot = jax.nn.one_hot(jnp.where(live, tile_expert, num_experts), num_experts, dtype=jnp.float32)  # [tiles, E]
    ab = jnp.einsum(
        "trk,trn->tkn",
        a.reshape(-1, TILE_ROWS, a.shape[1]),
        b.reshape(-1, TILE_ROWS, b.shape[1]),
        preferred_element_type=jnp.float32,
    )
    return jnp.einsum("te,tkn->ekn", onehot, ab).astype(out_dtype)
