"""Expert tiles on Mosaic TPU: the two kernels the TPU decode and the quantized grouped prefill share.

Lowering: **Mosaic TPU** (Pallas TPU: BlockSpec pipelines, HBM -> VMEM copies double-buffered by Pallas, MXU dots
with float32 accumulators in VMEM scratch). Both ops reduce to a *tile table*: tile t multiplies `tm` rows by the
weights of expert `tile_expert[t]`, and only the first `n_tiles` tiles are real (a device value).

* decode (tpu_decode.py): tile u = union expert u, every tile the same 8 (padded) rows, scaled per tile.
* grouped (tpu_grouped.py): tile t = `tm` consecutive rows of the expert-sorted, block-aligned pairs.

1. `gate_up`, grid `(I blocks j, tiles t, H blocks k)`: at (j, t, k) the tiles `gate[e, k, j]`, `up[e, k, j]` of
   `e = tile_expert[t]` are copied to VMEM (the next step's while this one multiplies) and multiplied by the tile's
   rows; the activation runs on the last k step -> `h [tiles, tm, I]`.
2. `down`, grid `(H blocks, tiles, I blocks)`, likewise -> `y [tiles, tm, H]` float32.

Tiles past `n_tiles` map every block index (weights, rows, output) to the last real tile's last step: the indices
do not change, so Pallas copies nothing and writes the last real block back unchanged, and the body skips them.

Weights: bf16 or float32 (a last partial block of the contraction is masked, one of the columns clipped), or
`QuantizedWeight`s of every kind, dequantized in VMEM (tpu_quant.py: whole groups per tile, bf16 MXU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_weights import QuantizedWeight
from pallas_kernels.tpu_quant import TpuQuant, block_shapes, quantized_dot, tile_arrays

Array = jax.Array

TPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_MiB = 1 << 20
# VMEM per TensorCore by `device_kind` (JAX's names); unknown kinds get 32 MiB.
VMEM_BYTES = {
    "TPU v4": 32 * _MiB,
    "TPU v5 lite": 128 * _MiB,
    "TPU v5e": 128 * _MiB,
    "TPU v5": 95 * _MiB,
    "TPU v5p": 95 * _MiB,
    "TPU v6 lite": 128 * _MiB,
    "TPU v6e": 128 * _MiB,
    "TPU7x": 64 * _MiB,
}
_DEFAULT_VMEM = 32 * _MiB


def vmem_limit(device_kind: str | None) -> int:
    """The scoped VMEM the kernels ask Mosaic for: half the chip's VMEM, at most 64 MiB (Mosaic checks it)."""
    return min(64 * _MiB, VMEM_BYTES.get(device_kind or "", _DEFAULT_VMEM) // 2)


def interpret_params(interpret: bool) -> Any:
    """What `pallas_call(interpret=...)` takes: False compiled (Mosaic TPU), the TPU interpreter's parameters
    interpreted (Pallas's TPU interpret mode: simulated VMEM, DMAs and semaphores on CPU)."""
    return pltpu.InterpretParams() if interpret else False


def check_tpu_weights(name: str, gate: Any) -> None:
    """`NotImplementedError` for weights the tile kernels do not read: float16 (quantized kinds: all read)."""
    if not isinstance(gate, QuantizedWeight) and jnp.dtype(gate.dtype) not in TPU_DTYPES:
        raise NotImplementedError(f"{name}: reads bf16/float32 or quantized weights, got {gate.dtype}")


def quant_pair(gate: Any, down: Any) -> tuple[TpuQuant, TpuQuant] | None:
    """The static descriptions of the gate/up and down projections, or None for dense weights."""
    return (TpuQuant.of(gate), TpuQuant.of(down)) if isinstance(gate, QuantizedWeight) else None


def block_along(dim: int, limit: int, step: int = 128, *, partial: bool = False) -> int:
    """The largest multiple of `step` (128: Mosaic's lane tiling) dividing `dim` and at most `limit`; where none
    divides, with `partial`, the largest multiple of 128 at most `limit` (the last block then runs past `dim`:
    gpt-oss's 2880 = 22.5·128), else `dim` whole."""
    for b in range(min(dim, limit) // step * step, 0, -step):
        if dim % b == 0:
            return b
    if partial and dim > 128:
        return max(128, min(dim, limit) // 128 * 128)
    return dim


def _weight_bytes(q: TpuQuant | None, k: int, n: int, itemsize: int) -> float:
    """HBM/VMEM bytes of one `[k, n]` weight tile (codes and scale rows)."""
    if q is None:
        return k * n * itemsize
    return k * n * q.code_bytes + -(-k // q.group) * n * q.scale_itemsize * (1 + q.has_zero)


def fused_block_i(
    hidden: int, inter: int, rows: int, itemsize: int, quant: tuple[TpuQuant, TpuQuant] | None, vmem_bytes: int
) -> int | None:
    """The widest I block (at most 512 or one quantized step; quantized: whole down groups dividing I), else the
    whole I, for which the fused kernel's VMEM (double-buffered gate, up and down tiles and rows, the `[rows, H]`
    accumulator and output, one decoded chunk, 4-bit: h's permutation) stays within half of `vmem_bytes`; None
    where none does (then the two kernels of tpu_tiles.py)."""
    q_gu, q_d = quant or (None, None)
    step = 128 if q_d is None else q_d.step
    fixed = 2 * rows * hidden * 2 + 3 * rows * hidden * 4 + 256 * hidden * 10
    for block in range(min(inter, max(512, step)) // step * step, 0, -step):
        if q_d is not None and inter % block:
            continue
        tiles = 2 * _weight_bytes(q_gu, hidden, block, itemsize) + _weight_bytes(q_d, block, hidden, itemsize)
        if 2 * tiles + fixed + 3 * rows * block * 4 + 2 * block * block <= vmem_bytes // 2:
            return block
    whole = 2 * _weight_bytes(q_gu, hidden, inter, itemsize) + _weight_bytes(q_d, inter, hidden, itemsize)
    if 2 * whole + fixed + 3 * rows * inter * 4 + (2 * inter * inter if q_d is not None else 0) <= vmem_bytes // 2:
        return inter
    return None


@dataclasses.dataclass(frozen=True)
class TpuTileBlockSizes:
    """Tiles of the two tile kernels: gate/up `[block_h, block_i]`, down `[block_i_down, block_h_down]`, and the
    scoped VMEM Mosaic gets. Each a multiple of 128 or the whole dimension (Mosaic's block rule); quantized
    contraction tiles hold whole groups (`TpuQuant.step`)."""

    block_h: int
    block_i: int
    block_i_down: int
    block_h_down: int
    vmem_limit_bytes: int
    fused_block_i: int | None = None  # set: the fused kernel (tpu_fused.py) over I blocks of this width

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "fused_block_i" and self.fused_block_i is None:
                continue
            if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) <= 0:
                raise ValueError(
                    f"{type(self).__name__}.{f.name} must be a positive int, got {getattr(self, f.name)!r}"
                )

    @classmethod
    def default(
        cls,
        hidden: int,
        inter: int,
        dtype: Any,
        device_kind: str | None = None,
        quant: tuple[TpuQuant, TpuQuant] | None = None,
        rows: int = 8,
        fused: bool = False,
    ) -> TpuTileBlockSizes:
        """Tiles as large as a quarter of the scoped VMEM allows for the double-buffered weight tiles (gate and
        up: two per step) and `rows` activation rows, output columns at most 512 wide: long contiguous HBM reads,
        few grid steps. `quant`: the quantized projections (gate/up, down); contraction tiles then hold whole
        groups (`TpuQuant.step`) and divide their dimension. `fused`: the fused kernel's I block where its tiles
        fit VMEM (`fused_block_i`), else the two kernels."""
        limit = vmem_limit(device_kind)
        budget = limit // 4
        if quant is None:
            item_gu = item_d = jnp.dtype(dtype).itemsize
            step_h = step_i = 128
        else:
            item_gu, item_d = quant[0].code_bytes, quant[1].code_bytes
            step_h, step_i = quant[0].step, quant[1].step
        dense = quant is None  # quantized contraction tiles are never partial; columns may be
        block_i = block_along(inter, 512, partial=True)
        per_h = 2 * 2 * block_i * item_gu + 2 * rows * 2  # bytes per contraction row: 2 weights x 2 buffers, x
        block_h = block_along(hidden, max(step_h, int(budget // per_h)), step_h, partial=dense)
        block_h_down = block_along(hidden, 512, partial=True)
        per_i = 2 * block_h_down * item_d + 2 * rows * 2
        block_i_down = block_along(inter, max(step_i, int(budget // per_i)), step_i, partial=dense)
        fused_i = fused_block_i(hidden, inter, rows, jnp.dtype(dtype).itemsize, quant, limit) if fused else None
        return cls(block_h, block_i, block_i_down, block_h_down, limit, fused_i)

    def check(self, hidden: int, inter: int, quant: tuple[TpuQuant, TpuQuant] | None = None) -> None:
        """`ValueError` unless every tile is its whole dimension or a multiple of 128 below it (a last partial
        block is masked); with `quant`, `NotImplementedError` unless the contraction tiles hold whole groups and
        divide their dimension."""
        for name, b, dim in (
            ("block_h", self.block_h, hidden),
            ("block_i", self.block_i, inter),
            ("block_i_down", self.block_i_down, inter),
            ("block_h_down", self.block_h_down, hidden),
        ):
            if b != dim and (b % 128 or b > dim):
                raise ValueError(f"{type(self).__name__}.{name}={b} must be {dim} or a multiple of 128 below it")
        if quant is not None:
            quant[0].check(f"{type(self).__name__}.block_h", hidden, self.block_h)
            quant[1].check(f"{type(self).__name__}.block_i_down", inter, self.block_i_down)
        b = self.fused_block_i
        if b is not None and b != inter and (b % 128 or b > inter):
            raise ValueError(f"{type(self).__name__}.fused_block_i={b} must be {inter} or a multiple of 128 below it")
        if b is not None and quant is not None:
            quant[1].check(f"{type(self).__name__}.fused_block_i", inter, b)


def real_tile(t, k, n_k, n_ref):
    """(t, k), or for tiles past n_tiles the last real tile's last step (its block indices: nothing copied)."""
    real = t < n_ref[0]
    return jnp.where(real, t, jnp.maximum(n_ref[0] - 1, 0)), jnp.where(real, k, n_k - 1)


def _dense_dot(rows: Array, w_ref, valid: int) -> Array:
    """`rows @ W` float32 for a dense tile. `valid` > 0: the contraction's last, partial block, whose elements
    from `valid` on lie past the array (whatever VMEM held, NaN included): zeroed on both sides."""
    w = w_ref[...]
    if valid:
        rows = jnp.where(jax.lax.broadcasted_iota(jnp.int32, rows.shape, 1) < valid, rows, 0)
        w = jnp.where(jax.lax.broadcasted_iota(jnp.int32, w.shape, 0) < valid, w, 0)
    return jnp.dot(rows, w, preferred_element_type=jnp.float32)


def weight_dot(rows: Array, refs: tuple, quant: TpuQuant | None, valid: int) -> Array:
    return _dense_dot(rows, refs[0], valid) if quant is None else quantized_dot(rows, quant, refs)


def each_step(real, k, n_k: int, rem: int, accumulate) -> None:
    """`accumulate(0)` on every real step; where the contraction's last block is partial (`rem` > 0 elements
    valid), `accumulate(rem)` on that one (its masking costs VPU work the other steps skip)."""
    if not rem:
        pl.when(real)(lambda: accumulate(0))
        return
    pl.when(real & (k < n_k - 1))(lambda: accumulate(0))
    pl.when(real & (k == n_k - 1))(lambda: accumulate(rem))


def _gate_up_kernel(expert_ref, n_ref, x_ref, *rest, act, n_k, rem, scaled, bias, parts, quant):
    scale_ref, rest = (rest[0], rest[1:]) if scaled else (None, rest)
    gate_refs, up_refs, rest = rest[:parts], rest[parts : 2 * parts], rest[2 * parts :]
    gate_bias_ref, up_bias_ref, (h_ref, g_acc, u_acc) = (*rest[:2], rest[2:]) if bias else (None, None, rest)
    t, k = pl.program_id(1), pl.program_id(2)
    real = t < n_ref[0]

    @pl.when(real & (k == 0))
    def _zero():
        g_acc[...] = jnp.zeros_like(g_acc)
        u_acc[...] = jnp.zeros_like(u_acc)

    def accumulate(valid: int) -> None:
        rows = x_ref[...]  # [tm, bh], in the multiply dtype unless scaled per tile
        if scaled:  # a union expert's rows: x scaled by its summed input scales, rounded as the reference does
            rows = (rows.astype(jnp.float32) * scale_ref[...]).astype(h_ref.dtype)
        g_acc[...] += weight_dot(rows, gate_refs, quant, valid)
        u_acc[...] += weight_dot(rows, up_refs, quant, valid)

    each_step(real, k, n_k, rem, accumulate)

    @pl.when(real & (k == n_k - 1))
    def _activation():
        g, up = g_acc[...], u_acc[...]
        if bias:
            g = g + gate_bias_ref[...].astype(jnp.float32)
            up = up + up_bias_ref[...].astype(jnp.float32)
        h_ref[...] = act(g, up).astype(h_ref.dtype)


def _down_kernel(expert_ref, n_ref, h_ref, *rest, n_k, rem, bias, parts, quant):
    down_refs, rest = rest[:parts], rest[parts:]
    down_bias_ref, (y_ref, acc) = (rest[0], rest[1:]) if bias else (None, rest)
    t, k = pl.program_id(1), pl.program_id(2)
    real = t < n_ref[0]

    @pl.when(real & (k == 0))
    def _zero():
        acc[...] = jnp.zeros_like(acc)

    def accumulate(valid: int) -> None:
        acc[...] += weight_dot(h_ref[...], down_refs, quant, valid)

    each_step(real, k, n_k, rem, accumulate)

    @pl.when(real & (k == n_k - 1))
    def _store():
        y = acc[...]
        if bias:
            y = y + down_bias_ref[...].astype(jnp.float32)
        y_ref[...] = y


def weight_parts(w, slot_experts: Array | None) -> tuple[tuple[Array, ...], tuple[bool, ...]]:
    """The arrays of one weight the kernels read, and whether each is indexed by tile (else by expert)."""
    if isinstance(w, QuantizedWeight):
        return tile_arrays(w, slot_experts)
    return (w,), (False,)


def _weight_specs(w, by_tile: tuple[bool, ...], block_k: int, block_n: int, n_k: int) -> list:
    """BlockSpecs of one weight's arrays at grid step (j, t, k): the `[block_k, block_n]` tile (k, j) of expert
    `tile_expert[t]` (or of tile t itself: FP8's expanded scales in decode)."""

    def index(j, t, k, expert_ref, n_ref, *, tile: bool, whole: bool):
        tt, kk = real_tile(t, k, n_k, n_ref)
        first = tt if tile else expert_ref[tt]
        return (first, 0, 0) if whole else (first, kk, j)

    shapes = block_shapes(TpuQuant.of(w), block_k, block_n) if isinstance(w, QuantizedWeight) else [(block_k, block_n)]
    return [
        pl.BlockSpec((None, *shape), functools.partial(index, tile=tile, whole=shape == (1, 1)))
        for shape, tile in zip(shapes, by_tile, strict=True)
    ]


def _bias_specs(block_n: int, n_k: int, n_bias: int) -> list:
    """BlockSpecs of `n_bias` bias rows `[1, block_n]` (column block j of expert `tile_expert[t]`)."""

    def bias_map(j, t, k, expert_ref, n_ref):
        return expert_ref[real_tile(t, k, n_k, n_ref)[0]], 0, j

    return [pl.BlockSpec((None, 1, block_n), bias_map)] * n_bias


def _row_spec(shape: tuple[int, int], n_k: int, shared: bool) -> pl.BlockSpec:
    """The rows `[tm, block]` of tile t (or of every tile: `shared`) at contraction step k."""

    def index(j, t, k, expert_ref, n_ref):
        tt, kk = real_tile(t, k, n_k, n_ref)
        return (0 if shared else tt), 0, kk

    return pl.BlockSpec((None, *shape), index)


def _tile_call(kernel, out_shape, grid, in_specs: list, rows: int, block_n: int, n_acc: int, bs, interpret, name):
    """`pallas_call` over the grid `(column blocks, tiles, contraction blocks)` (the tile experts and their count
    prefetched as scalars): out `[tiles, rows, N]` in `[rows, block_n]` blocks, `n_acc` float32 accumulators."""
    n_k = grid[2]

    def out_map(j, t, k, expert_ref, n_ref):
        return real_tile(t, k, n_k, n_ref)[0], 0, j

    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, rows, block_n), out_map),
            scratch_shapes=[pltpu.VMEM((rows, block_n), jnp.float32)] * n_acc,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"), vmem_limit_bytes=bs.vmem_limit_bytes
        ),
        interpret=interpret_params(interpret),
        name=name,
    )


def gate_up(x, row_scale, gate, up, biases, tables, act, h_dtype, bs, *, scales_by_tile, interpret, name) -> Array:
    """`h [tiles, tm, I]` (`h_dtype`) = act(rows @ gate[e], rows @ up[e]) per tile (module docstring, step 1).

    x: `[1, tm, H]` rows shared by every tile, or `[tiles, tm, H]` one block per tile (4-bit: reordered by
    `tpu_quant.reorder_for`); row_scale: `[tiles, tm, 1]` float32 per-tile row scales (x then float32), or None;
    biases: `()` or gate/up biases `[E, 1, I]`; tables: `(tile_expert [tiles], n_tiles [1])` int32;
    scales_by_tile: FP8's expanded scales gathered per tile (few tiles: decode), else expanded for every expert.
    """
    tile_expert, n_tiles = tables
    M, tm, (_, H, I) = tile_expert.shape[0], x.shape[1], gate.shape
    n_k, n_i = pl.cdiv(H, bs.block_h), pl.cdiv(I, bs.block_i)
    quant = TpuQuant.of(gate) if isinstance(gate, QuantizedWeight) else None
    slot_experts = tile_expert if scales_by_tile else None
    gate_arrays, by_tile = weight_parts(gate, slot_experts)
    up_arrays, _ = weight_parts(up, slot_experts)
    specs = _weight_specs(gate, by_tile, bs.block_h, bs.block_i, n_k)
    scaled = row_scale is not None
    in_specs = [
        _row_spec((tm, bs.block_h), n_k, x.shape[0] == 1),
        *([pl.BlockSpec((None, tm, 1), lambda j, t, k, e, n: (real_tile(t, k, n_k, n)[0], 0, 0))] if scaled else []),
        *specs,
        *specs,
        *_bias_specs(bs.block_i, n_k, len(biases)),
    ]
    kernel = functools.partial(
        _gate_up_kernel,
        act=act,
        n_k=n_k,
        rem=H % bs.block_h,
        scaled=scaled,
        bias=bool(biases),
        parts=len(specs),
        quant=quant,
    )
    out_shape = jax.ShapeDtypeStruct((M, tm, I), h_dtype)
    call = _tile_call(kernel, out_shape, (n_i, M, n_k), in_specs, tm, bs.block_i, 2, bs, interpret, name)
    return call(tile_expert, n_tiles, x, *([row_scale] if scaled else []), *gate_arrays, *up_arrays, *biases)


def down(h, down_w, bias, tables, bs, *, scales_by_tile, interpret, name) -> Array:
    """`y [tiles, tm, H]` float32 = h @ down[e] per tile (step 2). h: `[tiles, tm, I]` (4-bit: reordered);
    bias: `()` or `[E, 1, H]`; scales_by_tile as for `gate_up`."""
    tile_expert, n_tiles = tables
    M, tm, (_, I, H) = tile_expert.shape[0], h.shape[1], down_w.shape
    n_k, n_h = pl.cdiv(I, bs.block_i_down), pl.cdiv(H, bs.block_h_down)
    quant = TpuQuant.of(down_w) if isinstance(down_w, QuantizedWeight) else None
    arrays, by_tile = weight_parts(down_w, tile_expert if scales_by_tile else None)
    specs = _weight_specs(down_w, by_tile, bs.block_i_down, bs.block_h_down, n_k)
    specs += _bias_specs(bs.block_h_down, n_k, len(bias))
    kernel = functools.partial(
        _down_kernel, n_k=n_k, rem=I % bs.block_i_down, bias=bool(bias), parts=len(arrays), quant=quant
    )
    in_specs = [_row_spec((tm, bs.block_i_down), n_k, False), *specs]
    out_shape = jax.ShapeDtypeStruct((M, tm, H), jnp.float32)
    call = _tile_call(kernel, out_shape, (n_h, M, n_k), in_specs, tm, bs.block_h_down, 1, bs, interpret, name)
    return call(tile_expert, n_tiles, h, *arrays, *bias)
