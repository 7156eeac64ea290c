"""Routed-expert plans for XLA:CPU that read every expert's weights in place: `switch_decode`, `switch_grouped`.

Both compute `Σ_k out_weight[t, k] · E_{indices[t, k]}(rows)` as float32 `[T, H]`. They are format-agnostic: one
callable per expert, `expert_fns[e](rows [R, H]) -> [R, H] float32` (R static), closing over that expert's OWN
arrays, dispatched with `jax.lax.switch`. Everything stays on device inside jit: static shapes, loop trip counts
are device values, one compiled program per input shape. The dense experts they run on CPU are
`moejax.weights.FusedExpertWeights` (Hugging Face layout, gate and up fused: the fastest measured for them).

Measurements quoted: jax 0.10.2 XLA:CPU on this 2-core VM (shared with other jobs, so each number is the minimum
over interleaved rounds; weights evicted from the 480 MB L3 before every call), Qwen3-30B-A3B sizes (H=2048,
I=768, E=128, K=8) unless said; the benchmark script lives outside the repository.

Why a switch over per-expert callables: a `dynamic_index` of a stacked `[E, H, I]` tensor is copied before the
dot (10.5 GB/s vs 22-23 GB/s in place, eight `[1, 2048] x [2048, 768]` products) and in bfloat16 XLA hoists a
convert of the WHOLE stacked tensor (70x slower); a switch branch closing over expert e's arrays hands the dot
those buffers directly.

Decode, `switch_decode` (T <= 8 rows, T·K <= 64 slots; weight reads dominate):
  1. Union of the chosen experts by pairwise comparison of the T·K ids (no sort); ids outside [0, E) are skipped
     and never computed.
  2. The rows of union expert u: each row once however many of its slots chose u, and rows with bit-identical
     inputs (x and input scale) once (8 copies of one token compute one row per expert). They are padded, with
     a copy of u's first row, to the smallest ROW CLASS that holds them: float32 {2, 4, T}, so an expert chosen
     by one row multiplies 2 rows, not T (YNNPACK `[M,2048]x[2048,768]`: 0.75 ms at M=2, 0.94 at M=8).
  3. Union experts are sorted by (expert group, row class); each (group, class) segment is one `fori_loop` over a
     device count with one `lax.switch` over the group's <= SWITCH_GROUP experts: every union expert runs once,
     so its weights are read once per step.
  4. Each row gathers its slots' results and sums them in slot order.

Grouped, `switch_grouped` (prefill, any T; arithmetic and per-call overheads dominate):
  1. (token, slot) pairs are sorted by expert (stable; skipped ids last, never computed).
  2. Expert e's n pairs become `n // B` full blocks of B rows and one tail block of the smallest class >= the
     remainder. Classes are (1, 1.25, 1.5) x the mean pairs per expert in multiples of 8, at least
     GROUPED_MIN_ROWS: most experts get ONE block, because a block's fixed cost dwarfs padding (YNNPACK packs
     each weight matrix on every call: a `[M,2048]x[2048,768]` product costs ~0.95 ms + 0.0105 ms·M, so one
     extra block costs as much as ~90 padded rows; M=16/32/64/128/256: 1.1/1.4/1.5/2.3/3.6 ms).
  3. Blocks run through the same (group, class) loops; each scatters its real rows to pair order (padding rows
     are dropped).
  4. Each row sums its slots in slot order.

LoRA (`adapter=`): the expert fns take the rows' adapter ids too and add each row's deltas (`moejax.lora.expert_ffn`);
the plans only route the ids with the rows, and never merge rows of different adapters in decode.

Semantics: `in_scale` (Llama-4: the routing weight scales the expert input) uses the SUMMED-SCALE form: a row that
picks expert e in several slots runs e once on `(Σ_{k: idx=e} in_scale[t, k]) · x[t]` (rounded to the dtype of x)
and each of those slots takes that result times its own `out_weight` (as `moejax.experts.reference_routed`).
Slots with `out_weight == 0` or a skipped id contribute exactly 0, even when the expert output is not finite.

Batch invariance (for a fixed T a row's bits do not depend on the other rows): a row's result comes from its own
row of an expert call and is combined over its own slots in slot order, so it holds when the expert's row results
do not depend on R (the rows in the call) nor on the row's position. Measured on XLA:CPU: float32 YNNPACK dots
(every M >= 2) are bitwise consistent, M = 1 (XLA's own GEMV) is not; YNNPACK's bfloat16 dots switch kernels with
M (M=2 vs M>=3 at 2048x768, M<=5 vs M>=6 at 40x56), hence ONE class per T for non-float32 x (rows padded to T)
and grouped classes >= 16; `FusedExpertWeights` pads 2..8 float32 rows to 8 (its reduction splits differently at
<=4 and >=5 rows at 7168x2048) and says so (`padded_rows`), so the plan compiles one class for them. At T = 1 a
row has no neighbours, so its single-row products may use XLA's GEMV.

Compile time (limit 10 s at E=256) shaped the structure:
  * Many branches in one conditional make XLA's copy insertion superlinear: a 256-way FFN switch in a
    `fori_loop` compiles in 2.5-3.9 s, four loops of 64-way switches in 0.7 s; 1024 one-dot branches in one
    switch take 30 s. Hence SWITCH_GROUP = 64 experts per switch and one switch per (group, class).
  * Every row class is another copy of every expert's code: classes are few (<= 3), and the plan merges classes
    an expert fn declares equal-cost (`padded_rows`).
  * Single-row products compile to XLA's LLVM GEMV (~13 ms each; 768 at E=256: 10-18 s), so T = 1 uses them
    only up to GEMV_MAX_EXPERTS experts and float32 x; otherwise 2 rows (a duplicated row).

Tried and dropped (measured): two independent chains of loops to use both cores (XLA:CPU's thunk executor runs
independent top-level thunks concurrently, e.g. 24 independent GEMVs 1.8x faster than chained, but never two
while loops, two switches in one loop body, nor the thunks of one branch: cpu/wall stayed 1.0), so expert work
runs on one core; `[in, out]` weights for decode (XLA's column GEMV: 0.64 vs 0.45 ms per float32 product,
T=1 2.6-2.9x slower with gate/up fused); YNNPACK dots for 2..8 float32 rows (0.97 / 1.26 ms at 2 / 8 rows vs
0.74 / 0.78 ms for the multiply-reduce of `FusedExpertWeights`); classes {2, 8} or {T} instead of {2, 4, 8} for
float32 dot experts at T=8 (1.14x / ~1.5x the time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode import union_of_experts

Array = jax.Array
ExpertFn = Callable[[Array], Array]

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
      step: `step(r, call, item, carry) -> carry`; `call(e, rows [r, H], *extra) -> [r, H] float32` runs
        expert e (traced, within the loop's group) through one `lax.switch` over the group's experts, as
        `expert_fns[e](rows, *extra)` (extra: the rows' adapter ids with LoRA).
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
    expert_fns: Sequence[ExpertFn],
    x: Array,
    indices: Array,
    in_scale: Array | None,
    out_weight: Array,
    *,
    adapter: Array | None = None,
    row_classes: Sequence[int] | None = None,
    padded_rows: int = 1,
) -> Array:
    """Routed output reading each chosen expert once, on the rows that chose it (see the module docstring).

    Args:
      expert_fns: E callables; `expert_fns[e](rows [R, H])` (R static, dtype of x) -> `[R, H]` float32.
      x: `[T, H]` float32 or bfloat16, T <= DECODE_MAX_ROWS.
      indices: `[T, K]` int32, T·K <= DECODE_MAX_SLOTS; ids outside [0, E) are skipped (never computed).
      in_scale: `[T, K]` float32 or None; if given, the expert input of slot (t, k) is scaled by it (the
        summed-scale form for a row that picks an expert twice).
      out_weight: `[T, K]` float32, the weight of each slot's output (0 for skipped slots).
      adapter: `[T]` int32 LoRA adapter ids of the rows, or None. When given, the expert fns are called
        `expert_fns[e](rows, ids [R])` with each computed row's id (padding rows repeat a real row and its id),
        and rows with bit-identical inputs share a computed row only when their ids are equal too.
      row_classes: override of `decode_row_classes` (ascending static row counts, the last >= T unless T = 1).
      padded_rows: the expert fns run 2..padded_rows rows at the cost of padded_rows (they pad them): the plan
        compiles one row class for that range (`ExpertFormat.padded_rows`).

    Returns:
      `[T, H]` float32.
    """
    T, K = indices.shape
    E, H, M = len(expert_fns), x.shape[-1], T * K
    classes = tuple(sorted(set(row_classes or decode_row_classes(T, E, x.dtype))))
    if padded_rows > 1 and row_classes is None:  # 2..padded_rows rows cost the same: one class for them
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
    if adapter is not None:  # rows of different adapters compute different results
        same_input &= (adapter[:, None] == adapter[None, :])[None]
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
        extra = () if adapter is None else (adapter[row_list[u, :r]],)
        y = call(union_ids[u], rows, *extra)  # [r, H]
        return jax.lax.dynamic_update_slice(out, y[None], (u, 0, 0))

    outs = _segment_loops(expert_fns, classes, key, step, jnp.zeros((U, R, H), jnp.float32))
    per_slot = outs[slot_pos, slot_rank]  # [T, K, H]
    return _combine(per_slot, out_weight, valid)


def switch_grouped(
    expert_fns: Sequence[ExpertFn],
    x: Array,
    indices: Array,
    in_scale: Array | None,
    out_weight: Array,
    *,
    adapter: Array | None = None,
    row_classes: Sequence[int] | None = None,
    padded_rows: int = 1,
) -> Array:
    """Routed output over (token, slot) pairs sorted by expert, in blocks (see the module docstring).

    Args:
      expert_fns: E callables; `expert_fns[e](rows [R, H])` (R static, dtype of x) -> `[R, H]` float32.
      x: `[T, H]` float32 or bfloat16, any T.
      indices: `[T, K]` int32; ids outside [0, E) are skipped (never computed).
      in_scale: `[T, K]` float32 or None (summed-scale form, as in `switch_decode`).
      out_weight: `[T, K]` float32.
      adapter: `[T]` int32 LoRA adapter ids of the rows, or None; when given the expert fns are called
        `expert_fns[e](rows, ids [R])`, each block row with its pair's token's id (padding rows' results dropped).
      row_classes: override of `grouped_row_classes` (block row counts; the largest is the full block).
      padded_rows: as in `switch_decode`; blocks have at least GROUPED_MIN_ROWS > padded_rows rows.

    Returns:
      `[T, H]` float32.
    """
    T, K = indices.shape
    E, H, M = len(expert_fns), x.shape[-1], T * K
    classes = tuple(sorted(set(row_classes or grouped_row_classes(M, E))))
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
        extra = () if adapter is None else (adapter[pairs // K],)
        y = call(block_expert[b], xb, *extra)  # [r, H]
        dest = jnp.where(jnp.arange(r) < block_real[b], pairs, M + jnp.arange(r))  # padding rows: dropped
        return out.at[dest].set(y, mode="drop", unique_indices=True)

    per_pair = _segment_loops(expert_fns, classes, key, step, jnp.zeros((M, H), jnp.float32))
    return _combine(per_pair.reshape(T, K, H), out_weight, valid)
