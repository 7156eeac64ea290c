"""The expert FFN of a tile table in one Mosaic TPU kernel: gate/up, the activation and down fused, h kept in VMEM.

The fused alternative to tpu_tiles.py's two kernels, for layers whose whole-H tiles fit VMEM
(`tpu_tiles.fused_block_i`; `TpuTileBlockSizes.fused_block_i` asks for it).
Grid `(tiles t, I blocks i)`: at (t, i) the kernel holds the tile's rows `[tm, H]` (copied once per tile), the
column block i of gate and up `[H, bi]` and the row block i of down `[bi, H]` of expert `tile_expert[t]` (the next
step's copied while this one multiplies), and computes

    h = act(rows @ gate[:, i] + b_g, rows @ up[:, i] + b_u)        [tm, bi] float32 -> the multiply dtype
    y += h @ down[i, :]                                             [tm, H] float32 accumulator in VMEM

storing y (+ the down bias) on the last i step: h never leaves VMEM. Tiles past `n_tiles` map every block index
to the last real tile's last step and compute nothing (as in tpu_tiles.py). A partial last I block (dense weights)
is masked in the down product. Quantized weights are dequantized in VMEM (tpu_quant.py); 4-bit down weights take
h's columns as [even | odd] within the block: h is permuted in VMEM by an exact 0/1 matmul (one nonzero per column).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_tiles
from pallas_kernels.quantized_weights import QuantizedWeight
from pallas_kernels.tpu_quant import TpuQuant, block_shapes, reorder_for
from pallas_kernels.tpu_tiles import each_step, interpret_params, real_tile, weight_dot, weight_parts

Array = jax.Array


def _even_odd(h: Array) -> Array:
    """h's columns `[tm, b]` reordered to [even | odd] by a 0/1 matmul (exact: one nonzero per output column)."""
    b = h.shape[1]
    src = jax.lax.broadcasted_iota(jnp.int32, (b, b), 1)
    src = jnp.where(src < b // 2, 2 * src, 2 * (src - b // 2) + 1)  # the column of h each output column takes
    perm = (jax.lax.broadcasted_iota(jnp.int32, (b, b), 0) == src).astype(h.dtype)
    return jnp.dot(h, perm, preferred_element_type=jnp.float32).astype(h.dtype)


def _fused_kernel(expert_ref, n_ref, x_ref, *rest, act, n_i, rem, scaled, bias, parts, quant, h_dtype):
    scale_ref, rest = (rest[0], rest[1:]) if scaled else (None, rest)
    p_gu, p_d = parts
    gate_refs, up_refs, down_refs = rest[:p_gu], rest[p_gu : 2 * p_gu], rest[2 * p_gu : 2 * p_gu + p_d]
    rest = rest[2 * p_gu + p_d :]
    (gate_bias_ref, up_bias_ref, down_bias_ref), (y_ref, acc) = (rest[:3], rest[3:]) if bias else ((None,) * 3, rest)
    t, i = pl.program_id(0), pl.program_id(1)
    real = t < n_ref[0]

    @pl.when(real & (i == 0))
    def _zero():
        acc[...] = jnp.zeros_like(acc)

    def step(valid: int) -> None:
        rows = x_ref[...]  # [tm, H]
        if scaled:
            rows = (rows.astype(jnp.float32) * scale_ref[...]).astype(h_dtype)
        g = weight_dot(rows, gate_refs, quant[0], 0)  # [tm, bi]
        u = weight_dot(rows, up_refs, quant[0], 0)
        if bias:
            g = g + gate_bias_ref[...].astype(jnp.float32)
            u = u + up_bias_ref[...].astype(jnp.float32)
        h = act(g, u).astype(h_dtype)
        if quant[1] is not None and quant[1].packed:
            h = _even_odd(h)
        acc[...] += weight_dot(h, down_refs, quant[1], valid)

    each_step(real, i, n_i, rem, step)

    @pl.when(real & (i == n_i - 1))
    def _store():
        y = acc[...]
        if bias:
            y = y + down_bias_ref[...].astype(jnp.float32)
        y_ref[...] = y


def _specs(w, by_tile, shape_k: int, shape_n: int, n_i: int, *, columns: bool) -> list:
    """BlockSpecs of one weight's arrays at grid step (t, i): block i of its columns (`columns`: gate, up) or of
    its rows (down), of expert `tile_expert[t]` (or of tile t: FP8's expanded decode scales)."""

    def index(t, i, expert_ref, n_ref, *, tile: bool, whole: bool):
        tt, ii = real_tile(t, i, n_i, n_ref)
        first = tt if tile else expert_ref[tt]
        return (first, 0, 0) if whole else ((first, 0, ii) if columns else (first, ii, 0))

    quantized = isinstance(w, QuantizedWeight)
    shapes = block_shapes(TpuQuant.of(w), shape_k, shape_n) if quantized else [(shape_k, shape_n)]
    return [
        pl.BlockSpec((None, *shape), functools.partial(index, tile=tile, whole=shape == (1, 1)))
        for shape, tile in zip(shapes, by_tile, strict=True)
    ]


def fused_ffn(x, row_scale, gate, up, down, biases, tables, act, h_dtype, block_i, vmem_limit_bytes, **options):
    """`y [tiles, tm, H]` float32: the tile table's expert FFN in one kernel (module docstring).

    x, row_scale, tables as for `tpu_tiles.gate_up` (4-bit gate/up: x reordered over the whole H); biases: `()` or
    `(gate_bias [E, 1, I], up_bias [E, 1, I], down_bias [E, 1, H])`; options: `scales_by_tile`, `interpret`,
    `name`.
    """
    tile_expert, n_tiles = tables
    M, tm, (_, H, I) = tile_expert.shape[0], x.shape[1], gate.shape
    n_i = pl.cdiv(I, block_i)
    quant = tuple(TpuQuant.of(w) if isinstance(w, QuantizedWeight) else None for w in (gate, down))
    slot_experts = tile_expert if options["scales_by_tile"] else None
    (g_arrays, g_tile), (u_arrays, _), (d_arrays, d_tile) = (weight_parts(w, slot_experts) for w in (gate, up, down))
    gu_specs = _specs(gate, g_tile, H, block_i, n_i, columns=True)
    d_specs = _specs(down, d_tile, block_i, H, n_i, columns=False)
    per_tile = lambda t, i, e, n: (real_tile(t, i, n_i, n)[0], 0, 0)
    expert_col = lambda t, i, e, n: (e[real_tile(t, i, n_i, n)[0]], 0, real_tile(t, i, n_i, n)[1])
    expert_row = lambda t, i, e, n: (e[real_tile(t, i, n_i, n)[0]], 0, 0)
    shared = x.shape[0] == 1
    in_specs = [
        pl.BlockSpec((None, tm, H), (lambda t, i, e, n: (0, 0, 0)) if shared else per_tile),
        *([pl.BlockSpec((None, tm, 1), per_tile)] if row_scale is not None else []),
        *gu_specs,
        *gu_specs,
        *d_specs,
        *(
            [pl.BlockSpec((None, 1, block_i), expert_col)] * 2 + [pl.BlockSpec((None, 1, H), expert_row)]
            if biases
            else []
        ),
    ]
    kernel = functools.partial(
        _fused_kernel,
        act=act,
        n_i=n_i,
        rem=I % block_i,
        scaled=row_scale is not None,
        bias=bool(biases),
        parts=(len(g_arrays), len(d_arrays)),
        quant=quant,
        h_dtype=h_dtype,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, tm, H), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(M, n_i),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, tm, H), per_tile),
            scratch_shapes=[pltpu.VMEM((tm, H), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret_params(options["interpret"]),
        name=options["name"],
    )
    scale = [] if row_scale is None else [row_scale]
    return call(tile_expert, n_tiles, x, *scale, *g_arrays, *u_arrays, *d_arrays, *biases)


__all__ = ["fused_ffn"]


def tile_ffn(x, row_scale, p, biases, tables, quant, h_dtype, bs, *, name: str, **options) -> Array:
    """`y [tiles, tm, H]` float32: the expert FFN of a tile table, the one sequence of the decode and grouped
    kernels: `fused_ffn` when `bs.fused_block_i` is set, else tpu_tiles' gate/up kernel, h reordered for 4-bit down
    weights, and its down kernel.

    x, row_scale, biases, tables as for `fused_ffn`; p: the `MoEProblem` (gate, up, down, activation); quant: the
    (gate, down) `TpuQuant`s or None; bs: the tile block sizes (`TpuTileBlockSizes` or `TpuDecodeBlockSizes`);
    name: the kernels' name prefix (`{name}_ffn`, `{name}_gate_up`, `{name}_down`); options: `scales_by_tile`,
    `interpret`.
    """
    if bs.fused_block_i is not None:
        weights = (p.gate, p.up, p.down, biases, tables, p.activation, h_dtype, bs.fused_block_i, bs.vmem_limit_bytes)
        return fused_ffn(x, row_scale, *weights, name=f"{name}_ffn", **options)
    gate_up = (p.gate, p.up, biases[:2], tables, p.activation, h_dtype, bs)
    h = tpu_tiles.gate_up(x, row_scale, *gate_up, name=f"{name}_gate_up", **options)  # [tiles, tm, I]
    h = reorder_for(quant and quant[1], h, bs.block_i_down)
    return tpu_tiles.down(h, p.down, biases[2:], tables, bs, name=f"{name}_down", **options)
