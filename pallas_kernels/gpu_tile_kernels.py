"""The Mosaic GPU bodies of the tile kernels over dense weights, and the work-item loop and epilogues that the
quantized bodies (gpu_quant_tiles.py) share; `gpu_tiles` launches them.

Every body runs on a persistent grid of CTAs (`"sm"`): `for_each_work_item` hands out the work items `(tile,
column block)` round-robin, tiles outer, with a trip count `num_tiles · column blocks` read on device. Each item
accumulates a `[64, block_n]` tile in float32 wgmma accumulators over a TMA pipeline of the contraction, and its
epilogue adds the biases, applies the activation (gate/up) and stores the tile through shared memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.activations import GatedActivation

Array = jax.Array

TILE_ROWS = 64  # rows of one wgmma warpgroup tile


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One work item: output `tile`, column block `col`, its `expert`, and the 64-row block of the input it reads."""

    tile: Array
    col: Array
    expert: Array
    row_block: Array


def for_each_work_item(tile_expert_ref, tile_block_ref, num_tiles_ref, out_ref, block_n: int, body) -> None:
    """`body(item: WorkItem)` for each work item of the persistent grid.

    Work item w = (tile, column block), tiles outer: consecutive items (on neighbouring SMs) share the input tile
    and the expert, so both stay in L2. The trip count is a device value: no program exists for a tile that has no
    rows. `tile_block_ref` None: tile t reads input rows block t.
    """
    n_col = out_ref.shape[1] // block_n

    @plgpu.nd_loop((num_tiles_ref[0] * n_col,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
        (w,) = info.index
        tile, col = w // n_col, w % n_col
        expert = tile_expert_ref[tile]
        row_block = tile if tile_block_ref is None else tile_block_ref[tile]
        body(WorkItem(tile, col, expert, row_block))


def _add_column_bias(values: Array, bias_refs, expert: Array, col: int | Array, block_n: int) -> list[Array]:
    """`v + bias[expert, col block]` for each (accumulator, bias GMEM ref) pair: the bias columns are copied into
    shared memory by TMA (one small copy per work item), then broadcast over the 64 rows."""
    cols = pl.ds(col * block_n, block_n)

    def scoped(*scratch):
        smems, barriers = scratch[: len(bias_refs)], scratch[len(bias_refs) :]
        for ref, smem, barrier in zip(bias_refs, smems, barriers, strict=True):
            plgpu.copy_gmem_to_smem(ref.at[expert, cols], smem, barrier)
        out = []
        for v, smem, barrier in zip(values, smems, barriers, strict=True):
            plgpu.barrier_wait(barrier)
            out.append(v + jax.lax.broadcast_in_dim(smem[...], v.shape, [1]))
        return out

    smem = [plgpu.SMEM((block_n,), jnp.float32) for _ in bias_refs]
    return pl.run_scoped(scoped, *smem, *[plgpu.Barrier() for _ in bias_refs])


def gate_up_epilogue(gate, up, bias_refs, h_ref, item: WorkItem, block_n: int, act: GatedActivation) -> None:
    """Biases (gpt-oss: on the float32 accumulators, before the activation), the activation on the accumulator
    registers, and h's `[64, block_n]` tile stored through shared memory."""
    if bias_refs:
        gate, up = _add_column_bias([gate, up], bias_refs, item.expert, item.col, block_n)
    h = act(gate, up)

    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((TILE_ROWS, block_n), h_ref.dtype))
    def _store(out_smem):
        out_smem[...] = h.astype(out_smem.dtype)
        plgpu.commit_smem()
        rows = pl.ds(item.tile * TILE_ROWS, TILE_ROWS)
        plgpu.copy_smem_to_gmem(out_smem, h_ref.at[rows, pl.ds(item.col * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def down_epilogue(y, bias_refs, y_ref, item: WorkItem, block_n: int, rows_out: int) -> None:
    """The bias, then the first `rows_out` rows of y's tile stored through shared memory (decode: the padded
    rows never leave the SM)."""
    if bias_refs:
        (y,) = _add_column_bias([y], bias_refs, item.expert, item.col, block_n)

    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((TILE_ROWS, block_n), jnp.float32))
    def _store(out_smem):
        out_smem[...] = y
        plgpu.commit_smem()
        dst = y_ref.at[pl.ds(item.tile * rows_out, rows_out), pl.ds(item.col * block_n, block_n)]
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rows_out)], dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def accumulate_tiles(bs, n_acc: int, steps: int, in_specs: list, refs: list, step_of) -> tuple[Array, ...]:
    """The float32 values of `n_acc` wgmma accumulators `[64, block_n]` after a TMA pipeline of `steps` contraction
    steps over `refs` (`in_specs`), whose body is `step_of(*accumulators)`; `max_concurrent_steps` stages ahead."""

    def scoped(*accs):
        pipeline = plgpu.emit_pipeline(
            step_of(*accs), grid=(steps,), in_specs=in_specs, max_concurrent_steps=bs.max_concurrent_steps
        )
        pipeline(*refs)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(scoped, *[plgpu.ACC((TILE_ROWS, bs.block_n)) for _ in range(n_acc)])


def row_spec(bs, row_block) -> plgpu.BlockSpec:
    """The activation tile `[64, block_k]` of contraction step k, rows `[64·row_block, +64)`."""
    return plgpu.BlockSpec((TILE_ROWS, bs.block_k), lambda k: (row_block, k), delay_release=1)


def _weight_spec(bs, transposed: bool, col) -> plgpu.BlockSpec:
    """A weight tile `[block_k, block_n]` of contraction step k (`[block_n, block_k]` when transposed)."""
    if transposed:
        return plgpu.BlockSpec((bs.block_n, bs.block_k), lambda k: (col, k), delay_release=1)
    return plgpu.BlockSpec((bs.block_k, bs.block_n), lambda k: (k, col), delay_release=1)


def _gate_up_kernel(
    tile_expert_ref, tile_block_ref, num_tiles_ref, x_ref, gate_ref, up_ref, *refs, bs, transposed, act
):
    """`h[tile] = act(x[tile_block[tile]] @ gate[e], x[...] @ up[e])`, e = `tile_expert[tile]`.

    GMEM refs: tile_expert, tile_block `[N_tiles]` int32 (each tile's expert and row block of x), num_tiles `[1]`
    int32 (tiles in use, a device value), x `[R, H]`, gate and up `[E, H, I]` (`[E, I, H]` when transposed), then
    `[gate_bias, up_bias ([E, I] float32),] h ([N_tiles·64, I], out)`.
    """
    *bias_refs, h_ref = refs

    def work_item(item: WorkItem) -> None:
        def step_of(acc_gate, acc_up):
            def step(_, x_smem, gate_smem, up_smem):
                # Both wgmmas read the same x stage; they run asynchronously, delay_release=1 keeps each stage
                # alive one step longer so that no wait is needed here.
                if transposed:
                    gate_smem = plgpu.transpose_ref(gate_smem, (1, 0))
                    up_smem = plgpu.transpose_ref(up_smem, (1, 0))
                plgpu.wgmma(acc_gate, x_smem, gate_smem)
                plgpu.wgmma(acc_up, x_smem, up_smem)

            return step

        w_spec = _weight_spec(bs, transposed, item.col)
        in_specs = [row_spec(bs, item.row_block), w_spec, w_spec]
        refs = [x_ref, gate_ref.at[item.expert], up_ref.at[item.expert]]
        gate, up = accumulate_tiles(bs, 2, x_ref.shape[1] // bs.block_k, in_specs, refs, step_of)
        gate_up_epilogue(gate, up, bias_refs, h_ref, item, bs.block_n, act)

    for_each_work_item(tile_expert_ref, tile_block_ref, num_tiles_ref, h_ref, bs.block_n, work_item)


def _down_kernel(tile_expert_ref, num_tiles_ref, h_ref, down_ref, *refs, bs, transposed: bool, rows_out: int):
    """`y[tile] = h[tile] @ down[e]`, float32, of which the first `rows_out` rows are stored.

    GMEM refs: tile_expert `[N_tiles]` and num_tiles `[1]` int32, h `[N_tiles·64, I]`, down `[E, I, H]` (`[E, H,
    I]` when transposed), then `[down_bias ([E, H] float32),] y ([N_tiles·rows_out, H] float32, out)`.
    """
    *bias_refs, y_ref = refs

    def work_item(item: WorkItem) -> None:
        def step_of(acc):
            def step(_, h_smem, down_smem):
                plgpu.wgmma(acc, h_smem, plgpu.transpose_ref(down_smem, (1, 0)) if transposed else down_smem)

            return step

        in_specs = [row_spec(bs, item.tile), _weight_spec(bs, transposed, item.col)]
        refs = [h_ref, down_ref.at[item.expert]]
        (y,) = accumulate_tiles(bs, 1, h_ref.shape[1] // bs.block_k, in_specs, refs, step_of)
        down_epilogue(y, bias_refs, y_ref, item, bs.block_n, rows_out)

    for_each_work_item(tile_expert_ref, None, num_tiles_ref, y_ref, bs.block_n, work_item)


def gate_up_body(x: Array, gate: Array, up: Array, bs, act: GatedActivation, interpret: bool):
    """`(kernel body, operands)` of gate/up over dense weights: float32 weights transposed when compiled (TF32
    wgmma reads K-major operands only; the GPU interpreter lacks the transposed view, so it runs untransposed)."""
    transposed = x.dtype == jnp.float32 and not interpret
    if transposed:
        gate, up = jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2)
    return functools.partial(_gate_up_kernel, bs=bs, transposed=transposed, act=act), (x, gate, up)


def down_body(h: Array, down: Array, bs, rows_out: int, interpret: bool):
    """`(kernel body, operands)` of down over a dense projection (transposed like `gate_up_body`)."""
    transposed = h.dtype == jnp.float32 and not interpret
    if transposed:
        down = jnp.swapaxes(down, 1, 2)
    return functools.partial(_down_kernel, bs=bs, transposed=transposed, rows_out=rows_out), (h, down)
