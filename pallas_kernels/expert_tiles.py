"""Expert tiles on Mosaic GPU: each work item multiplies one 64-row tile by one expert's weights.

Lowering: **Mosaic GPU** (`plgpu.kernel`, warpgroup semantics, `plgpu.wgmma` fed by a TMA pipeline,
`plgpu.emit_pipeline`), the path JAX recommends for Hopper. Both MoE plans reduce to the same two kernels
over a *tile table* built on device by the caller, so the kernel bodies live here once:

* `moe_decode` (decode.py): tile u = union expert u; every tile reads the same padded rows (T <= 8 real rows
  of 64: decode is bound by weight bytes, so the unused rows of the 64-row wgmma cost no time).
* `moe_grouped` (grouped.py): tile t = 64 consecutive rows of the expert-sorted, block-aligned pairs.

Kernels (a persistent grid of `num_programs` CTAs; `plgpu.nd_loop` hands out work items `(tile, column
block)` round-robin, and its trip count `num_tiles · column blocks` is read on device, so no program exists for
a tile that has no rows):

1. `gate_up_tiles`: `h[tile] = act(x[tile_block[tile]] @ gate[e], x[...] @ up[e])`, e = `tile_expert[tile]`,
   two float32 wgmma accumulators over the hidden axis, the gated activation in the epilogue, `h` stored in the
   weight dtype (what a bf16 model feeds the down projection).
2. `down_tiles`: `y[tile] = h[tile] @ down[e]`, float32, of which the first `rows_out` rows are stored.

Shapes must be multiples of the blocks (the callers pad); the row tile is fixed at 64, one warpgroup's wgmma.
wgmma reads float32 operands as TF32 and only K-major, so float32 weights are transposed by the wrapper and
the kernel multiplies by the transposed shared-memory view; this is a compatibility path (it copies the weights
per call and rounds to TF32 on a GPU), bf16/f16 are the fast path. GPU interpret mode on CPU
(`InterpretGPUParams`, private API in jax 0.10/0.11, used only in `pallas_kernels.platform`) does not
implement the transposed view, so under interpretation float32 runs the untransposed body (exact float32).

Quantized weights (`QuantizedWeight`, quantized_weights.py: int8/int4, FP8 128x128 blocks, MXFP4, NVFP4) run
`_gate_up_quant_kernel` / `_down_quant_kernel`: the same work items and epilogues, but each pipeline step stages
the codes (uint8 / e4m3, 64 rows x 64 columns) and their scale rows in shared memory by TMA; the warpgroup loads
the codes into registers, dequantizes them with float32 scales, rounds to bf16 and stores a bf16 tile to shared
memory, which the wgmma reads with the bf16 activation tile (`_quantized_step`). 4-bit codes give two tiles (even
and odd contraction elements), multiplied with the two halves of an activation block whose columns the wrapper
reordered. The bf16 tiles are single-buffered: the decode of step k overlaps step k-1's wgmmas, the store waits
for them (NVFP4, 8 scale rows a step: waits first, decodes one tile at a time, else it spills).

`interpret=None` (the default of every public op) leaves the choice to the platform the program is lowered for:
compiled for CUDA, interpreted for CPU (`pallas_kernels.platform`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.activations import GatedActivation
from pallas_kernels.platform import interpret_by_platform, interpret_params
from pallas_kernels.quantized_weights import (
    COMPUTE_DTYPE,
    QuantizedWeight,
    check_quantized,
    dequantize_tile,
    dequantize_weight,
    pad_quantized,
    split_even_odd,
    tile_plan,
)

Array = jax.Array
Weight = Array | QuantizedWeight  # a stacked projection [E, in, out], dense or quantized

TILE_ROWS = 64  # rows of one wgmma warpgroup tile
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_H100_SMS = 132  # H100 SXM and H200: the default when no GPU can be asked (lowering from a CPU host)
_INTERPRET_PROGRAMS = 2


def require_activation(name: str, activation: object) -> None:
    """`TypeError` unless `activation` is a `GatedActivation` (which validated its fields when it was made)."""
    if not isinstance(activation, GatedActivation):
        raise TypeError(f"{name}: activation must be a pallas_kernels.GatedActivation, got {activation!r}")


def default_num_programs(interpret: bool) -> int:
    """Persistent CTAs: the GPU's SM count (132 when no GPU is visible, e.g. lowering on a CPU host)."""
    if interpret:
        return _INTERPRET_PROGRAMS
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return _H100_SMS
    return int(getattr(gpus[0], "core_count", 0) or _H100_SMS)


def largest_block(dim: int, choices: tuple[int, ...] = (128, 64)) -> int:
    """The largest block in `choices` that divides `dim` (the smallest when none does: the caller pads)."""
    return next((b for b in choices if dim % b == 0), choices[-1])


