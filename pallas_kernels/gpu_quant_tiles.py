"""The Mosaic GPU bodies of the tile kernels over quantized weights (`QuantizedWeight`: int8/int4, FP8 128x128
blocks, MXFP4, NVFP4); `gpu_tiles` launches them.

The same work items and epilogues as the dense bodies (gpu_tile_kernels.py), but each pipeline step stages the codes
(uint8 / e4m3, 64 rows x 64 columns) and their scale rows in shared memory by TMA; the warpgroup loads the codes
into registers, dequantizes them with float32 scales, rounds to bf16 and stores a bf16 tile to shared memory,
which the wgmma reads with the bf16 activation tile (`_quantized_step`). 4-bit codes give two tiles (even and odd
contraction elements), multiplied with the two halves of an activation block whose columns the wrapper reordered
(`split_even_odd`). The bf16 tiles are single-buffered: the decode of step k overlaps step k-1's wgmmas, the store
waits for them (NVFP4, 8 scale rows a step: waits first, decodes one tile at a time, else it spills).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.activations import GatedActivation
from pallas_kernels.gpu_tile_kernels import (
    TILE_ROWS,
    WorkItem,
    accumulate_tiles,
    down_epilogue,
    for_each_work_item,
    gate_up_epilogue,
    row_spec,
)
from pallas_kernels.quantized_weights import COMPUTE_DTYPE, QuantizedWeight, dequantize_tile, split_even_odd, tile_plan

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _QuantOperand:
    """Static description of one quantized projection read by a tile kernel (its refs: codes, scale, [zero],
    [scale2]). One pipeline step reads `code_rows` rows of codes (`block_k` elements of `in`) and `scale_rows`
    rows of the scale grid (fp8_block: one float32 scalar read from global memory instead)."""

    kind: str
    has_zero: bool
    has_scale2: bool
    group: int
    code_rows: int
    scale_rows: int

    @classmethod
    def of(cls, w: QuantizedWeight, bs) -> _QuantOperand:
        code_rows, scale_rows = tile_plan(w, bs.block_k, bs.block_n)
        return cls(w.kind, w.zero is not None, w.scale2 is not None, w.group, code_rows, scale_rows)

    @property
    def halves(self) -> int:
        """bf16 tiles per step: 2 for 4-bit codes (even and odd `in` elements), else 1."""
        return 2 if self.kind in ("int4", "mxfp4", "nvfp4") else 1

    @property
    def num_refs(self) -> int:
        return 2 + self.has_zero + self.has_scale2

    @staticmethod
    def arrays(w: QuantizedWeight) -> tuple[Array, ...]:
        """The kernel operands of a quantized projection, in ref order."""
        return tuple(a for a in (w.codes, w.scale, w.zero, w.scale2) if a is not None)

    def pipelined(self, refs, expert):
        """The refs the pipeline streams (this expert's codes, and its scale/zero rows unless fp8_block)."""
        codes, scale, *rest = refs
        if self.kind == "fp8_block":
            return [codes.at[expert]]
        return [codes.at[expert], scale.at[expert]] + ([rest[0].at[expert]] if self.has_zero else [])

    def in_specs(self, bs, col) -> list:
        specs = [plgpu.BlockSpec((self.code_rows, bs.block_n), lambda k: (k, col))]
        if self.kind == "fp8_block":
            return specs
        index = lambda k: (k * bs.block_k // self.group if self.group >= bs.block_k else k, col)
        return specs + [plgpu.BlockSpec((self.scale_rows, bs.block_n), index)] * (1 + self.has_zero)

    @property
    def num_streams(self) -> int:
        return 1 if self.kind == "fp8_block" else 2 + self.has_zero

    def dequantize(self, smems, refs, expert, k, col, bs) -> list[Array]:
        """This step's float32 tile(s) `[code_rows, block_n]` from the staged codes/scales (`dequantize_tile`)."""
        codes = smems[0][...]
        scale2 = refs[-1][expert] if self.has_scale2 else None
        if self.kind == "fp8_block":
            scale = refs[1][expert, k * bs.block_k // self.group, col * bs.block_n // self.group]
            return dequantize_tile(self.kind, codes, scale, None, None, self.code_rows)
        rows = [smems[1].at[j][...] for j in range(self.scale_rows)]
        zeros = [smems[2].at[j][...] for j in range(self.scale_rows)] if self.has_zero else None
        rows_per_group = self.group // 2 if self.halves == 2 else self.group
        return dequantize_tile(self.kind, codes, rows, zeros, scale2, rows_per_group)


def _x_specs(bs, halves: int, row_block) -> list:
    """Activation tiles of one step: `[64, block_k]`, or for 4-bit weights its [even | odd] halves (the caller
    reordered each block's columns, `split_even_odd`)."""
    if halves == 1:
        return [row_spec(bs, row_block)]
    half = bs.block_k // 2
    return [
        plgpu.BlockSpec((TILE_ROWS, half), lambda k, i=i: (row_block, 2 * k + i), delay_release=1) for i in range(2)
    ]


def _quantized_step(ops, op_refs, accs, bufs, expert, col, bs, halves: int):
    """The pipeline body of the quantized kernels: dequantize each projection's staged codes in registers, then
    (once the previous step's wgmmas no longer read the bf16 tiles) store them to shared memory and multiply.

    The register work (shared-memory loads, decode, scale) overlaps the previous step's wgmmas; the bf16 tiles are
    single-buffered, so the wait comes before their store. Pipeline stages (TMA of codes and activations) run
    `max_concurrent_steps` ahead as in the dense kernels.
    """

    # Many scale rows per step (NVFP4: 8 groups of 16 in a 128-element step) make the decode too large to hold
    # every tile in registers while the previous wgmmas run (it spills): wait first, then one tile at a time.
    overlap = all(op.scale_rows <= 4 for op in ops)

    def step(idx, *smems):
        (k,) = idx
        x_smems, rest = smems[:halves], smems[halves:]
        if not overlap:
            plgpu.wgmma_wait(0)
        tiles = []
        for op, refs, buf in zip(ops, op_refs, bufs, strict=True):
            # Rounded to bf16 at once: the tiles wait in registers for the previous wgmmas at half the size.
            values = [v.astype(COMPUTE_DTYPE) for v in op.dequantize(rest[: op.num_streams], refs, expert, k, col, bs)]
            rest = rest[op.num_streams :]
            if overlap:
                tiles.append(values)
            else:
                for v, half_buf in zip(values, buf, strict=True):
                    half_buf[...] = v
        if overlap:
            plgpu.wgmma_wait(0)
            for values, buf in zip(tiles, bufs, strict=True):
                for v, half_buf in zip(values, buf, strict=True):
                    half_buf[...] = v
        plgpu.commit_smem()
        for acc, buf in zip(accs, bufs, strict=True):
            for x_smem, half_buf in zip(x_smems, buf, strict=True):
                plgpu.wgmma(acc, x_smem, half_buf)

    return step


def _gate_up_kernel(tile_expert_ref, tile_block_ref, num_tiles_ref, x_ref, *refs, bs, op: _QuantOperand, act):
    """The dense `_gate_up_kernel` (gpu_tile_kernels.py) over quantized gate/up: the same work items and epilogue, the
    weights dequantized in registers into bf16 shared-memory tiles that the wgmma reads (`_quantized_step`).

    refs: gate's refs, up's refs (`_QuantOperand`), `[gate_bias, up_bias,] h` (out); x `[R, H]` bf16 (4-bit
    kinds: the columns of each block in [even | odd] order).
    """
    gate_refs, up_refs = refs[: op.num_refs], refs[op.num_refs : 2 * op.num_refs]
    *bias_refs, h_ref = refs[2 * op.num_refs :]

    def work_item(item: WorkItem) -> None:
        def with_tiles(*flat_bufs):  # the bf16 tiles (shared memory), then the accumulators (registers)
            bufs = [flat_bufs[: op.halves], flat_bufs[op.halves :]]
            step_of = lambda *accs: _quantized_step(
                [op, op], [gate_refs, up_refs], list(accs), bufs, item.expert, item.col, bs, op.halves
            )
            in_specs = _x_specs(bs, op.halves, item.row_block) + op.in_specs(bs, item.col) * 2
            refs = [x_ref] * op.halves + op.pipelined(gate_refs, item.expert) + op.pipelined(up_refs, item.expert)
            return accumulate_tiles(bs, 2, x_ref.shape[1] // bs.block_k, in_specs, refs, step_of)

        buf = plgpu.SMEM((bs.block_k // op.halves, bs.block_n), COMPUTE_DTYPE)
        gate, up = pl.run_scoped(with_tiles, *[buf] * (2 * op.halves))
        gate_up_epilogue(gate, up, bias_refs, h_ref, item, bs.block_n, act)

    for_each_work_item(tile_expert_ref, tile_block_ref, num_tiles_ref, h_ref, bs.block_n, work_item)


def _down_kernel(tile_expert_ref, num_tiles_ref, h_ref, *refs, bs, op: _QuantOperand, rows_out: int):
    """The dense `_down_kernel` (gpu_tile_kernels.py) over a quantized down projection (`_quantized_step`).

    refs: down's refs (`_QuantOperand`), `[down_bias,] y` (out); h `[N_tiles·64, I]` bf16 (4-bit kinds: the
    columns of each block in [even | odd] order).
    """
    down_refs = refs[: op.num_refs]
    *bias_refs, y_ref = refs[op.num_refs :]

    def work_item(item: WorkItem) -> None:
        def with_tiles(*bufs):
            step_of = lambda acc: _quantized_step(
                [op], [down_refs], [acc], [bufs], item.expert, item.col, bs, op.halves
            )
            in_specs = _x_specs(bs, op.halves, item.tile) + op.in_specs(bs, item.col)
            refs = [h_ref] * op.halves + op.pipelined(down_refs, item.expert)
            (y,) = accumulate_tiles(bs, 1, h_ref.shape[1] // bs.block_k, in_specs, refs, step_of)
            return y

        buf = plgpu.SMEM((bs.block_k // op.halves, bs.block_n), COMPUTE_DTYPE)
        y = pl.run_scoped(with_tiles, *[buf] * op.halves)
        down_epilogue(y, bias_refs, y_ref, item, bs.block_n, rows_out)

    for_each_work_item(tile_expert_ref, None, num_tiles_ref, y_ref, bs.block_n, work_item)


def gate_up_body(x: Array, gate: QuantizedWeight, up: QuantizedWeight, bs, act: GatedActivation):
    """`(kernel body, operands)` of gate/up over quantized weights: 4-bit kinds reorder x's columns per block."""
    op = _QuantOperand.of(gate, bs)
    if op.halves == 2:
        x = split_even_odd(x, bs.block_k)
    body = functools.partial(_gate_up_kernel, bs=bs, op=op, act=act)
    return body, (x, *op.arrays(gate), *op.arrays(up))


def down_body(h: Array, down: QuantizedWeight, bs, rows_out: int):
    """`(kernel body, operands)` of down over a quantized projection."""
    op = _QuantOperand.of(down, bs)
    if op.halves == 2:
        h = split_even_odd(h, bs.block_k)
    return functools.partial(_down_kernel, bs=bs, op=op, rows_out=rows_out), (h, *op.arrays(down))
