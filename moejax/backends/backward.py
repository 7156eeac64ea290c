"""The backward of the routed experts over the routed (row, expert) pairs only: the VJP of every backend that does
not differentiate itself (`moejax.backends.run_routed`).

Its cost is proportional to the routed pairs (T·K rows through one expert each) plus one read of each used expert's
weights, never to the number of experts; its memory is the gradient outputs plus one expert's float32 weights and
one block's activations (the forward's activations are recomputed, block by block: no residual but the inputs).

1. Stable argsort of the T·K pairs by expert id, as the grouped plan (`moejax.backends.xla`); ids outside [0, E)
   (zero experts, experts on another device) sort last and are never visited.
2. `fori_loop` over the experts that have pairs (a device count): the expert's weights once, in the reference's
   float32 view (`reference.dequantized`: codes dequantized, bf16 widened), then its pairs in blocks of B rows:
   the block's forward and its VJP (`jax.vjp` of the expert's `ffn`, so every activation, bias, adapter and int8
   input of the reference is differentiated as the reference does) give
   - the input rows' gradient, times the slot's input scale, added into its token's row of `dx`;
   - the expert's float32 weight gradient, summed over its blocks in block order, and its adapters' gradients;
   - the slot's output-weight gradient `<g_t, y_tk>` and input-scale gradient `<dx_tk, x_t>`.
3. After its last block the expert's weight gradient is pulled back through the dequantization (scales of a
   quantized format; codes are not differentiable) and added at the expert's index (XLA updates in place).

Only what is differentiated is computed (the `perturbed` flags of `jax.custom_vjp`'s symbolic zeros): with the
base weights frozen (adapters trained) no base weight gradient is formed. Pair order is fixed by the sort and the
loops run in order, so the gradients are the same run to run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.backends.reference import dequantized
from moejax.backends.xla import grouped_block_rows
from moejax.lora import LoRAExpert, LoRAExperts
from moejax.quantized.activations import Int8Inputs
from moejax.slots import Slots
from moejax.weights import ExpertWeights, FusedExpertWeights, PerExpert
from pallas_kernels.activations import GatedActivation

Array = jax.Array


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _split(tree: Any) -> tuple[list, list, Callable[[list], Any]]:
    """`tree`'s float leaves, its other leaves, and `join(floats)` that rebuilds it with new float leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    is_float = [_is_float(leaf) for leaf in leaves]
    floats = [leaf for leaf, f in zip(leaves, is_float, strict=True) if f]

    def join(new_floats: list) -> Any:
        it = iter(new_floats)
        return treedef.unflatten([next(it) if f else leaf for leaf, f in zip(leaves, is_float, strict=True)])

    return floats, [leaf for leaf, f in zip(leaves, is_float, strict=True) if not f], join


def _cotangent(tree: Any, floats: list | None) -> Any:
    """`tree`'s cotangent: the float leaves from `floats` (None: zeros), float0 zeros for the others."""
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(floats or [])
    out = []
    for leaf in leaves:
        if not _is_float(leaf):
            out.append(np.zeros(jnp.shape(leaf), jax.dtypes.float0))
        elif floats is None:
            out.append(jnp.zeros(jnp.shape(leaf), jnp.result_type(leaf)))
        else:
            out.append(next(it).astype(jnp.result_type(leaf)))
    return treedef.unflatten(out)