@dataclasses.dataclass(frozen=True)
class TileBlockSizes:
    """Blocks of one tile kernel: `block_n` output columns, `block_k` contraction, pipeline depth, CTAs."""

    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    num_programs: int = _H100_SMS

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "max_concurrent_steps", "num_programs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TileBlockSizes.{name}={value!r} must be a positive int")
        if self.block_n % 32 or self.block_n > 256:
            raise ValueError(f"TileBlockSizes.block_n={self.block_n} must be a multiple of 32 and <= 256 (wgmma N)")
        if self.block_k % 32:
            raise ValueError(f"TileBlockSizes.block_k={self.block_k} must be a multiple of 32 (a 128-byte row)")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"TileBlockSizes.max_concurrent_steps={self.max_concurrent_steps} must be >= 2")

    @classmethod
    def default(
        cls, n: int, k: int, dtype: Any, *, interpret: bool = False, block_n: int | None = None, packed: bool = False
    ) -> TileBlockSizes:
        """128-byte contraction rows (64 bf16, 32 float32); the largest of 128/64 output columns dividing n.
        `packed` (4-bit quantized weights): 128 contraction elements per step, i.e. 64 rows of packed bytes and
        two 64-column bf16 halves, the tile shapes of the 8-bit kinds."""
        block_k = 128 if packed else 128 // jnp.dtype(dtype).itemsize
        return cls(
            block_n=block_n or largest_block(n),
            block_k=block_k,
            max_concurrent_steps=max(2, min(4, k // block_k)),
            num_programs=default_num_programs(interpret),
        )


def quantized_tile_options(weight_kind: str | None) -> dict:
    """`TileBlockSizes.default` options for weights of `weight_kind` (None: dense, no options).

    Quantized: 64 output columns (with 128, the dequantized tiles and the float32 accumulators exceed 255
    registers a thread and spill, measured by tests/test_cuda_compile.py); 4-bit kinds step 128 contraction
    elements (`packed`).
    """
    if weight_kind is None:
        return {}
    return {"block_n": 64, "packed": weight_kind in ("int4", "mxfp4", "nvfp4")}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_experts(
    x: Array, gate: Weight, up: Weight, down: Weight, hidden: int, inter: int
) -> tuple[Array, Weight, Weight, Weight]:
    """Zero-pad x's H and the weights' H and I to `hidden`, `inter` (a no-op when already there).

    Zero columns of x and zero rows/columns of the weights add nothing: padded I columns give h = act(0, 0) = 0
    for every activation, and padded H columns of the output are cut by the caller. Padding copies the weights
    on every call: block sizes are chosen to divide real model shapes, so only awkward shapes pay it. Quantized
    weights pad their codes and scales with zeros (`pad_quantized`: padded weights dequantize to 0).
    """
    H, I = gate.shape[1], gate.shape[2]
    if (hidden, inter) == (H, I):
        return x, gate, up, down
    if isinstance(gate, QuantizedWeight):
        return (
            jnp.pad(x, ((0, 0), (0, hidden - H))),
            pad_quantized(gate, hidden, inter),
            pad_quantized(up, hidden, inter),
            pad_quantized(down, inter, hidden),
        )
    pad_w = ((0, 0), (0, hidden - H), (0, inter - I))
    return (
        jnp.pad(x, ((0, 0), (0, hidden - H))),
        jnp.pad(gate, pad_w),
        jnp.pad(up, pad_w),
        jnp.pad(down, ((0, 0), (0, inter - I), (0, hidden - H))),
    )


def pad_biases(
    biases: tuple[Array | None, Array | None, Array | None], hidden: int, inter: int
) -> tuple[Array | None, Array | None, Array | None]:
    """Zero-pad `(gate_bias [E, I], up_bias [E, I], down_bias [E, H])` like `pad_experts` pads the weights."""
    gate_bias, up_bias, down_bias = biases
    if gate_bias is None:
        return biases
    pad_i = ((0, 0), (0, inter - gate_bias.shape[1]))
    return (
        jnp.pad(gate_bias, pad_i),
        jnp.pad(up_bias, pad_i),
        jnp.pad(down_bias, ((0, 0), (0, hidden - down_bias.shape[1]))),
    )


def combine_slots(per_slot: Array, indices: Array, weights: Array, num_experts: int) -> Array:
    """`Σ_k w[t, k] · y[t, k]` `[T, K, H] -> [T, H]` float32, in slot order; slots of ids outside
    [0, num_experts) or with weight 0 contribute exactly 0 (their y may be unwritten memory)."""
    real = (indices >= 0) & (indices < num_experts)
    w = jnp.where(real, weights.astype(jnp.float32), 0.0)[..., None]
    return jnp.where(w != 0, w * per_slot, 0.0).sum(1)


def compute_dtype(w: Weight):
    """The dtype the matmuls multiply in: the weights' own (dense), bf16 (quantized: dequantized to bf16)."""
    return COMPUTE_DTYPE if isinstance(w, QuantizedWeight) else w.dtype


def check_moe_inputs(
    name: str,
    x: Array,
    gate: Weight,
    up: Weight,
    down: Weight,
    indices: Array,
    weights: Array,
    in_scale: Array | None,
    biases: tuple[Array | None, Array | None, Array | None] = (None, None, None),
) -> None:
    """Shape/dtype checks shared by the MoE ops: `ValueError` naming the argument and both shapes."""
    if x.ndim != 2 or gate.ndim != 3:
        raise ValueError(f"{name}: need x [T, H] and gate [E, H, I], got {x.shape=} {gate.shape=}")
    T, H = x.shape
    E, H2, I = gate.shape
    if H2 != H:
        raise ValueError(f"{name}: gate must be [E, H={H}, I], got {gate.shape=}")
    if up.shape != gate.shape or down.shape != (E, I, H):
        raise ValueError(f"{name}: need up {gate.shape} and down {(E, I, H)}, got {up.shape=} {down.shape=}")
    quantized = [isinstance(w, QuantizedWeight) for w in (gate, up, down)]
    if any(quantized):
        kinds = {getattr(w, "kind", None) for w in (gate, up, down)}
        if not all(quantized) or len(kinds) != 1:
            raise ValueError(f"{name}: gate, up, down must be all dense or all QuantizedWeights of one kind: {kinds}")
        for wname, w in (("gate", gate), ("up", up), ("down", down)):
            check_quantized(f"{name}: {wname}", w)
    elif not (gate.dtype == up.dtype == down.dtype) or gate.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: weights must share one of bf16/f16/f32, got {gate.dtype=} {up.dtype=} {down.dtype=}")
    if indices.ndim != 2 or indices.shape[0] != T or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"{name}: indices must be integers [T={T}, K], got {indices.shape=} {indices.dtype=}")
    if weights.shape != indices.shape:
        raise ValueError(f"{name}: weights must have indices' shape {indices.shape}, got {weights.shape=}")
    if in_scale is not None and in_scale.shape != indices.shape:
        raise ValueError(f"{name}: in_scale must have indices' shape {indices.shape}, got {in_scale.shape=}")
    shapes = [None if b is None else tuple(b.shape) for b in biases]
    if shapes != [None] * 3 and shapes != [(E, I), (E, I), (E, H)]:
        raise ValueError(
            f"{name}: gate_bias, up_bias, down_bias must all be None or {(E, I)}, {(E, I)}, {(E, H)}, got {shapes}"
        )


def dense_reference(
    x: Array,
    gate: Weight,
    up: Weight,
    down: Weight,
    indices: Array,
    weights: Array,
    in_scale: Array | None,
    *,
    activation: GatedActivation = GatedActivation(),  # noqa: B008 (frozen: an immutable default)
    gate_bias: Array | None = None,
    up_bias: Array | None = None,
    down_bias: Array | None = None,
) -> Array:
    """`Σ_k w[t,k] · E_idx[t,k](s[t,k] · x[t])` float32 `[T, H]`, one expert at a time over all rows (a scan:
    memory O(T·I) at any E). Matmuls take the weight dtype and accumulate in float32, h is rounded to the weight
    dtype before the down projection, ids outside [0, E) contribute nothing. Quantized weights: each expert
    dequantized to float32 when the scan reaches it and rounded to bf16 (what the kernels feed the wgmma)."""
    require_activation("dense_reference", activation)
    E = gate.shape[0]
    dtype = compute_dtype(gate)

    def expert_weight(w: Weight, e: Array) -> Array:
        if not isinstance(w, QuantizedWeight):
            return w[e]
        one = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, e, 1, 0), w)
        return dequantize_weight(one)[0].astype(dtype)

    chosen = jax.nn.one_hot(indices, E, dtype=jnp.float32)  # [T, K, E]; out-of-range ids have no column
    out_w = jnp.einsum("tk,tke->et", weights.astype(jnp.float32), chosen)  # [E, T]
    scale = None if in_scale is None else jnp.einsum("tk,tke->et", in_scale.astype(jnp.float32), chosen)
    selected = chosen.sum(1).T > 0  # [E, T]
    x32 = x.astype(jnp.float32)

    def one_expert(acc: Array, e: Array) -> tuple[Array, None]:
        xe = x32 if scale is None else x32 * scale[e][:, None]
        xw = xe.astype(dtype)
        g = jnp.dot(xw, expert_weight(gate, e), preferred_element_type=jnp.float32)
        u = jnp.dot(xw, expert_weight(up, e), preferred_element_type=jnp.float32)
        if gate_bias is not None:
            g = g + gate_bias[e].astype(jnp.float32)
            u = u + up_bias[e].astype(jnp.float32)
        h = activation(g, u)
        y = jnp.dot(h.astype(dtype), expert_weight(down, e), preferred_element_type=jnp.float32)  # [T, H]
        if down_bias is not None:
            y = y + down_bias[e].astype(jnp.float32)
        return acc + jnp.where(selected[e][:, None], out_w[e][:, None] * y, 0.0), None

    out, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), jnp.arange(E))
    return out


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


