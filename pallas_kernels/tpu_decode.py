"""Union-of-experts decode on Mosaic TPU: T <= 8 rows, each union expert's weight tiles read once per step.

Lowering: **Mosaic TPU** (Pallas TPU: BlockSpec pipelines, HBM -> VMEM copies double-buffered by Pallas, MXU
dots with float32 accumulators in VMEM scratch). The TPU counterpart of `decode.py` (Mosaic GPU), same signature,
same reference (`moe_decode_reference`); `pallas_kernels.platform` lowers it where a program is built for TPU.

Decode is bound by weight reads: each expert chosen by any row must be read once, and applied to every row.

1. `union_of_experts` (decode.py): the distinct ids `union_ids[:n_union]`, and each slot's union position.
   Each union expert's row scales `row_scale [M, 8]` (Llama-4's input scales summed per row; 1 without them).
2. `_gate_up_kernel`, grid `(I blocks, M union slots, H blocks)`: at (i, u, k) the tiles `gate[e, k, i]`,
   `up[e, k, i]` of `e = union_ids[u]` are copied to VMEM (the next step's while this one multiplies) and
   multiplied by all 8 (padded) rows; the activation runs on the last k step -> `h [M, 8, I]`. Slots past
   `n_union` map to the last real expert's last tile: the block index does not change, so Pallas copies nothing,
   and the body skips them.
3. `_down_kernel`, grid `(H blocks, M, I blocks)`, likewise -> `y [M, 8, H]` float32.
4. Row t takes `y[position of its slot k, t]` and sums its slots with their weights in slot order.

Weights: bf16 or float32 (stacked `[E, H, I]` / `[E, I, H]`), or int8 `QuantizedWeight`s (groups of 128·j along
the contraction, or whole columns; zero points optional): each tile's codes are copied to VMEM as bytes and
dequantized there a group at a time to bf16 before the MXU (float32 accumulation). Float16 and the other
quantized kinds raise `NotImplementedError` (the Mosaic GPU kernels serve them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode import check_decode_rows, union_of_experts, union_row_scale
from pallas_kernels.moe_op import MoEProblem, combine_slots, compute_dtype, moe_op, moe_reference
from pallas_kernels.quantized_weights import QuantizedWeight

Array = jax.Array

TPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_ROWS = 8  # rows of every tile: T padded to one sublane group
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


def check_tpu_weights(name: str, gate: Any, *, int8: bool = False) -> None:
    """`NotImplementedError` for weights the TPU kernels do not read: float16; quantized kinds other than int8
    (where `int8`) with groups of 128·j or whole columns."""
    if isinstance(gate, QuantizedWeight):
        H = gate.shape[1]
        if not int8 or gate.kind != "int8" or (gate.group % 128 and gate.group != H):
            raise NotImplementedError(f"{name}: reads bf16/float32 or int8 (groups of 128·j) weights, got {gate.kind}")
    elif jnp.dtype(gate.dtype) not in TPU_DTYPES:
        raise NotImplementedError(f"{name}: reads bf16/float32 weights, got {gate.dtype}")


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


@dataclasses.dataclass(frozen=True)
class TpuDecodeBlockSizes:
    """Tiles of the two decode kernels: gate/up `[block_h, block_i]`, down `[block_i_down, block_h_down]`.

    Each must be a multiple of 128 dividing its dimension, or the whole dimension (Mosaic's block rule).
    """

    block_h: int
    block_i: int
    block_i_down: int
    block_h_down: int
    vmem_limit_bytes: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) <= 0:
                raise ValueError(f"TpuDecodeBlockSizes.{f.name} must be a positive int, got {getattr(self, f.name)!r}")

    @classmethod
    def default(
        cls, hidden: int, inter: int, dtype: Any, device_kind: str | None = None, groups: tuple[int, int] | None = None
    ) -> TpuDecodeBlockSizes:
        """Tiles as large as a quarter of the scoped VMEM allows for the double-buffered weight tiles (gate and
        up: two per step), output columns at most 512 wide: long contiguous HBM reads, few grid steps. `groups`:
        int8 weights' groups along H (gate/up) and I (down); contraction tiles then hold 8·j groups (the rows of
        the scale tile) or all."""
        limit = vmem_limit(device_kind)
        item = jnp.dtype(dtype).itemsize
        step_h, step_i = (128, 128) if groups is None else (math.lcm(128, 8 * g) for g in groups)
        dense = groups is None  # int8 tiles hold whole groups: no partial blocks
        block_i = block_along(inter, 512, partial=dense)
        block_h = block_along(hidden, max(step_h, limit // 4 // (2 * 2 * block_i * item)), step_h, partial=dense)
        block_h_down = block_along(hidden, 512, partial=dense)
        block_i_down = block_along(inter, max(step_i, limit // 4 // (2 * block_h_down * item)), step_i, partial=dense)
        return cls(block_h, block_i, block_i_down, block_h_down, limit)

    def check(self, hidden: int, inter: int, groups: tuple[int, int] | None = None) -> None:
        """`ValueError` unless every tile is its whole dimension or a multiple of 128 (a last partial block is
        masked), and, with int8 `groups`, divides its dimension in whole groups, 8·j of them or all."""
        group_h, group_i = groups or (None, None)
        for name, b, dim in (
            ("block_h", self.block_h, hidden),
            ("block_i", self.block_i, inter),
            ("block_i_down", self.block_i_down, inter),
            ("block_h_down", self.block_h_down, hidden),
        ):
            if b != dim and (b % 128 or b > dim or (groups and dim % b)):
                raise ValueError(f"TpuDecodeBlockSizes.{name}={b} must be {dim} or a multiple of 128 below it")
        for name, b, dim, group in (
            ("block_h", self.block_h, hidden, group_h),
            ("block_i_down", self.block_i_down, inter, group_i),
        ):
            if group and (b % group or (b != dim and (b // group) % 8)):
                raise ValueError(f"TpuDecodeBlockSizes.{name}={b} must hold 8·j int8 groups of {group}, or all")


def _weight_index(u, k, n_k, union_ref, n_ref):
    # Slots past n_union: the last real (expert, k) tile, so the block index repeats and nothing is copied.
    real = u < n_ref[0]
    last = jnp.maximum(n_ref[0] - 1, 0)
    return union_ref[jnp.where(real, u, last)], jnp.where(real, k, n_k - 1)


def _weight_dot(rows: Array, refs: tuple, group: int, valid: int = 0) -> Array:
    """`rows @ W` float32 for one weight tile: dense `(w_ref,)`, or int8 `(codes_ref, scale_ref[, zero_ref])`
    dequantized a group of rows at a time (`(code - 128 - zero) · scale`, rounded to bf16 as the reference does),
    each group's product accumulated in float32. `valid` > 0: the last, partial block of the contraction, whose
    elements from `valid` on lie past the array (whatever VMEM held, NaN included): zeroed on both sides."""
    if len(refs) == 1:
        w = refs[0][...]
        if valid:
            rows = jnp.where(jax.lax.broadcasted_iota(jnp.int32, rows.shape, 1) < valid, rows, 0)
            w = jnp.where(jax.lax.broadcasted_iota(jnp.int32, w.shape, 0) < valid, w, 0)
        return jnp.dot(rows, w, preferred_element_type=jnp.float32)
    codes_ref, scale_ref, *zero_ref = refs
    acc = None
    for j in range(codes_ref.shape[0] // group):
        offset = 128.0 if not zero_ref else zero_ref[0][j : j + 1, :].astype(jnp.float32) + 128.0
        codes = codes_ref[j * group : (j + 1) * group, :].astype(jnp.int32).astype(jnp.float32)
        w = ((codes - offset) * scale_ref[j : j + 1, :]).astype(jnp.bfloat16)
        part = jnp.dot(rows[:, j * group : (j + 1) * group], w, preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    return acc


def _each_step(real, k, n_k: int, rem: int, accumulate) -> None:
    """`accumulate(0)` on every real step; where the contraction's last block is partial (`rem` > 0 elements
    valid), `accumulate(rem)` on that one (its masking costs VPU work the other steps skip)."""
    if not rem:
        pl.when(real)(lambda: accumulate(0))
        return
    pl.when(real & (k < n_k - 1))(lambda: accumulate(0))
    pl.when(real & (k == n_k - 1))(lambda: accumulate(rem))


def _gate_up_kernel(union_ref, n_ref, x_ref, scale_ref, *rest, act, n_k, rem, bias, parts, group):
    gate_refs, up_refs, rest = rest[:parts], rest[parts : 2 * parts], rest[2 * parts :]
    if bias:
        gate_bias_ref, up_bias_ref, h_ref, g_acc, u_acc = rest
    else:
        h_ref, g_acc, u_acc = rest
    u, k = pl.program_id(1), pl.program_id(2)
    real = u < n_ref[0]

    @pl.when(real & (k == 0))
    def _zero():
        g_acc[...] = jnp.zeros_like(g_acc)
        u_acc[...] = jnp.zeros_like(u_acc)

    def accumulate(valid: int) -> None:
        # The union expert's rows: x scaled by its summed input scales, in the weight dtype (as the reference).
        rows = (x_ref[...].astype(jnp.float32) * scale_ref[...]).astype(h_ref.dtype)  # [8, bh]
        g_acc[...] += _weight_dot(rows, gate_refs, group, valid)
        u_acc[...] += _weight_dot(rows, up_refs, group, valid)

    _each_step(real, k, n_k, rem, accumulate)

    @pl.when(real & (k == n_k - 1))
    def _activation():
        g, up = g_acc[...], u_acc[...]
        if bias:
            g = g + gate_bias_ref[...].astype(jnp.float32)
            up = up + up_bias_ref[...].astype(jnp.float32)
        h_ref[...] = act(g, up).astype(h_ref.dtype)


def _down_kernel(union_ref, n_ref, h_ref, *rest, n_k, rem, bias, parts, group):
    down_refs, rest = rest[:parts], rest[parts:]
    if bias:
        down_bias_ref, y_ref, acc = rest
    else:
        y_ref, acc = rest
    u, k = pl.program_id(1), pl.program_id(2)
    real = u < n_ref[0]

    @pl.when(real & (k == 0))
    def _zero():
        acc[...] = jnp.zeros_like(acc)

    def accumulate(valid: int) -> None:
        acc[...] += _weight_dot(h_ref[...], down_refs, group, valid)

    _each_step(real, k, n_k, rem, accumulate)

    @pl.when(real & (k == n_k - 1))
    def _store():
        y = acc[...]
        if bias:
            y = y + down_bias_ref[...].astype(jnp.float32)
        y_ref[...] = y


def interpret_params(interpret: bool) -> Any:
    """What `pallas_call(interpret=...)` takes: False compiled (Mosaic TPU), the TPU interpreter's parameters
    interpreted (Pallas's TPU interpret mode: simulated VMEM, DMAs and semaphores on CPU)."""
    return pltpu.InterpretParams() if interpret else False


def _weight_parts(w) -> tuple[Array, ...]:
    """The arrays of one weight the kernels read: `(w,)`, or int8 `(codes, scale[, zero])`."""
    if isinstance(w, QuantizedWeight):
        return (w.codes, w.scale) + (() if w.zero is None else (w.zero,))
    return (w,)


def _weight_specs(w, block_k: int, block_n: int, n_k: int, n_bias: int) -> tuple[list, list]:
    """BlockSpecs of `_weight_parts(w)` at grid step (j, u, k): the `[block_k, block_n]` tile (k, j) of union
    expert u (`_weight_index`), int8 scales (and zeros) `[block_k / group, block_n]` at the same block index; and
    of `n_bias` bias rows `[1, block_n]` (column block j)."""

    def w_map(j, u, k, union_ref, n_ref):
        e, kk = _weight_index(u, k, n_k, union_ref, n_ref)
        return e, kk, j

    def bias_map(j, u, k, union_ref, n_ref):
        return _weight_index(u, k, n_k, union_ref, n_ref)[0], 0, j

    specs = [pl.BlockSpec((None, block_k, block_n), w_map)]
    if isinstance(w, QuantizedWeight):
        scale = pl.BlockSpec((None, block_k // w.group, block_n), w_map)
        specs += [scale] * (len(_weight_parts(w)) - 1)
    return specs, [pl.BlockSpec((None, 1, block_n), bias_map)] * n_bias


def _union_call(kernel, out_shape, grid, in_specs: list, block_n: int, n_acc: int, bs, interpret: bool, name: str):
    """`pallas_call` over the grid `(column blocks, M union slots, contraction blocks)` (the union ids and their
    count prefetched as scalars): out `[M, 8, N]` in `[8, block_n]` blocks, `n_acc` float32 accumulators."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, _ROWS, block_n), lambda j, u, k, *_: (u, 0, j)),
            scratch_shapes=[pltpu.VMEM((_ROWS, block_n), jnp.float32)] * n_acc,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"), vmem_limit_bytes=bs.vmem_limit_bytes
        ),
        interpret=interpret_params(interpret),
        name=name,
    )


def _gate_up(x, scale, gate, up, biases, union_ids, n_union, act, bs, interpret):
    M, (_, H, I) = union_ids.shape[0], gate.shape
    n_k, n_i = pl.cdiv(H, bs.block_h), pl.cdiv(I, bs.block_i)
    weight_specs, bias_specs = _weight_specs(gate, bs.block_h, bs.block_i, n_k, len(biases))
    group = getattr(gate, "group", 0)
    kernel = functools.partial(
        _gate_up_kernel, act=act, n_k=n_k, rem=H % bs.block_h, bias=bool(biases), parts=len(weight_specs), group=group
    )
    in_specs = [
        pl.BlockSpec((_ROWS, bs.block_h), lambda i, u, k, *_: (0, k)),
        pl.BlockSpec((None, _ROWS, 1), lambda i, u, k, *_: (u, 0, 0)),
        *weight_specs,
        *weight_specs,
        *bias_specs,
    ]
    out_shape = jax.ShapeDtypeStruct((M, _ROWS, I), compute_dtype(gate))
    call = _union_call(
        kernel, out_shape, (n_i, M, n_k), in_specs, bs.block_i, 2, bs, interpret, "moe_tpu_decode_gate_up"
    )
    return call(union_ids, n_union, x, scale, *_weight_parts(gate), *_weight_parts(up), *biases)


def _down(h, down, bias, union_ids, n_union, bs, interpret):
    M, (_, I, H) = union_ids.shape[0], down.shape
    n_k, n_h = pl.cdiv(I, bs.block_i_down), pl.cdiv(H, bs.block_h_down)
    weight_specs, bias_specs = _weight_specs(down, bs.block_i_down, bs.block_h_down, n_k, len(bias))
    group = getattr(down, "group", 0)
    kernel = functools.partial(
        _down_kernel, n_k=n_k, rem=I % bs.block_i_down, bias=bool(bias), parts=len(weight_specs), group=group
    )
    in_specs = [pl.BlockSpec((None, _ROWS, bs.block_i_down), lambda j, u, k, *_: (u, 0, k)), *weight_specs, *bias_specs]
    out_shape = jax.ShapeDtypeStruct((M, _ROWS, H), jnp.float32)
    call = _union_call(
        kernel, out_shape, (n_h, M, n_k), in_specs, bs.block_h_down, 1, bs, interpret, "moe_tpu_decode_down"
    )
    return call(union_ids, n_union, h, *_weight_parts(down), *bias)


@moe_op
def moe_tpu_decode(
    p: MoEProblem,
    *,
    block_sizes: TpuDecodeBlockSizes | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> Array:
    """Routed experts for T <= 8 rows (`MoEProblem`) on Mosaic TPU, `[T, H]` float32.

    Weights bf16 or float32, or int8 `QuantizedWeight`s (groups of 128·j or whole columns).
    block_sizes: `TpuDecodeBlockSizes`, default `TpuDecodeBlockSizes.default(H, I, dtype, device_kind)`.
    device_kind: the TPU the program is compiled for (JAX's `device_kind`, e.g. "TPU v6 lite"): its VMEM sizes
      the tiles (`pallas_kernels.platform` passes it when lowering).
    interpret: run under Pallas's TPU interpreter (on CPU, for tests).
    """
    check_tpu_weights("moe_tpu_decode", p.gate, int8=True)
    check_decode_rows("moe_tpu_decode", p)
    T, H, E, I, _ = p.dims
    gate, down = p.gate, p.down
    groups = (gate.group, down.group) if isinstance(gate, QuantizedWeight) else None
    bs = block_sizes or TpuDecodeBlockSizes.default(H, I, gate.dtype, device_kind, groups)
    bs.check(H, I, groups)

    union_ids, n_union, slot_position = union_of_experts(p.indices, E)
    M = union_ids.shape[0]
    if p.in_scale is None:
        row_scale = jnp.ones((M, _ROWS, 1), jnp.float32)
    else:  # a row that picks an expert in two slots is scaled by their summed scales (as the models do)
        row_scale = jnp.pad(union_row_scale(p, slot_position), ((0, 0), (0, _ROWS - T)))[..., None]  # [M, 8, 1]
    x8 = jnp.pad(p.x, ((0, _ROWS - T), (0, 0)))  # [8, H]
    n = n_union.reshape(1)
    gu_bias = () if p.gate_bias is None else (p.gate_bias[:, None], p.up_bias[:, None])  # [E, 1, I]
    h = _gate_up(x8, row_scale, gate, p.up, gu_bias, union_ids, n, p.activation, bs, interpret)  # [M, 8, I]
    d_bias = () if p.down_bias is None else (p.down_bias[:, None],)  # [E, 1, H]
    y = _down(h, down, d_bias, union_ids, n, bs, interpret)  # [M, 8, H]
    per_slot = y[slot_position, jnp.arange(T)[:, None]]  # [T, K, H]
    return combine_slots(per_slot, p.indices, p.weights, E)


moe_tpu_decode_reference = moe_reference(moe_tpu_decode)
