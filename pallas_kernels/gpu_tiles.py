"""Expert tiles on Mosaic GPU: each work item multiplies one 64-row tile by one expert's weights.

Both MoE ops on Mosaic GPU reduce to the same two kernels over a *tile table* built on device by the caller:
`moe_decode` (gpu_decode.py: tile u = union expert u, every tile reads the same padded rows) and `moe_grouped`
(gpu_grouped.py: tile t = 64 consecutive rows of the expert-sorted, block-aligned pairs).

1. `gate_up_tiles`: `h[tile] = act(x[tile_block[tile]] @ gate[e], x[...] @ up[e])`, e = `tile_expert[tile]`, two
   float32 wgmma accumulators over the hidden axis, the activation in the epilogue, h in the weight dtype.
2. `down_tiles`: `y[tile] = h[tile] @ down[e]`, float32, of which the first `rows_out` rows are stored.

Lowering: Mosaic GPU (`plgpu.kernel` on a persistent grid, warpgroup semantics, wgmma fed by a TMA pipeline). The
bodies: gpu_tile_kernels.py (dense weights), gpu_quant_tiles.py (`QuantizedWeight`s, dequantized in registers); both
are launched by `_launch`. Shapes must be multiples of the blocks (the callers pad: `pad_problem`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_quant_tiles, gpu_tile_kernels
from pallas_kernels.activations import GatedActivation
from pallas_kernels.gpu_tile_kernels import TILE_ROWS
from pallas_kernels.moe_op import FLOAT_DTYPES, MoEProblem, Weight, compute_dtype, require_activation, signature_of
from pallas_kernels.platform import interpret_by_platform, interpret_params
from pallas_kernels.quantized_weights import (
    COMPUTE_DTYPE,
    QuantizedWeight,
    check_quantized,
    dequantize_weight,
    pad_quantized,
)

Array = jax.Array

_H100_SMS = 132  # H100 SXM and H200: the default when no GPU can be asked (lowering from a CPU host)
_INTERPRET_PROGRAMS = 2


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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


@dataclasses.dataclass(frozen=True)
class TilePairBlockSizes:
    """Blocks of the two tile kernels of one op (see `TileBlockSizes`)."""

    gate_up: TileBlockSizes
    down: TileBlockSizes
    GATE_UP_BLOCK_N: ClassVar[int | None] = None  # the op's gate/up output columns (None: `largest_block`)

    def __post_init__(self) -> None:
        for name in ("gate_up", "down"):
            if not isinstance(getattr(self, name), TileBlockSizes):
                raise ValueError(f"{type(self).__name__}.{name} must be a TileBlockSizes, got {getattr(self, name)!r}")

    @classmethod
    def default(cls, hidden: int, inter: int, dtype: Any, *, interpret: bool = False, weight_kind: str | None = None):
        """128-byte contraction rows; `GATE_UP_BLOCK_N` or the largest of 128/64 columns dividing I (gate/up), and
        H (down); `weight_kind` (a `QuantizedWeight.kind`, None for dense weights): `quantized_tile_options`."""
        opts = quantized_tile_options(weight_kind)
        gate_up_opts = {**opts, "block_n": cls.GATE_UP_BLOCK_N} if cls.GATE_UP_BLOCK_N else opts
        return cls(
            gate_up=TileBlockSizes.default(inter, hidden, dtype, interpret=interpret, **gate_up_opts),
            down=TileBlockSizes.default(hidden, inter, dtype, interpret=interpret, **opts),
        )

    @classmethod
    def for_problem(cls, p: MoEProblem, interpret: bool):
        """`default` for the H, I, compute dtype and weight kind of `p`."""
        _, H, _, I, _ = p.dims
        return cls.default(H, I, compute_dtype(p.gate), interpret=interpret, weight_kind=getattr(p.gate, "kind", None))


def quantized_tile_options(weight_kind: str | None) -> dict:
    """`TileBlockSizes.default` options for weights of `weight_kind` (None: dense, no options).

    Quantized: 64 output columns (with 128, the dequantized tiles and the float32 accumulators exceed 255
    registers a thread and spill, measured by tests/test_cuda_compile.py); 4-bit kinds step 128 contraction
    elements (`packed`).
    """
    if weight_kind is None:
        return {}
    return {"block_n": 64, "packed": weight_kind in ("int4", "mxfp4", "nvfp4")}


def pad_problem(p: MoEProblem, bs: TilePairBlockSizes) -> MoEProblem:
    """`p` with x's H and the weights' H and I zero-padded to multiples of the blocks (a no-op when already there).

    Zero columns of x and zero rows/columns of the weights add nothing: padded I columns give h = act(0, 0) = 0
    for every activation, and padded H columns of the output are cut by the caller. Padding copies the weights on
    every call: block sizes are chosen to divide real model shapes, so only awkward shapes pay it. Quantized
    weights pad their codes and scales with zeros (`pad_quantized`: padded weights dequantize to 0).
    """
    H, I = p.gate.shape[1], p.gate.shape[2]
    hidden = round_up(H, math.lcm(bs.gate_up.block_k, bs.down.block_n))
    inter = round_up(I, math.lcm(bs.gate_up.block_n, bs.down.block_k))
    if (hidden, inter) != (H, I):
        if isinstance(p.gate, QuantizedWeight):
            pad_in_out = pad_quantized
        else:
            pad_in_out = lambda w, n_in, n_out: jnp.pad(w, ((0, 0), (0, n_in - w.shape[1]), (0, n_out - w.shape[2])))
        x = jnp.pad(p.x, ((0, 0), (0, hidden - H)))
        gate, up = pad_in_out(p.gate, hidden, inter), pad_in_out(p.up, hidden, inter)
        p = dataclasses.replace(p, x=x, gate=gate, up=up, down=pad_in_out(p.down, inter, hidden))
    if p.gate_bias is None:
        return p
    pad_to = lambda b, n: jnp.pad(b, ((0, 0), (0, n - b.shape[1])))
    biases = pad_to(p.gate_bias, inter), pad_to(p.up_bias, inter), pad_to(p.down_bias, hidden)
    return dataclasses.replace(p, gate_bias=biases[0], up_bias=biases[1], down_bias=biases[2])


def tiles_ffn(
    rows: Array, p: MoEProblem, tables: tuple[Array, Array, Array], bs: TilePairBlockSizes, rows_out: int, interpret
) -> Array:
    """`down_tiles(gate_up_tiles(rows, ...), ...)` with the (padded) weights, biases and activation of `p`;
    `tables`: `(tile_expert, tile_block, num_tiles)`."""
    tile_expert, tile_block, num_tiles = tables
    h = gate_up_tiles(
        rows,
        p.gate,
        p.up,
        tile_expert,
        tile_block,
        num_tiles,
        activation=p.activation,
        gate_bias=p.gate_bias,
        up_bias=p.up_bias,
        block_sizes=bs.gate_up,
        interpret=interpret,
    )  # [N_tiles·64, I]
    return down_tiles(
        h,
        p.down,
        tile_expert,
        num_tiles,
        rows_out=rows_out,
        down_bias=p.down_bias,
        block_sizes=bs.down,
        interpret=interpret,
    )


def _check_tiles(name: str, x: Array, w: Weight, tile_expert: Array, tile_block: Array, num_tiles: Array) -> None:
    if isinstance(w, QuantizedWeight):
        check_quantized(name, w)
        if x.dtype != COMPUTE_DTYPE:
            raise ValueError(f"{name}: quantized weights multiply bf16 activations, got {x.dtype=}")
    elif x.dtype != w.dtype or x.dtype not in FLOAT_DTYPES:
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


def _launch(body, out_shape: tuple[int, int], dtype, name: str, bs: TileBlockSizes, interpret: bool, *operands):
    """Run a tile kernel body on the persistent grid of `bs.num_programs` CTAs (warpgroup semantics)."""
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, dtype),
        grid=(bs.num_programs,),
        grid_names=("sm",),
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )
    return kernel(*operands)


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
    registers into a bf16 shared-memory tile before the wgmma (gpu_quant_tiles.py); a group layout the blocks
    cannot step through raises `NotImplementedError`."""
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
        body, operands = gpu_quant_tiles.gate_up_body(x, gate, up, bs, activation)
    else:
        body, operands = gpu_tile_kernels.gate_up_body(x, gate, up, bs, activation, interpret)
    out_shape = (tile_expert.shape[0] * TILE_ROWS, I)
    return _launch(body, out_shape, x.dtype, "moe_gate_up_tiles", bs, interpret, *tables, *operands, *biases)