# -- the views: expert e of any layout, and where its gradient goes --------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """Experts whose `expert(e)` takes a traced e (stacked formats, a stack's expert adapters). The gradient is
    kept in their own structure; adding expert e's is the transpose of `expert(e)` (XLA updates in place)."""

    experts: Any
    perturbed: bool

    def take(self, e: Array | int) -> Any:
        return self.experts.expert(e)

    def zeros(self) -> list:
        return [jnp.zeros(jnp.shape(w), jnp.float32) for w in _split(self.experts)[0]]

    def add(self, acc: list, e: Array | int, d_one: list) -> list:
        floats, _, join = _split(self.experts)
        take = lambda fs: _split(join(fs).expert(e))[0]
        d_all = jax.vjp(take, floats)[1](d_one)[0]
        return [a + d for a, d in zip(acc, d_all, strict=True)]

    def cotangent(self, acc: list | None) -> Any:
        return _cotangent(self.experts, acc)

    def from_each(self, d_ones: list[list]) -> list:
        """The gradient of every expert at once, `d_ones[e]` expert e's: the transpose of taking all experts (one
        scatter, not an update per expert)."""
        floats, _, join = _split(self.experts)
        E = len(d_ones)
        take_all = lambda fs: jax.vmap(lambda e: _split(join(fs).expert(e))[0])(jnp.arange(E))
        stacked = [jnp.stack(leaves) for leaves in zip(*d_ones, strict=True)]
        return jax.vjp(take_all, floats)[1](stacked)[0]


def _view(experts: Any, perturbed: Any) -> tuple[Any, _Stacked | None, bool]:
    """The base experts (a stacked format or `PerExpert`), the adapters' view (or None), and whether the base is
    differentiated; `perturbed`: the flags of `experts`, same structure."""
    any_of = lambda tree: any(jax.tree.leaves(tree))
    if isinstance(experts, LoRAExperts):
        return experts.base, _Stacked(experts.lora, any_of(perturbed.lora)), any_of(perturbed.base)
    return experts, None, any_of(perturbed)


def _float32_view(one: Any) -> tuple[Any, int | None]:
    """One expert's weights as the reference computes with them, float32, and for int8 activations their group
    (else None). Float32 dense weights are used as they are stored (the per-expert layout's fused `[out, in]`
    matrices are XLA:CPU's fastest products, and no copy is made); others are dequantized to `ExpertWeights`."""
    if isinstance(one, ExpertWeights | FusedExpertWeights) and one.dtype == jnp.float32:
        return one, None
    view = dequantized(one)  # the reference's; its int8-input wrapper is no pytree, so it is unwrapped here
    return (view.dense, view.group) if isinstance(view, Int8Inputs) else (view, None)


def _expert(dense: Any, group: int | None, lora: Any) -> Any:
    base = dense if group is None else Int8Inputs(dense, group)
    return base if lora is None else LoRAExpert(base, lora)


# -- the backward ---------------------------------------------------------------------------------------------


