"""The "cpu_decode" and "cpu_grouped" backends: the routed experts on XLA:CPU, weights read in place.

`switch_decode` and `switch_grouped` compute `Σ_k out_weight[t, k] · E_{indices[t, k]}(rows)` as float32 `[T, H]`
over one callable per expert, `expert_fns[e](rows [R, H], *ids) -> [R, H]` (R static), closing over expert e's
own arrays (the per-expert layout, `moejax.weights.PerExpert`) and dispatched by `jax.lax.switch`: XLA:CPU hands
such a branch's dot the expert's buffers, where a slice of a stacked array is copied first. Static shapes, loop
trip counts on the device, one program per input shape.

Decode (T <= 8 rows, T·K <= 64 slots): the union of the chosen experts (pairwise comparison, no sort); each union
expert runs once on the rows that chose it (rows with bit-identical inputs and ids once), padded to the smallest
row class that holds them, in one `fori_loop` per (switch group, row class). Grouped (any T): pairs sorted by
expert, each expert's pairs in blocks (full blocks and one tail block of the smallest class), through the same
loops. Each row sums its slots in slot order, so a row's bits do not depend on the other rows (batch
invariance: the row classes keep every dot's row count in a range where its bits do not change). `in_scale` uses
the summed-scale form: a row that picks expert e in several slots runs e once on `(Σ scales) · x`. Slots with
weight 0 or a skipped id contribute exactly 0. The measurements behind the row classes, SWITCH_GROUP and
GEMV_MAX_EXPERTS are in docs/DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.slots import Slots
from moejax.weights import Experts
from pallas_kernels.activations import GatedActivation
from pallas_kernels.gpu_decode import union_of_experts

Array = jax.Array
ExpertFn = Callable[..., Array]

SWITCH_GROUP = 64  # experts per lax.switch (compile time, see the module docstring)
GEMV_MAX_EXPERTS = 128  # T = 1 float32 uses 1-row products (XLA GEMV) up to this many experts
GROUPED_MIN_ROWS = 16  # smallest block of the grouped plan


def decode_row_classes(num_rows: int, num_experts: int, dtype) -> tuple[int, ...]:
    """Row counts of the decode plan's expert calls (ascending; an expert gets the smallest that holds its rows).

    Args:
      num_rows: T, rows of the batch.
      num_experts: E; at T = 1, float32 x gets 1-row products (XLA's GEMV, the fastest float32 kernel, but
        ~13 ms of LLVM time each to compile) up to GEMV_MAX_EXPERTS experts, else 2 rows (a duplicated row,
        YNNPACK; XLA's bfloat16 GEMV reads ~2x slower than YNNPACK's bfloat16 dots).
      dtype: dtype of x; float32 gets several classes for T >= 2 (its dot rows are bitwise equal for every
        M >= 2), other dtypes one class (YNNPACK's bfloat16 kernels change with M).
    """
    if num_rows == 1:
        return (1,) if np.dtype(dtype) == np.float32 and num_experts <= GEMV_MAX_EXPERTS else (2,)
    if np.dtype(dtype) == np.float32:
        return (*(r for r in (2, 4) if r < num_rows), num_rows)
    return (num_rows,)


def grouped_row_classes(num_pairs: int, num_experts: int) -> tuple[int, ...]:
    """Block row counts of the grouped plan: about (1, 1.25, 1.5) x the mean pairs per expert, multiples of 8.

    At least GROUPED_MIN_ROWS: bfloat16 dots switch kernels at small M, and `FusedExpertWeights` runs <= 8
    rows as a reduction; every class above both keeps a row's bits independent of its block.
    """
    up8 = lambda v: max(GROUPED_MIN_ROWS, -(-int(v) // 8) * 8)
    mean = up8(-(-num_pairs // max(1, num_experts)))
    return tuple(sorted({mean, up8(1.25 * mean), up8(1.5 * mean)}))


def _valid(indices: Array, num_experts: int) -> Array:
    return (indices >= 0) & (indices < num_experts)


def summed_in_scale(indices: Array, valid: Array, in_scale: Array) -> Array:
    """`[T, K]` float32: per slot, the sum of the input scales of its row's valid slots with the same expert."""
    same = (indices[:, :, None] == indices[:, None, :]) & valid[:, :, None] & valid[:, None, :]  # [T, K, K]
    return jnp.einsum("tkj,tj->tk", same.astype(jnp.float32), in_scale.astype(jnp.float32))


def _scaled(rows: Array, scale: Array) -> Array:
    """`scale[r] · rows[r]` computed in float32, rounded back to the dtype of the rows."""
    return (rows.astype(jnp.float32) * scale[:, None]).astype(rows.dtype)


def _combine(per_slot: Array, out_weight: Array, valid: Array) -> Array:
    """`Σ_k w[t, k] · y[t, k]`, `[T, K, H] -> [T, H]`, in slot order; weight-0 and invalid slots give exact 0."""
    keep = valid & (out_weight != 0)
    w = out_weight.astype(jnp.float32)[..., None]
    return jnp.where(keep[..., None], w * per_slot, 0.0).sum(1)


def _groups(num_experts: int) -> tuple[int, int]:
    """(experts per switch, number of groups)."""
    size = min(num_experts, SWITCH_GROUP)
    return size, -(-num_experts // size)


def _segment_loops(
    expert_fns: Sequence[ExpertFn],
    classes: Sequence[int],
    key_of_item: Array,
    step: Callable[[int, Callable[[Array, Array], Array], Array, Array], Array],
    carry: Array,
) -> Array:
    """Run `step` on every item, items ordered by (expert group, row class): one fori_loop per (group, class).

    Args:
      expert_fns: the E expert callables.
      classes: the static row counts, ascending.
      key_of_item: `[N] int32`, `class_index * G + group` of each item to run, `>= C * G` for items to skip.
      step: `step(r, call, item, carry) -> carry`; `call(e, rows [r, H], *ids) -> [r, H] float32` runs
        expert e (traced, within the loop's group) through one `lax.switch` over the group's experts, as
        `expert_fns[e](rows, *ids)` (ids: the rows' ids, when the experts read them).
      carry: the initial carry.

    Returns:
      The final carry.
    """
    size, G = _groups(len(expert_fns))
    C = len(classes)
    order = jnp.argsort(key_of_item, stable=True).astype(jnp.int32)
    seg_count = jnp.bincount(jnp.minimum(key_of_item, C * G), length=C * G + 1)[: C * G].astype(jnp.int32)
    seg_start = jnp.cumsum(seg_count, dtype=jnp.int32) - seg_count
    for g in range(G):
        branches = [lambda *v, f=f: f(*v).astype(jnp.float32) for f in expert_fns[g * size : (g + 1) * size]]

        def call(e: Array, rows: Array, *extra: Array, branches=branches, base=g * size) -> Array:
            return jax.lax.switch(e - base, branches, rows, *extra)

        for ci, r in enumerate(classes):
            s = ci * G + g
            carry = jax.lax.fori_loop(
                seg_start[s],
                seg_start[s] + seg_count[s],
                lambda j, c, r=r, call=call: step(r, call, order[j], c),
                carry,
            )
    return carry


def switch_decode(
    expert_fns: Sequence[ExpertFn], x: Array, slots: Slots, row_ids: Array | None = None, *, padded_rows: int = 1
) -> Array:
    """Routed output `[T, H]` float32 reading each chosen expert once, on the rows that chose it.

    Args:
      expert_fns: E callables; `expert_fns[e](rows [R, H], *ids)` (R static, dtype of x) -> `[R, H]` float32.
      x: `[T, H]` float32 or bfloat16, T <= 8.
      slots: `[T, K]` expert ids (T·K <= 64; ids outside [0, E) are skipped, never computed), output weights and
        optional input scales (summed-scale form); `slots.adapter` is not read.
      row_ids: `[T]` int32 ids of the rows, or None. When given, the expert fns are called
        `expert_fns[e](rows, ids [R])` with each computed row's id (padding rows repeat a real row and its id),
        and rows with bit-identical inputs share a computed row only when their ids are equal too.
      padded_rows: the expert fns run 2..padded_rows rows at the cost of padded_rows (they pad them): the plan
        compiles one row class for that range (`ExpertFormat.padded_rows`).
    """
    indices, in_scale, out_weight = slots.indices, slots.in_scale, slots.out_weight
    T, K = indices.shape
    E, H, M = len(expert_fns), x.shape[-1], T * K
    classes = decode_row_classes(T, E, x.dtype)
    if padded_rows > 1:  # 2..padded_rows rows cost the same: one class for them
        small = [c for c in classes if 2 <= c <= padded_rows]
        classes = tuple(sorted({c for c in classes if not 2 <= c <= padded_rows} | set(small[-1:])))
    R = classes[-1]
    if R < T:
        raise ValueError(f"the largest row class {R} must hold all {T} rows")
    valid = _valid(indices, E)
    union_ids, n_union, slot_pos = union_of_experts(indices, E)  # ids outside [0, E) are left out
    U = min(M, E)  # at most this many distinct experts
    union_ids = union_ids[:U]
    member = (slot_pos[None] == jnp.arange(U)[:, None, None]) & valid[None]  # [U, T, K]
    hit = member.any(-1)  # [U, T]: row t chose union expert u
    # Rows with the same input (bit-identical x and input scale) share one computed row of u.
    bits = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    same_input = jnp.all(bits[:, None, :] == bits[None, :, :], axis=-1)[None] & hit[:, None, :]  # [U, T, T']
    if in_scale is not None:
        row_scale = jnp.einsum("utk,tk->ut", member.astype(jnp.float32), in_scale.astype(jnp.float32))  # [U, T]
        same_input &= row_scale[:, :, None] == row_scale[:, None, :]
    if row_ids is not None:  # rows of different ids compute different results
        same_input &= (row_ids[:, None] == row_ids[None, :])[None]
    shared_with = jnp.argmax(same_input, axis=-1)  # [U, T]: the first row of u with row t's input
    computed = hit & (shared_with == jnp.arange(T))  # [U, T]: rows u computes
    count = computed.sum(-1, dtype=jnp.int32)  # [U]
    rank = jnp.cumsum(computed, axis=-1, dtype=jnp.int32) - 1  # [U, T]
    at_rank = computed[:, :, None] & (rank[:, :, None] == jnp.arange(R))  # [U, T, R]
    row_list = jnp.einsum("utr,t->ur", at_rank.astype(jnp.int32), jnp.arange(T, dtype=jnp.int32))  # [U, R]
    row_list = jnp.where(jnp.arange(R) < count[:, None], row_list, row_list[:, :1])  # pad: u's first row
    t_index = jnp.arange(T)[:, None]
    slot_rank = jnp.take_along_axis(rank, shared_with, axis=1)[slot_pos, t_index]  # [T, K]
    if in_scale is not None:
        list_scale = jnp.take_along_axis(row_scale, row_list, axis=1)  # [U, R]
    size, G = _groups(E)
    cls = jnp.searchsorted(jnp.array(classes, jnp.int32), count).astype(jnp.int32)  # [U]
    key = jnp.where(jnp.arange(U) < n_union, cls * G + union_ids // size, len(classes) * G).astype(jnp.int32)

    def step(r: int, call, u: Array, out: Array) -> Array:
        rows = x[row_list[u, :r]]  # [r, H]
        if in_scale is not None:
            rows = _scaled(rows, list_scale[u, :r])
        ids = () if row_ids is None else (row_ids[row_list[u, :r]],)
        y = call(union_ids[u], rows, *ids)  # [r, H]
        return jax.lax.dynamic_update_slice(out, y[None], (u, 0, 0))

    outs = _segment_loops(expert_fns, classes, key, step, jnp.zeros((U, R, H), jnp.float32))
    per_slot = outs[slot_pos, slot_rank]  # [T, K, H]
    return _combine(per_slot, out_weight, valid)


def switch_grouped(
    expert_fns: Sequence[ExpertFn], x: Array, slots: Slots, row_ids: Array | None = None, *, padded_rows: int = 1
) -> Array:
    """Routed output `[T, H]` float32 over (token, slot) pairs sorted by expert, in blocks of
    `grouped_row_classes` rows, any T; arguments as `switch_decode` (each block row carries its pair's token's
    id; padding rows' results are dropped). Blocks have at least GROUPED_MIN_ROWS > padded_rows rows."""
    indices, in_scale, out_weight = slots.indices, slots.in_scale, slots.out_weight
    T, K = indices.shape
    E, H, M = len(expert_fns), x.shape[-1], T * K
    classes = grouped_row_classes(M, E)
    if classes[0] <= padded_rows:
        raise ValueError(f"block row classes {classes} must exceed the experts' padded_rows={padded_rows}")
    B, C = classes[-1], len(classes)
    valid = _valid(indices, E)
    expert_of_pair = jnp.where(valid, indices, E).reshape(-1)  # [M]; skipped -> E (sorted last)
    pair_order = jnp.argsort(expert_of_pair, stable=True).astype(jnp.int32)  # [M] the pair at each sorted row
    counts = jnp.bincount(expert_of_pair, length=E + 1)[:E].astype(jnp.int32)  # [E]
    full_blocks, remainder = counts // B, counts % B
    blocks = full_blocks + (remainder > 0)
    first_block = jnp.cumsum(blocks) - blocks
    first_row = jnp.cumsum(counts) - counts
    max_blocks = -(-M // B) + E  # static bound on Σ ceil(count / B)
    block_ids = jnp.arange(max_blocks)
    block_expert = jnp.clip(jnp.searchsorted(first_block + blocks, block_ids, side="right"), 0, E - 1)
    nth = block_ids - first_block[block_expert]  # index of the block within its expert
    row_start = (first_row[block_expert] + nth * B).astype(jnp.int32)
    is_full = nth < full_blocks[block_expert]
    block_real = jnp.where(is_full, B, remainder[block_expert]).astype(jnp.int32)  # real rows of the block
    tail_class = jnp.searchsorted(jnp.array(classes, jnp.int32), remainder)  # [E]
    block_class = jnp.where(is_full, C - 1, tail_class[block_expert])
    size, G = _groups(E)
    key = jnp.where(block_ids < jnp.sum(blocks), block_class * G + block_expert // size, C * G).astype(jnp.int32)
    if in_scale is not None:
        pair_scale = summed_in_scale(indices, valid, in_scale).reshape(-1)  # [M]

    def step(r: int, call, b: Array, out: Array) -> Array:
        pairs = pair_order[jnp.minimum(row_start[b] + jnp.arange(r), M - 1)]  # [r]
        xb = x[pairs // K]  # [r, H]
        if in_scale is not None:
            xb = _scaled(xb, pair_scale[pairs])
        ids = () if row_ids is None else (row_ids[pairs // K],)
        y = call(block_expert[b], xb, *ids)  # [r, H]
        dest = jnp.where(jnp.arange(r) < block_real[b], pairs, M + jnp.arange(r))  # padding rows: dropped
        return out.at[dest].set(y, mode="drop", unique_indices=True)

    per_pair = _segment_loops(expert_fns, classes, key, step, jnp.zeros((M, H), jnp.float32))
    return _combine(per_pair.reshape(T, K, H), out_weight, valid)


def _expert_fns(experts: Experts, act: GatedActivation) -> list[ExpertFn]:
    """One callable per expert of the per-expert layout; `NotImplementedError` for the stacked layout. Expert e's
    object is made inside its switch branch, so a wrapper's per-expert slices stay in the branch."""
    if experts.layout != "per_expert":
        raise NotImplementedError(
            "the CPU plans read the per-expert layout (moejax.weights.to_layout(experts, 'per_expert'))"
        )
    return [lambda rows, *ids, e=e: experts.expert(e).ffn(rows, act, *ids) for e in range(experts.num_experts)]


def cpu_decode(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """The "cpu_decode" backend: `switch_decode` over the per-expert layout (`block_rows` is ignored)."""
    del block_rows
    fns = _expert_fns(experts, act)
    return switch_decode(fns, x, slots, experts.row_ids(slots), padded_rows=experts.padded_rows)


def cpu_grouped(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """The "cpu_grouped" backend: `switch_grouped` over the per-expert layout (`block_rows` is ignored: the
    blocks are the plan's row classes)."""
    del block_rows
    fns = _expert_fns(experts, act)
    return switch_grouped(fns, x, slots, experts.row_ids(slots), padded_rows=experts.padded_rows)