@signature_of(gate_up_tiles)
def gate_up_tiles_reference(x, gate, up, tile_expert, tile_block, num_tiles, activation, gate_bias, up_bias, **_):
    """Plain-jnp `gate_up_tiles`; tiles >= num_tiles are zero here (unwritten in the kernel)."""
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
    blocks. down may be a `QuantizedWeight` (h then bf16), dequantized in registers (gpu_quant_tiles.py)."""
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
        body, operands = gpu_quant_tiles.down_body(h, down, bs, rows_out)
    else:
        body, operands = gpu_tile_kernels.down_body(h, down, bs, rows_out, interpret)
    out_shape = (tile_expert.shape[0] * rows_out, H)
    return _launch(body, out_shape, jnp.float32, "moe_down_tiles", bs, interpret, *tables, *operands, *biases)


@signature_of(down_tiles)
def down_tiles_reference(h, down, tile_expert, num_tiles, rows_out, down_bias, **_):
    """Plain-jnp `down_tiles`; tiles >= num_tiles are zero here (unwritten in the kernel)."""
    if isinstance(down, QuantizedWeight):
        down = dequantize_weight(down).astype(h.dtype)
    hb = h.reshape(-1, TILE_ROWS, h.shape[1])[:, :rows_out]  # [N_tiles, rows_out, I]
    y = jnp.einsum("tri,tih->trh", hb, down[tile_expert], preferred_element_type=jnp.float32)
    if down_bias is not None:
        y = y + down_bias.astype(jnp.float32)[tile_expert][:, None]
    live = jnp.arange(tile_expert.shape[0]) < num_tiles[0]
    return jnp.where(live[:, None, None], y, 0.0).reshape(-1, down.shape[2])