def _gate_up_kernel(
    tile_expert_ref,  # [N_tiles] int32 GMEM: expert of each tile
    tile_block_ref,  # [N_tiles] int32 GMEM: row block of x each tile reads
    num_tiles_ref,  # [1] int32 GMEM: tiles in use (a device value)
    x_ref,  # [R, H] GMEM
    gate_ref,  # [E, H, I] GMEM ([E, I, H] when transposed)
    up_ref,  # like gate_ref
    *refs,  # [gate_bias_ref, up_bias_ref ([E, I] float32 GMEM),] h_ref ([N_tiles * 64, I] GMEM out)
    block_sizes: TileBlockSizes,
    transposed: bool,
    act: GatedActivation,
):
    *bias_refs, h_ref = refs
    bs = block_sizes
    hidden = x_ref.shape[1]
    n_col = h_ref.shape[1] // bs.block_n

    # Work item w = (tile, column block), tiles outer: consecutive items (on neighbouring SMs) share the x tile
    # and the expert, so x and the expert's rows stay in L2. The trip count is a device value.
    @plgpu.nd_loop((num_tiles_ref[0] * n_col,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
        (w,) = info.index
        tile, col = w // n_col, w % n_col
        expert = tile_expert_ref[tile]
        row_block = tile_block_ref[tile]

        def accumulate(acc_gate, acc_up):
            def step(_, x_smem, gate_smem, up_smem):
                # Both wgmmas read the same x stage; they run asynchronously, delay_release=1 keeps each stage
                # alive one step longer so that no wait is needed here.
                if transposed:
                    gate_smem = plgpu.transpose_ref(gate_smem, (1, 0))
                    up_smem = plgpu.transpose_ref(up_smem, (1, 0))
                plgpu.wgmma(acc_gate, x_smem, gate_smem)
                plgpu.wgmma(acc_up, x_smem, up_smem)

            w_block = (bs.block_n, bs.block_k) if transposed else (bs.block_k, bs.block_n)
            w_index = (lambda k: (col, k)) if transposed else (lambda k: (k, col))
            plgpu.emit_pipeline(
                step,
                grid=(hidden // bs.block_k,),
                in_specs=[
                    plgpu.BlockSpec((TILE_ROWS, bs.block_k), lambda k: (row_block, k), delay_release=1),
                    plgpu.BlockSpec(w_block, w_index, delay_release=1),
                    plgpu.BlockSpec(w_block, w_index, delay_release=1),
                ],
                max_concurrent_steps=bs.max_concurrent_steps,
            )(x_ref, gate_ref.at[expert], up_ref.at[expert])
            return acc_gate[...], acc_up[...]

        gate, up = pl.run_scoped(accumulate, plgpu.ACC((TILE_ROWS, bs.block_n)), plgpu.ACC((TILE_ROWS, bs.block_n)))
        _gate_up_epilogue(gate, up, bias_refs, h_ref, expert, tile, col, bs.block_n, act)


def _gate_up_epilogue(gate, up, bias_refs, h_ref, expert, tile, col, block_n: int, act: GatedActivation) -> None:
    """Biases (gpt-oss: on the float32 accumulators, before the activation), the activation on the accumulator
    registers, and h's `[64, block_n]` tile stored through shared memory."""
    if bias_refs:
        gate, up = _add_column_bias([gate, up], bias_refs, expert, col, block_n)
    h = act(gate, up)

    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((TILE_ROWS, block_n), h_ref.dtype))
    def _store(out_smem):
        out_smem[...] = h.astype(out_smem.dtype)
        plgpu.commit_smem()
        rows = pl.ds(tile * TILE_ROWS, TILE_ROWS)
        plgpu.copy_smem_to_gmem(out_smem, h_ref.at[rows, pl.ds(col * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


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
    def of(cls, w: QuantizedWeight, bs: TileBlockSizes) -> _QuantOperand:
        code_rows, scale_rows = tile_plan(w, bs.block_k, bs.block_n)
        return cls(w.kind, w.zero is not None, w.scale2 is not None, w.group, code_rows, scale_rows)

    @property
    def halves(self) -> int:
        """bf16 tiles per step: 2 for 4-bit codes (even and odd `in` elements), else 1."""
        return 2 if self.kind in ("int4", "mxfp4", "nvfp4") else 1

    @property
    def num_refs(self) -> int:
        return 2 + self.has_zero + self.has_scale2

    def pipelined(self, refs, expert):
        """The refs the pipeline streams (this expert's codes, and its scale/zero rows unless fp8_block)."""
        codes, scale, *rest = refs
        if self.kind == "fp8_block":
            return [codes.at[expert]]
        return [codes.at[expert], scale.at[expert]] + ([rest[0].at[expert]] if self.has_zero else [])

    def in_specs(self, bs: TileBlockSizes, col) -> list:
        specs = [plgpu.BlockSpec((self.code_rows, bs.block_n), lambda k: (k, col))]
        if self.kind == "fp8_block":
            return specs
        index = lambda k: (k * bs.block_k // self.group if self.group >= bs.block_k else k, col)
        return specs + [plgpu.BlockSpec((self.scale_rows, bs.block_n), index)] * (1 + self.has_zero)

    @property
    def num_streams(self) -> int:
        return 1 if self.kind == "fp8_block" else 2 + self.has_zero

    def dequantize(self, smems, refs, expert, k, col, bs: TileBlockSizes) -> list[Array]:
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


def _x_specs(bs: TileBlockSizes, halves: int, row_block) -> list:
    """Activation tiles of one step: `[64, block_k]`, or for 4-bit weights its [even | odd] halves (the caller
    reordered each block's columns, `split_even_odd`)."""
    if halves == 1:
        return [plgpu.BlockSpec((TILE_ROWS, bs.block_k), lambda k: (row_block, k), delay_release=1)]
    half = bs.block_k // 2
    return [
        plgpu.BlockSpec((TILE_ROWS, half), lambda k, i=i: (row_block, 2 * k + i), delay_release=1) for i in range(2)
    ]


def _quantized_step(ops, op_refs, accs, bufs, expert, col, bs: TileBlockSizes, halves: int):
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


def _gate_up_quant_kernel(
    tile_expert_ref,  # [N_tiles] int32 GMEM
    tile_block_ref,  # [N_tiles] int32 GMEM
    num_tiles_ref,  # [1] int32 GMEM
    x_ref,  # [R, H] bf16 GMEM (4-bit: columns of each block in [even | odd] order)
    *refs,  # gate's refs, up's refs (_QuantOperand), [gate_bias_ref, up_bias_ref,] h_ref ([N_tiles * 64, I] out)
    block_sizes: TileBlockSizes,
    op: _QuantOperand,
    act: GatedActivation,
):
    """`_gate_up_kernel` over quantized gate/up: the same work items and epilogue, the weights dequantized in
    registers into bf16 shared-memory tiles that the wgmma reads (`_quantized_step`)."""
    gate_refs, up_refs = refs[: op.num_refs], refs[op.num_refs : 2 * op.num_refs]
    *bias_refs, h_ref = refs[2 * op.num_refs :]
    bs = block_sizes
    hidden = x_ref.shape[1]
    n_col = h_ref.shape[1] // bs.block_n

    @plgpu.nd_loop((num_tiles_ref[0] * n_col,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
        (w,) = info.index
        tile, col = w // n_col, w % n_col
        expert = tile_expert_ref[tile]
        row_block = tile_block_ref[tile]

        def with_tiles(*flat_bufs):  # the bf16 tiles (shared memory), then the accumulators (registers)
            bufs = [flat_bufs[: op.halves], flat_bufs[op.halves :]]

            def accumulate(acc_gate, acc_up):
                accs = [acc_gate, acc_up]
                step = _quantized_step([op, op], [gate_refs, up_refs], accs, bufs, expert, col, bs, op.halves)
                plgpu.emit_pipeline(
                    step,
                    grid=(hidden // bs.block_k,),
                    in_specs=_x_specs(bs, op.halves, row_block) + op.in_specs(bs, col) * 2,
                    max_concurrent_steps=bs.max_concurrent_steps,
                )(*[x_ref] * op.halves, *op.pipelined(gate_refs, expert), *op.pipelined(up_refs, expert))
                return acc_gate[...], acc_up[...]

            return pl.run_scoped(accumulate, plgpu.ACC((TILE_ROWS, bs.block_n)), plgpu.ACC((TILE_ROWS, bs.block_n)))

        buf = plgpu.SMEM((bs.block_k // op.halves, bs.block_n), COMPUTE_DTYPE)
        gate, up = pl.run_scoped(with_tiles, *[buf] * (2 * op.halves))
        _gate_up_epilogue(gate, up, bias_refs, h_ref, expert, tile, col, bs.block_n, act)


def _check_tiles(name: str, x: Array, w: Weight, tile_expert: Array, tile_block: Array, num_tiles: Array) -> None:
    if isinstance(w, QuantizedWeight):
        check_quantized(name, w)
        if x.dtype != COMPUTE_DTYPE:
            raise ValueError(f"{name}: quantized weights multiply bf16 activations, got {x.dtype=}")
    elif x.dtype != w.dtype or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: x and weights must share one of bf16/f16/f32, got {x.dtype=} {w.dtype=}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or x.shape[0] % TILE_ROWS:
        raise ValueError(f"{name}: need x [R (multiple of 64), H] and weights [E, H, N], got {x.shape=} {w.shape=}")
    if tile_expert.shape != tile_block.shape or tile_expert.ndim != 1 or num_tiles.shape != (1,):
        raise ValueError(
            f"{name}: need tile tables [N_tiles] and num_tiles [1], got {tile_expert.shape=} "
            f"{tile_block.shape=} {num_tiles.shape=}"
        )


def _check_biases(name: str, biases: tuple[Array | None, ...], shape: tuple[int, int]) -> tuple[Array, ...]:
    """All or none of `biases`, each of `shape`; returned as float32 (the epilogue adds them in float32)."""
    if all(b is None for b in biases):
        return ()
    if any(b is None or tuple(b.shape) != shape for b in biases):
        got = [getattr(b, "shape", None) for b in biases]
        raise ValueError(f"{name}: biases must all be given, each of shape {shape}, got {got}")
    return tuple(b.astype(jnp.float32) for b in biases)


def _quant_arrays(w: QuantizedWeight) -> tuple[Array, ...]:
    """The kernel operands of a quantized projection, in `_QuantOperand`'s ref order."""
    return tuple(a for a in (w.codes, w.scale, w.zero, w.scale2) if a is not None)


def _kernel_params() -> plgpu.CompilerParams:
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


@interpret_by_platform
def gate_up_tiles(
    x: Array,
    gate: Weight,
    up: Weight,
    tile_expert: Array,
    tile_block: Array,
    num_tiles: Array,
    *,
    activation: GatedActivation = GatedActivation(),  # noqa: B008 (frozen: an immutable default)
    gate_bias: Array | None = None,
    up_bias: Array | None = None,
    block_sizes: TileBlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """`h [N_tiles·64, I]` in the weight dtype; tile t (< num_tiles) holds `act(x_b @ gate[e] + gate_bias[e],
    x_b @ up[e] + up_bias[e])` for x_b = rows `[64·tile_block[t], +64)` of `x [R, H]` and e = `tile_expert[t]`
    (biases `[E, I]`, both or neither); tiles >= num_tiles are left unwritten. H and I must be multiples of the
    blocks.

    gate and up may be `QuantizedWeight`s of one kind (x then bf16): each step's codes are dequantized in
    registers into a bf16 shared-memory tile before the wgmma (`_gate_up_quant_kernel`); a group layout the
    blocks cannot step through raises `NotImplementedError`."""
    _check_tiles("gate_up_tiles", x, gate, tile_expert, tile_block, num_tiles)
    require_activation("gate_up_tiles", activation)
    if up.shape != gate.shape or up.dtype != gate.dtype or type(up) is not type(gate):
        raise ValueError(f"gate_up_tiles: up must match gate, got {gate.shape=} {up.shape=}")
    E, H, I = gate.shape
    biases = _check_biases("gate_up_tiles", (gate_bias, up_bias), (E, I))
    bs = block_sizes or TileBlockSizes.default(I, H, x.dtype, interpret=interpret)
    if H % bs.block_k or I % bs.block_n:
        raise ValueError(f"gate_up_tiles: H={H} and I={I} must be multiples of {bs.block_k=} and {bs.block_n=}")
    tables = (tile_expert.astype(jnp.int32), tile_block.astype(jnp.int32), num_tiles.astype(jnp.int32))
    if isinstance(gate, QuantizedWeight):
        if gate.kind != up.kind or (gate.zero is None) != (up.zero is None) or gate.group != up.group:
            raise ValueError(f"gate_up_tiles: up must be quantized like gate, got {gate.kind=} {up.kind=}")
        op = _QuantOperand.of(gate, bs)
        if op.halves == 2:
            x = split_even_odd(x, bs.block_k)
        kernel = plgpu.kernel(
            functools.partial(_gate_up_quant_kernel, block_sizes=bs, op=op, act=activation),
            out_type=jax.ShapeDtypeStruct((tile_expert.shape[0] * TILE_ROWS, I), x.dtype),
            grid=(bs.num_programs,),
            grid_names=("sm",),
            kernel_name="moe_gate_up_tiles",
            compiler_params=_kernel_params(),
            interpret=interpret_params(interpret),
        )
        return kernel(*tables, x, *_quant_arrays(gate), *_quant_arrays(up), *biases)
    transposed = x.dtype == jnp.float32 and not interpret
    if transposed:  # TF32 wgmma reads K-major operands only
        gate, up = jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2)
    kernel = plgpu.kernel(
        functools.partial(_gate_up_kernel, block_sizes=bs, transposed=transposed, act=activation),
        out_type=jax.ShapeDtypeStruct((tile_expert.shape[0] * TILE_ROWS, I), x.dtype),
        grid=(bs.num_programs,),
        grid_names=("sm",),
        kernel_name="moe_gate_up_tiles",
        compiler_params=_kernel_params(),
        interpret=interpret_params(interpret),
    )
    return kernel(*tables, x, gate, up, *biases)


def gate_up_tiles_reference(
    x: Array,
    gate: Weight,
    up: Weight,
    tile_expert: Array,
    tile_block: Array,
    num_tiles: Array,
    *,
    activation: GatedActivation = GatedActivation(),  # noqa: B008 (frozen: an immutable default)
    gate_bias: Array | None = None,
    up_bias: Array | None = None,
    block_sizes: TileBlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """Plain-jnp `gate_up_tiles`; tiles >= num_tiles are zero here (unwritten in the kernel)."""
    del block_sizes, interpret
    require_activation("gate_up_tiles_reference", activation)
    if isinstance(gate, QuantizedWeight):  # dequantized to float32, rounded to bf16 like the kernel's tiles
        gate, up = dequantize_weight(gate).astype(x.dtype), dequantize_weight(up).astype(x.dtype)
    xb = x.reshape(-1, TILE_ROWS, x.shape[1])[tile_block]  # [N_tiles, 64, H]
    g = jnp.einsum("trh,thi->tri", xb, gate[tile_expert], preferred_element_type=jnp.float32)
    u = jnp.einsum("trh,thi->tri", xb, up[tile_expert], preferred_element_type=jnp.float32)
    if gate_bias is not None:
        g = g + gate_bias.astype(jnp.float32)[tile_expert][:, None]
        u = u + up_bias.astype(jnp.float32)[tile_expert][:, None]
    h = activation(g, u)
    live = jnp.arange(tile_expert.shape[0]) < num_tiles[0]
    return jnp.where(live[:, None, None], h, 0.0).astype(x.dtype).reshape(-1, gate.shape[2])


def _down_kernel(
    tile_expert_ref,  # [N_tiles] int32 GMEM
    num_tiles_ref,  # [1] int32 GMEM
    h_ref,  # [N_tiles * 64, I] GMEM
    down_ref,  # [E, I, H] GMEM ([E, H, I] when transposed)
    *refs,  # [down_bias_ref ([E, H] float32 GMEM),] y_ref ([N_tiles * rows_out, H] float32 GMEM out)
    block_sizes: TileBlockSizes,
    transposed: bool,
    rows_out: int,
):
    *bias_refs, y_ref = refs
    bs = block_sizes
    inter = h_ref.shape[1]
    n_col = y_ref.shape[1] // bs.block_n

    @plgpu.nd_loop((num_tiles_ref[0] * n_col,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
        (w,) = info.index
        tile, col = w // n_col, w % n_col
        expert = tile_expert_ref[tile]

        def accumulate(acc):
            def step(_, h_smem, down_smem):
                plgpu.wgmma(acc, h_smem, plgpu.transpose_ref(down_smem, (1, 0)) if transposed else down_smem)

            w_block = (bs.block_n, bs.block_k) if transposed else (bs.block_k, bs.block_n)
            w_index = (lambda k: (col, k)) if transposed else (lambda k: (k, col))
            plgpu.emit_pipeline(
                step,
                grid=(inter // bs.block_k,),
                in_specs=[
                    plgpu.BlockSpec((TILE_ROWS, bs.block_k), lambda k: (tile, k), delay_release=1),
                    plgpu.BlockSpec(w_block, w_index, delay_release=1),
                ],
                max_concurrent_steps=bs.max_concurrent_steps,
            )(h_ref, down_ref.at[expert])
            return acc[...]

        y = pl.run_scoped(accumulate, plgpu.ACC((TILE_ROWS, bs.block_n)))
        _down_epilogue(y, bias_refs, y_ref, expert, tile, col, bs.block_n, rows_out)


def _down_epilogue(y, bias_refs, y_ref, expert, tile, col, block_n: int, rows_out: int) -> None:
    """The bias, then the first `rows_out` rows of y's tile stored through shared memory (decode: the padded
    rows never leave the SM)."""
    if bias_refs:
        (y,) = _add_column_bias([y], bias_refs, expert, col, block_n)

    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((TILE_ROWS, block_n), jnp.float32))
    def _store(out_smem):
        out_smem[...] = y
        plgpu.commit_smem()
        dst = y_ref.at[pl.ds(tile * rows_out, rows_out), pl.ds(col * block_n, block_n)]
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rows_out)], dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _down_quant_kernel(
    tile_expert_ref,  # [N_tiles] int32 GMEM
    num_tiles_ref,  # [1] int32 GMEM
    h_ref,  # [N_tiles * 64, I] bf16 GMEM (4-bit: columns of each block in [even | odd] order)
    *refs,  # down's refs (_QuantOperand), [down_bias_ref,] y_ref ([N_tiles * rows_out, H] float32 out)
    block_sizes: TileBlockSizes,
    op: _QuantOperand,
    rows_out: int,
):
    """`_down_kernel` over a quantized down projection (`_quantized_step`)."""
    down_refs = refs[: op.num_refs]
    *bias_refs, y_ref = refs[op.num_refs :]
    bs = block_sizes
    inter = h_ref.shape[1]
    n_col = y_ref.shape[1] // bs.block_n

    @plgpu.nd_loop((num_tiles_ref[0] * n_col,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
        (w,) = info.index
        tile, col = w // n_col, w % n_col
        expert = tile_expert_ref[tile]

        def with_tiles(*bufs):
            def accumulate(acc):
                step = _quantized_step([op], [down_refs], [acc], [bufs], expert, col, bs, op.halves)
                plgpu.emit_pipeline(
                    step,
                    grid=(inter // bs.block_k,),
                    in_specs=_x_specs(bs, op.halves, tile) + op.in_specs(bs, col),
                    max_concurrent_steps=bs.max_concurrent_steps,
                )(*[h_ref] * op.halves, *op.pipelined(down_refs, expert))
                return acc[...]

            return pl.run_scoped(accumulate, plgpu.ACC((TILE_ROWS, bs.block_n)))

        buf = plgpu.SMEM((bs.block_k // op.halves, bs.block_n), COMPUTE_DTYPE)
        y = pl.run_scoped(with_tiles, *[buf] * op.halves)
        _down_epilogue(y, bias_refs, y_ref, expert, tile, col, bs.block_n, rows_out)


@interpret_by_platform
def down_tiles(
    h: Array,
    down: Weight,
    tile_expert: Array,
    num_tiles: Array,
    *,
    rows_out: int = TILE_ROWS,
    down_bias: Array | None = None,
    block_sizes: TileBlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """`y [N_tiles·rows_out, H]` float32: the first `rows_out` rows of `h[tile] @ down[e] + down_bias[e]`,
    e = `tile_expert[tile]`, for tiles < num_tiles (the rest unwritten). I and H must be multiples of the
    blocks. down may be a `QuantizedWeight` (h then bf16), dequantized in registers (`_down_quant_kernel`)."""
    _check_tiles("down_tiles", h, down, tile_expert, tile_expert, num_tiles)
    if rows_out not in (8, 16, 32, TILE_ROWS):
        raise ValueError(f"down_tiles: rows_out={rows_out} must be 8, 16, 32 or 64")
    E, I, H = down.shape
    biases = _check_biases("down_tiles", (down_bias,), (E, H))
    if h.shape[0] != tile_expert.shape[0] * TILE_ROWS:
        raise ValueError(f"down_tiles: h must have N_tiles·64={tile_expert.shape[0] * TILE_ROWS} rows, got {h.shape=}")
    bs = block_sizes or TileBlockSizes.default(H, I, h.dtype, interpret=interpret)
    if I % bs.block_k or H % bs.block_n:
        raise ValueError(f"down_tiles: I={I} and H={H} must be multiples of {bs.block_k=} and {bs.block_n=}")
    tables = (tile_expert.astype(jnp.int32), num_tiles.astype(jnp.int32))
    if isinstance(down, QuantizedWeight):
        op = _QuantOperand.of(down, bs)
        if op.halves == 2:
            h = split_even_odd(h, bs.block_k)
        kernel = plgpu.kernel(
            functools.partial(_down_quant_kernel, block_sizes=bs, op=op, rows_out=rows_out),
            out_type=jax.ShapeDtypeStruct((tile_expert.shape[0] * rows_out, H), jnp.float32),
            grid=(bs.num_programs,),
            grid_names=("sm",),
            kernel_name="moe_down_tiles",
            compiler_params=_kernel_params(),
            interpret=interpret_params(interpret),
        )
        return kernel(*tables, h, *_quant_arrays(down), *biases)
    transposed = h.dtype == jnp.float32 and not interpret
    if transposed:
        down = jnp.swapaxes(down, 1, 2)
    kernel = plgpu.kernel(
        functools.partial(_down_kernel, block_sizes=bs, transposed=transposed, rows_out=rows_out),
        out_type=jax.ShapeDtypeStruct((tile_expert.shape[0] * rows_out, H), jnp.float32),
        grid=(bs.num_programs,),
        grid_names=("sm",),
        kernel_name="moe_down_tiles",
        compiler_params=_kernel_params(),
        interpret=interpret_params(interpret),
    )
    return kernel(*tables, h, down, *biases)


def down_tiles_reference(
    h: Array,
    down: Weight,
    tile_expert: Array,
    num_tiles: Array,
    *,
    rows_out: int = TILE_ROWS,
    down_bias: Array | None = None,
    block_sizes: TileBlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """Plain-jnp `down_tiles`; tiles >= num_tiles are zero here (unwritten in the kernel)."""
    del block_sizes, interpret
    if isinstance(down, QuantizedWeight):
        down = dequantize_weight(down).astype(h.dtype)
    hb = h.reshape(-1, TILE_ROWS, h.shape[1])[:, :rows_out]  # [N_tiles, rows_out, I]
    y = jnp.einsum("tri,tih->trh", hb, down[tile_expert], preferred_element_type=jnp.float32)
    if down_bias is not None:
        y = y + down_bias.astype(jnp.float32)[tile_expert][:, None]
    live = jnp.arange(tile_expert.shape[0]) < num_tiles[0]
    return jnp.where(live[:, None, None], y, 0.0).reshape(-1, down.shape[2])