def routed_vjp(
    experts: Any,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    cotangent: Array,
    perturbed: tuple[Any, Any, Any],
    *,
    block_rows: int | None = None,
) -> tuple[Any, Array | None, Slots | None]:
    """Cotangents of `(experts, x, slots)` for the routed sum's cotangent `[T, H]` (module docstring).

    `perturbed`: `(experts, x, slots)`-shaped flags saying which inputs are differentiated; the others get None
    (zeros). `block_rows`: rows of a block (default `grouped_block_rows`).
    """
    p_experts, p_x, p_slots = perturbed
    want_x = bool(p_x)
    want_out = bool(p_slots.out_weight)
    want_scale = slots.in_scale is not None and bool(p_slots.in_scale)
    base, adapters, want_base = _view(experts, p_experts)
    want_lora = adapters is not None and adapters.perturbed
    if not (want_x or want_out or want_scale or want_base or want_lora):
        return None, None, None

    T, K = slots.indices.shape
    E, H, M = experts.num_experts, x.shape[-1], T * K
    # Half the forward's blocks (the mean load per expert rounded up to a power of two): a padding row costs the
    # block's nine products, an extra block one pass over the expert's gradient. At least 16 rows: the
    # per-expert float32 format runs 2..8 rows as a multiply-reduce (`padded_rows`), whose backward would hold a
    # weight-sized temporary per row.
    B = max(16, (block_rows or grouped_block_rows(M, E)) // 2)
    ids = slots.indices.reshape(-1)
    expert_of_pair = jnp.where((ids >= 0) & (ids < E), ids, E).astype(jnp.int32)  # [M]; skipped -> E
    order = jnp.argsort(expert_of_pair, stable=True)  # [M] the pair at each sorted row
    counts = jnp.bincount(expert_of_pair, length=E + 1)[:E]  # [E]
    first_row = jnp.cumsum(counts) - counts  # [E]
    pad = lambda a: jnp.concatenate([a, jnp.zeros((B, *a.shape[1:]), a.dtype)])  # B spare rows past M
    pairs = {
        "token": pad(order // K),  # [M + B]
        "out_weight": pad(slots.out_weight.reshape(-1).astype(jnp.float32)[order]),  # [M + B]
        "in_scale": None if slots.in_scale is None else pad(slots.in_scale.reshape(-1).astype(jnp.float32)[order]),
    }
    want = {"x": want_x, "out": want_out, "scale": want_scale, "base": want_base, "lora": want_lora}
    expert_step = functools.partial(
        _one_expert,
        pairs=pairs,
        x=x.astype(jnp.float32),
        g=cotangent.astype(jnp.float32),
        row_ids=experts.row_ids(slots),
        act=act,
        B=B,
        want=want,
        adapters=adapters,
    )

    carry: dict = {}
    if want_x:
        carry["x"] = jnp.zeros((T, H), jnp.float32)
    if want_out:
        carry["out_weight"] = jnp.zeros(M + B, jnp.float32)
    if want_scale:
        carry["in_scale"] = jnp.zeros(M + B, jnp.float32)
    if isinstance(base, PerExpert):
        # Unrolled over the parts: each read in place and its gradients formed in buffers of its own (a traced
        # index would copy the part in and its gradient out, several weight-sized passes per expert; a carried
        # accumulator of the adapters would pass through every part's cond).
        d_parts, d_loras = [], []
        for e, part in enumerate(base.parts):
            step = functools.partial(expert_step, e, part, first_row[e], counts[e])
            zeros = (
                _zeros_like_floats(part) if want_base else None,
                _zeros_like_floats(adapters.take(e)) if want_lora else None,
            )
            unused = lambda carry, zeros=zeros: (carry, *zeros)
            carry, d_part, d_lora = jax.lax.cond(counts[e] > 0, step, unused, carry)
            d_parts.append(d_part)
            d_loras.append(d_lora)
        d_base = PerExpert(tuple(_cotangent(p, d) for p, d in zip(base.parts, d_parts, strict=True)), base.fmt)
        d_lora = adapters.from_each(d_loras) if want_lora else None
    else:
        stacked = _Stacked(base, want_base)
        active = jnp.nonzero(counts > 0, size=E, fill_value=0)[0]  # [E] experts with pairs first
        if want_base:
            carry["base"] = stacked.zeros()
        if want_lora:
            carry["lora"] = adapters.zeros()

        def used_expert(u: Array, carry: dict) -> dict:
            e = active[u]
            rest = {k: v for k, v in carry.items() if k not in ("base", "lora")}
            rest, d_one, d_lora = expert_step(e, stacked.take(e), first_row[e], counts[e], rest)
            if want_base:
                rest["base"] = stacked.add(carry["base"], e, d_one)
            if want_lora:
                rest["lora"] = adapters.add(carry["lora"], e, d_lora)
            return rest

        carry = jax.lax.fori_loop(0, jnp.sum(counts > 0), used_expert, carry)
        d_base = stacked.cotangent(carry.get("base"))
        d_lora = carry.get("lora")

    unsort = lambda sorted_rows: jnp.zeros(M, jnp.float32).at[order].set(sorted_rows[:M]).reshape(T, K)
    d_experts = d_base if adapters is None else LoRAExperts(d_base, adapters.cotangent(d_lora))
    d_x = carry["x"].astype(x.dtype) if want_x else None
    d_in_scale = unsort(carry["in_scale"]).astype(slots.in_scale.dtype) if want_scale else None
    d_slots = Slots(
        np.zeros(slots.indices.shape, jax.dtypes.float0),
        unsort(carry["out_weight"]).astype(slots.out_weight.dtype) if want_out else None,
        d_in_scale,
        None if slots.adapter is None else np.zeros(slots.adapter.shape, jax.dtypes.float0),
    )
    return d_experts, d_x, d_slots


def _one_expert(e, one, start, count, carry, *, pairs, x, g, row_ids, act, B, want, adapters):
    """Expert e's pairs (sorted rows `[start, start + count)`, count > 0), `one` its weights: the block loop of
    the module docstring's step 2. Returns the carry, the gradient of `one`'s float leaves and that of the
    expert's adapters (each None when not wanted)."""
    floats, _, join = _split(one)
    dense, group = _float32_view(one)
    if want["base"]:
        dense, pull_back = jax.vjp(lambda fs: _float32_view(join(fs))[0], floats)
    lora = adapters.take(e) if adapters is not None else None
    end = start + count
    diff = [k for k, w in (("x", True), ("dense", want["base"]), ("lora", want["lora"])) if w]

    def block(j: Array, inner: dict) -> tuple[dict, Any]:
        """Block j's updates of the carry, and its gradient of the float32 weights (None when not wanted)."""
        r0 = start + j * B
        live = r0 + jnp.arange(B) < end  # [B]; rows past the expert's pairs are padding
        tok = jax.lax.dynamic_slice_in_dim(pairs["token"], r0, B)  # [B]
        xb = x[tok]  # [B, H]
        scale = None if pairs["in_scale"] is None else jax.lax.dynamic_slice_in_dim(pairs["in_scale"], r0, B)
        args = {"x": xb if scale is None else xb * scale[:, None], "dense": dense, "lora": lora}
        extra = () if row_ids is None else (row_ids[tok],)

        def ffn(*values):
            a = args | dict(zip(diff, values, strict=True))
            return _expert(a["dense"], group, a["lora"]).ffn(a["x"], act, *extra)

        yb, vjp_fn = jax.vjp(ffn, *(args[k] for k in diff))  # [B, H]
        gb = g[tok]  # [B, H]
        w = jax.lax.dynamic_slice_in_dim(pairs["out_weight"], r0, B)
        grads = dict(zip(diff, vjp_fn(jnp.where(live[:, None], w[:, None] * gb, 0.0)), strict=True))
        out = dict(inner)
        if want["out"]:
            out["out_weight"] = _masked_update(inner["out_weight"], jnp.sum(gb * yb, -1), live, r0)
        dx_in = jnp.where(live[:, None], grads["x"], 0.0)  # [B, H]
        if want["scale"]:
            out["in_scale"] = _masked_update(inner["in_scale"], jnp.sum(dx_in * xb, -1), live, r0)
        if want["x"]:
            out["x"] = inner["x"].at[tok].add(dx_in if scale is None else dx_in * scale[:, None])
        weights = {k: grads[k] for k in ("dense", "lora") if want["base" if k == "dense" else "lora"]}
        return out, weights

    def next_block(j: Array, inner: dict) -> dict:
        rest = {k: v for k, v in inner.items() if k != "weights"}
        rest, weights = block(j, rest)
        return rest | {"weights": jax.tree.map(jnp.add, inner["weights"], weights)}

    # The first block outside the loop: its weight gradients start the sums (no zeros to add to); count > 0.
    inner, weights = block(0, carry)
    inner["weights"] = weights
    inner = jax.lax.fori_loop(1, -(-count // B), next_block, inner)
    weights = inner.pop("weights")
    d_one = pull_back(weights["dense"])[0] if want["base"] else None
    d_lora = _split(weights["lora"])[0] if want["lora"] else None
    return inner, d_one, d_lora


def _zeros_like_floats(one: Any) -> list:
    return [jnp.zeros(jnp.shape(w), jnp.result_type(w)) for w in _split(one)[0]]


def _masked_update(buffer: Array, values: Array, live: Array, start: Array) -> Array:
    """`buffer[start:start + B] = values` on the live rows only (the padding rows belong to the next expert)."""
    old = jax.lax.dynamic_slice_in_dim(buffer, start, values.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(live, values, old), start, 0)
