"""The VJP of the grouped MoE op (`MoEProblem`) on grouped kernels: cost proportional to the routed pairs.

`moe_grouped_vjp(x, gate, up, down, indices, weights, in_scale, *, activation, biases, cotangent)` returns the
gradients of `Σ_k w_tk · E_{i_tk}(s_tk · x_t)` for the cotangent `[T, H]` of that float32 sum, as `MoEGrads`. Dense
weights (bf16/f16/f32) only. The products run on gpu_backward.py's two kernels (Mosaic GPU; megablox `gmm`/`tgmm`
where the program is lowered for TPU: tpu_backward.py), the rest is XLA over `[R, ·]` rows:

1. The block-aligned tile table of gpu_grouped.py; rows `xs = s · x` gathered into it (padding rows zero), and
   `dy = w · cotangent` of each row's token.
2. Recompute (no residual but the inputs): `g = xs · gate_e + bg_e`, `u = xs · up_e + bu_e` (float32), `h = act(g,
   u)` in the weight dtype; `y = h · down_e + bd_e` only for the slots' weight gradient `<cotangent_t, y>`.
3. `dh = dy · down_eᵀ`; `(dg, du)` = the activation's VJP (`jax.vjp` of `GatedActivation`, so every kind and
   clamp is differentiated as the forward computes it: the clamps pass no gradient past their limits).
4. `dxs = dg · gate_eᵀ + du · up_eᵀ`; per row: `dx_t += s · dxs`, the input scale's gradient `<dxs, x_t>`.
5. Weight gradients per expert, summed in float32 and stored in the weight dtype (`tgmm`): `dgate_e = xs_eᵀ ·
   dg_e`, `dup_e = xs_eᵀ · du_e`, `ddown_e = h_eᵀ · dy_e`; biases: sums of `dg`, `du`, `dy` over the expert's rows.

The products take the weight dtype (dg, du and dy rounded to it, as the forward rounds h) and accumulate in float32.
H and I are zero-padded to multiples of 64 (a copy of the weights, only for shapes that are not).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.gpu_backward import grouped_matmul, tgmm_tiles
from pallas_kernels.gpu_grouped import block_aligned_layout, block_aligned_rows
from pallas_kernels.gpu_tile_kernels import TILE_ROWS
from pallas_kernels.gpu_tiles import round_up
from pallas_kernels.moe_op import MoEProblem, dense_reference, moe_op, signature_of
from pallas_kernels.platform import interpret_by_platform, register_tpu_variant
from pallas_kernels.quantized_weights import QuantizedWeight
from pallas_kernels.tpu_backward import tpu_grouped_matmul, tpu_tgmm_tiles

Array = jax.Array


class MoEGrads(NamedTuple):
    """Gradients of the routed sum w.r.t. each argument of `MoEProblem`, in its dtype; None for absent arguments
    (biases, in_scale), for the weights and biases when `weight_grads=False` and for the output weights when
    `out_weight_grads=False`."""

    x: Array  # [T, H]
    gate: Array | None  # [E, H, I]
    up: Array | None  # [E, H, I]
    down: Array | None  # [E, I, H]
    weights: Array  # [T, K]
    in_scale: Array | None  # [T, K]
    gate_bias: Array | None  # [E, I]
    up_bias: Array | None  # [E, I]
    down_bias: Array | None  # [E, H]


def _pad_to(a: Array, axis: int, size: int) -> Array:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return a if a.shape[axis] == size else jnp.pad(a, widths)


@interpret_by_platform
@moe_op
def moe_grouped_vjp(
    p: MoEProblem,
    *,
    cotangent: Array,
    weight_grads: bool = True,
    out_weight_grads: bool = True,
    interpret: bool | None = None,
) -> MoEGrads:
    """`MoEGrads` of the routed sum (`MoEProblem`) for `cotangent [T, H]` (module docstring).

    weight_grads: False skips the weight and bias gradients (a frozen base).
    out_weight_grads: False skips the output weights' gradient and the recomputed expert outputs it needs (routing
      weights held).
    interpret: as for `moe_grouped` (None: the lowering platform decides; programs lowered for TPU run
      `moe_tpu_grouped_vjp`).
    """
    mm = functools.partial(grouped_matmul, interpret=interpret)
    tgmm = functools.partial(tgmm_tiles, interpret=interpret)
    return _grouped_vjp(p, cotangent, weight_grads, out_weight_grads, mm, tgmm)


@moe_op
def moe_tpu_grouped_vjp(
    p: MoEProblem,
    *,
    cotangent: Array,
    weight_grads: bool = True,
    out_weight_grads: bool = True,
    device_kind: str | None = None,
    interpret: bool = False,
) -> MoEGrads:
    """`moe_grouped_vjp` on Mosaic TPU: the same steps on megablox `gmm`/`tgmm` (tpu_backward.py)."""
    mm = functools.partial(tpu_grouped_matmul, device_kind=device_kind, interpret=interpret)
    tgmm = functools.partial(tpu_tgmm_tiles, device_kind=device_kind, interpret=interpret)
    return _grouped_vjp(p, cotangent, weight_grads, out_weight_grads, mm, tgmm)


def _grouped_vjp(p: MoEProblem, cotangent: Array, weight_grads: bool, out_weight_grads: bool, matmul, tgmm_fn):
    """The module docstring's steps with the two products given: `matmul(lhs, w, tile_expert, num_tiles, *, bias,
    transpose_rhs)` and `tgmm_fn(a, b, tile_expert, num_tiles, *, num_experts, out_dtype)`."""
    if isinstance(p.gate, QuantizedWeight):
        raise NotImplementedError("moe_grouped_vjp: reads dense weights (quantized bases have no backward kernel)")
    if cotangent.shape != p.x.shape:
        raise ValueError(f"moe_grouped_vjp: cotangent must have x's shape {p.x.shape}, got {cotangent.shape=}")
    T, H, E, I, K = p.dims
    M, dtype = T * K, p.gate.dtype
    if M == 0:  # no pairs: nothing reaches the experts
        return _zero_grads(p, weight_grads, out_weight_grads)
    Hp, Ip = round_up(H, TILE_ROWS), round_up(I, TILE_ROWS)
    gate, up, down = (
        _pad_to(_pad_to(w, 1, a), 2, b) for w, a, b in ((p.gate, Hp, Ip), (p.up, Hp, Ip), (p.down, Ip, Hp))
    )
    gate_bias, up_bias, down_bias = (
        None if b is None else _pad_to(b, 1, n) for b, n in zip(p.biases, (Ip, Ip, Hp), strict=True)
    )

    # 1. The layout; per row its pair, token, input scale and output weight (padding rows: token T, zeros).
    _, row_pair, tile_expert, num_tiles = block_aligned_layout(p.indices, E)
    valid = row_pair < M  # [R]
    pair = jnp.minimum(row_pair, M - 1)
    token = jnp.where(valid, row_pair // K, T)  # [R]; row T of the extended arrays is zeros
    x32 = jnp.concatenate([_pad_to(p.x.astype(jnp.float32), 1, Hp), jnp.zeros((1, Hp), jnp.float32)])  # [T+1, Hp]
    ct = jnp.concatenate([_pad_to(cotangent.astype(jnp.float32), 1, Hp), jnp.zeros((1, Hp), jnp.float32)])
    real = (p.indices >= 0) & (p.indices < E)
    w_row = jnp.where(valid, jnp.where(real, p.weights, 0).reshape(-1).astype(jnp.float32)[pair], 0.0)  # [R]
    scale = None if p.in_scale is None else jnp.where(valid, p.in_scale.reshape(-1).astype(jnp.float32)[pair], 0.0)
    xs = block_aligned_rows(x32[:T], p.in_scale, row_pair, K, dtype)  # [R, Hp]
    dy32 = w_row[:, None] * ct[token]  # [R, Hp]
    dy = dy32.astype(dtype)
    rows = lambda a: jnp.where(valid[:, None], a, 0.0)  # rows of tiles past those in use are unwritten

    tables = (tile_expert, num_tiles)
    mm = lambda lhs, w, bias=None, t=False: rows(matmul(lhs, w, *tables, bias=bias, transpose_rhs=t))

    # 2. Recompute the forward of the rows.
    g, u = mm(xs, gate, gate_bias), mm(xs, up, up_bias)  # [R, Ip] float32
    h32, act_vjp = jax.vjp(p.activation, g, u)
    h = h32.astype(dtype)
    # 3-4. Input gradients.
    dh = mm(dy, down, t=True)  # [R, Ip]
    dg, du = (rows(d) for d in act_vjp(dh))
    dg_w, du_w = dg.astype(dtype), du.astype(dtype)
    dxs = mm(dg_w, gate, t=True) + mm(du_w, up, t=True)  # [R, Hp]
    unsort = lambda per_row: jnp.zeros(M, jnp.float32).at[jnp.where(valid, row_pair, M)].set(per_row, mode="drop")
    d_weights = None
    if out_weight_grads:
        y = mm(h, down, down_bias)  # [R, Hp]
        d_weights = jnp.where(real, unsort(jnp.sum(ct[token] * y, -1)).reshape(T, K), 0.0).astype(p.weights.dtype)
    d_in_scale = None
    if scale is not None:
        d_in_scale = jnp.where(real, unsort(jnp.sum(dxs * x32[token], -1)).reshape(T, K), 0.0)
        dxs = dxs * scale[:, None]
    dx = jnp.zeros((T + 1, Hp), jnp.float32).at[token].add(dxs)[:T, :H]
    grads = dict(
        x=dx.astype(p.x.dtype),
        weights=d_weights,
        in_scale=None if d_in_scale is None else d_in_scale.astype(p.in_scale.dtype),
        gate=None,
        up=None,
        down=None,
        gate_bias=None,
        up_bias=None,
        down_bias=None,
    )
    if not weight_grads:
        return MoEGrads(**grads)
    # 5. Weight gradients, the rows of each expert only.
    tgmm = lambda a, b: tgmm_fn(a, b, *tables, num_experts=E, out_dtype=dtype)  # float32 sums, stored in dtype
    grads |= dict(
        gate=tgmm(xs, dg_w)[:, :H, :I],
        up=tgmm(xs, du_w)[:, :H, :I],
        down=tgmm(h, dy)[:, :I, :H],
    )
    if p.gate_bias is not None:
        row_expert = jnp.where(valid, jnp.repeat(tile_expert, TILE_ROWS), E)  # [R]; padding rows -> dropped
        per_expert = lambda d, n, b: (
            jnp.zeros((E, d.shape[1]), jnp.float32).at[row_expert].add(d, mode="drop")[:, :n].astype(b.dtype)
        )
        grads |= dict(
            gate_bias=per_expert(dg, I, p.gate_bias),
            up_bias=per_expert(du, I, p.up_bias),
            down_bias=per_expert(dy32, H, p.down_bias),
        )
    return MoEGrads(**grads)


def _zero_grads(p: MoEProblem, weight_grads: bool, out_weight_grads: bool) -> MoEGrads:
    zeros = lambda a: None if a is None else jnp.zeros(a.shape, a.dtype)
    trained = lambda a: zeros(a) if weight_grads else None
    return MoEGrads(
        zeros(p.x),
        *(trained(w) for w in (p.gate, p.up, p.down)),
        zeros(p.weights) if out_weight_grads else None,
        zeros(p.in_scale),
        *(trained(b) for b in p.biases),
    )


@signature_of(moe_grouped_vjp)
def moe_grouped_vjp_reference(
    x,
    gate,
    up,
    down,
    indices,
    weights,
    in_scale,
    activation,
    gate_bias,
    up_bias,
    down_bias,
    cotangent,
    weight_grads,
    out_weight_grads,
    **_,
) -> MoEGrads:
    """`moe_grouped_vjp` in plain jnp: `jax.vjp` of the dense reference (`dense_reference`)."""
    fixed = dict(indices=indices, activation=activation)

    def routed(x, gate, up, down, weights, in_scale, gate_bias, up_bias, down_bias):
        args = dict(x=x, gate=gate, up=up, down=down, weights=weights, in_scale=in_scale)
        return dense_reference(MoEProblem(**args, **fixed, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias))

    primals = (x, gate, up, down, weights, in_scale, gate_bias, up_bias, down_bias)
    _, vjp = jax.vjp(routed, *primals)
    dx, dgate, dup, ddown, dw, ds, dbg, dbu, dbd = vjp(cotangent.astype(jnp.float32))
    if not weight_grads:
        dgate = dup = ddown = dbg = dbu = dbd = None
    return MoEGrads(dx, dgate, dup, ddown, dw if out_weight_grads else None, ds, dbg, dbu, dbd)


register_tpu_variant(moe_grouped_vjp, moe_tpu_grouped_vjp)
