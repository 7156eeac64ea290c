"""Union-of-experts decode on Mosaic TPU: T <= 8 rows, each union expert's weight tiles read once per step.

Lowering: **Mosaic TPU**, through the two tile kernels of tpu_tiles.py (shared with the quantized grouped
prefill). The TPU counterpart of `gpu_decode.py` (Mosaic GPU), same signature, same reference
(`moe_decode_reference`); `pallas_kernels.platform` lowers it where a program is built for TPU.

Decode is bound by weight reads: each expert chosen by any row must be read once, and applied to every row.

1. `union_of_experts` (gpu_decode.py): the distinct ids `union_ids[:n_union]`, and each slot's union position.
   Each union expert's row scales `row_scale [M, 8, 1]` (Llama-4's input scales summed per row), without them
   the rows are cast once and shared by every tile.
2. `tpu_tiles.gate_up` with one tile per union expert (all reading the same 8 padded rows) -> `h [M, 8, I]`;
   `tpu_tiles.down` -> `y [M, 8, H]` float32. Union slots past `n_union` copy and compute nothing. With
   `TpuDecodeBlockSizes.fused_block_i`, one kernel instead (tpu_fused.py: h stays in VMEM).
3. Row t takes `y[position of its slot k, t]` and sums its slots with their weights in slot order
   (`combine_slots`): a row's output does not depend on the rows beside it.

Weights: bf16 or float32 (stacked `[E, H, I]` / `[E, I, H]`), or `QuantizedWeight`s of every kind (int8/int4
group-wise, FP8 128x128 blocks, MXFP4, NVFP4): each tile's codes and scales are copied to VMEM as stored and
dequantized there to bf16 for the MXU (float32 accumulation; tpu_quant.py). Float16 raises `NotImplementedError`
(the Mosaic GPU kernels serve it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gpu_decode import check_decode_rows, union_of_experts, union_row_scale
from pallas_kernels.moe_op import MoEProblem, combine_slots, compute_dtype, moe_op, moe_reference
from pallas_kernels.tpu_fused import tile_ffn
from pallas_kernels.tpu_quant import reorder_for
from pallas_kernels.tpu_tiles import (  # noqa: F401 (re-exported: the TPU kernels' shared names)
    TPU_DTYPES,
    VMEM_BYTES,
    TpuTileBlockSizes,
    block_along,
    check_tpu_weights,
    interpret_params,
    quant_pair,
    vmem_limit,
)

Array = jax.Array

_ROWS = 8  # rows of every tile: T padded to one sublane group


class TpuDecodeBlockSizes(TpuTileBlockSizes):
    """Tiles of the two decode kernels (`TpuTileBlockSizes`: gate/up `[block_h, block_i]`, down `[block_i_down,
    block_h_down]`, the scoped VMEM; `fused_block_i` set: the one fused kernel instead, tpu_fused.py); default:
    `TpuDecodeBlockSizes.default(H, I, dtype, device_kind, quant)` (two kernels; `fused=True`: fused where it fits)."""


@moe_op
def moe_tpu_decode(
    p: MoEProblem,
    *,
    block_sizes: TpuDecodeBlockSizes | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> Array:
    """Routed experts for T <= 8 rows (`MoEProblem`) on Mosaic TPU, `[T, H]` float32.

    Weights bf16 or float32, or `QuantizedWeight`s of any kind (contraction tiles of whole groups; where none
    divides H or I, the whole dimension).
    block_sizes: `TpuDecodeBlockSizes`, default `TpuDecodeBlockSizes.default(H, I, dtype, device_kind, quant)`.
    device_kind: the TPU the program is compiled for (JAX's `device_kind`, e.g. "TPU v6 lite"): its VMEM sizes
      the tiles (`pallas_kernels.platform` passes it when lowering).
    interpret: run under Pallas's TPU interpreter (on CPU, for tests).
    """
    check_tpu_weights("moe_tpu_decode", p.gate)
    check_decode_rows("moe_tpu_decode", p)
    T, H, E, I, _ = p.dims
    dtype = compute_dtype(p.gate)  # bf16 for quantized weights
    quant = quant_pair(p.gate, p.down)
    bs = block_sizes or TpuDecodeBlockSizes.default(H, I, dtype, device_kind, quant)
    bs.check(H, I, quant)

    union_ids, n_union, slot_position = union_of_experts(p.indices, E)
    fused = bs.fused_block_i is not None  # one kernel, contraction over the whole H
    x8 = reorder_for(quant and quant[0], jnp.pad(p.x, ((0, _ROWS - T), (0, 0))), H if fused else bs.block_h)  # [8, H]
    if p.in_scale is None:
        row_scale, x8 = None, x8.astype(dtype)
    else:  # a row that picks an expert in two slots is scaled by their summed scales (as the models do)
        row_scale = jnp.pad(union_row_scale(p, slot_position), ((0, 0), (0, _ROWS - T)))[..., None]  # [M, 8, 1]
    tables = (union_ids, n_union.reshape(1))
    biases = () if p.gate_bias is None else tuple(b[:, None] for b in p.biases)  # [E, 1, I] x 2, [E, 1, H]
    run = dict(scales_by_tile=True, interpret=interpret)
    y = tile_ffn(x8[None], row_scale, p, biases, tables, quant, dtype, bs, name="moe_tpu_decode", **run)  # [M, 8, H]
    per_slot = y[slot_position, jnp.arange(T)[:, None]]  # [T, K, H]
    return combine_slots(per_slot, p.indices, p.weights, E)


moe_tpu_decode_reference = moe_reference(moe_tpu_decode)
