"""The "xla_decode" and "xla_grouped" backends: union-of-experts decode and grouped prefill on the stacked layout.

Both compute `Σ_k w_k · E_{idx_k}(s_k · x)` as float32 `[T, H]` from the narrow `Slots` (ids, input scales,
output weights) and the `GatedActivation`. They read expert weights only through the format's `expert(e)` view
(traced e, stacked layout; XLA:CPU copies such a slice before its dot, which is why the CPU backend,
`moejax.backends.cpu`, reads the per-expert layout); experts that read per-row ids (`row_ids`) get each row's.
Each row is combined over its own slots in slot order, and every expert call has a row count fixed by the shapes
(T rows in decode, B in grouped), so for a given T a row's output does not depend on the other rows of the batch
(batch invariance). Neither sorts on the host or syncs: every shape is static, loop trip counts are device values.

Decode (T <= 8 rows, T·K <= 64 slots): weight reads dominate, so each expert chosen by any row is read once.
  1. Dedupe the T·K selected ids into the union with a pairwise comparison (no sort): a slot is a "first"
     when no earlier slot chose the same expert; firsts are compacted into `union_ids[:n_union]`.
  2. `fori_loop(0, n_union)`: read union expert u's gate/up/down once, apply it to all T rows -> `Y[u] [T, H]`.
     Slots past n_union are never visited, so their weights are never read.
  3. Row t takes `Y[position of its slot k's expert, t]` for each slot and sums them with its weights.

Grouped (prefill, any T): arithmetic dominates, so (token, slot) pairs are sorted by expert and multiplied in
blocks per expert (dropless: an expert with n pairs gets ceil(n / B) blocks).
  1. Stable argsort of the pairs by expert id (ids outside [0, E) sort last and are never computed).
  2. Block b belongs to expert `block_expert[b]` and covers sorted rows `[row_start[b], row_start[b] + B)`; a
     `fori_loop` over the real blocks (a device count) gathers those rows' tokens, runs the expert, and writes
     the rows back in sorted order. Blocks run in expert order, so padding rows that spill into the next
     expert's range are overwritten by that expert's own block.
  3. Un-sort to `[T, K, H]` and sum each row's slots with its weights.
Every block has the same B rows (B depends on T, K and E only), the expert's last one padded: XLA's dots give
a row different bits for different row counts (float32 too), so a block sized to its expert's remainder would
make a row's output depend on how many other rows chose its expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.slots import Slots, combine_slots
from moejax.weights import Experts
from pallas_kernels.activations import GatedActivation
from pallas_kernels.gpu_decode import union_of_experts

Array = jax.Array

DECODE_MAX_ROWS = 8
DECODE_MAX_SLOTS = 64


def computed_slots(indices: Array, num_experts: int) -> Array:
    """`[T, K]` bool: the slots whose id is an expert of the plan, in [0, E). The others (zero experts, experts
    on other devices, negative ids of a replayed or hand-made routing) are skipped: never computed, and their
    output weight is taken as 0 whatever it holds, since what the plans leave in their rows is another
    expert's output (union expert 0 in decode, a padding spill in grouped)."""
    return (indices >= 0) & (indices < num_experts)


def decode_fits(num_rows: int, top_k: int) -> bool:
    """Whether the decode plan serves `num_rows` rows of `top_k` slots (its static buffers hold T·K slots)."""
    return num_rows <= DECODE_MAX_ROWS and num_rows * top_k <= DECODE_MAX_SLOTS


def decode_plan(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """Routed output `[T, H]` float32 reading each selected expert once (see the module docstring); union expert
    u runs on all T rows (with their ids, `row_ids`). `block_rows` is ignored.

    Raises:
      NotImplementedError: more than DECODE_MAX_ROWS rows or DECODE_MAX_SLOTS slots.
    """
    del block_rows
    T, K = slots.indices.shape
    if not decode_fits(T, K):
        raise NotImplementedError(f"xla_decode serves T <= 8 rows and T·K <= 64 slots, got T={T}, K={K}")
    ids = experts.row_ids(slots)
    experts = experts.stacked()
    extra = () if ids is None else (ids,)
    M = T * K
    E = experts.num_experts
    valid = computed_slots(slots.indices, E)
    union_ids, n_union, slot_position = union_of_experts(slots.indices, E)
    if slots.in_scale is not None:
        # Row t's input scale for union expert u (summed over its slots that chose u).
        hit = slot_position[None] == jnp.arange(M)[:, None, None]  # [M, T, K]
        hit &= valid[None]
        row_scale = jnp.einsum("utk,tk->ut", hit.astype(jnp.float32), slots.in_scale)  # [M, T]

    def one_union_expert(u: Array, outputs: Array) -> Array:
        rows = x if slots.in_scale is None else x * row_scale[u][:, None]
        y = experts.expert(union_ids[u]).ffn(rows, act, *extra)  # [T, H]
        return jax.lax.dynamic_update_index_in_dim(outputs, y, u, 0)

    outputs = jnp.zeros((M, T, x.shape[-1]), jnp.float32)  # [M, T, H]
    outputs = jax.lax.fori_loop(0, n_union, one_union_expert, outputs)
    per_slot = outputs[slot_position, jnp.arange(T)[:, None]]  # [T, K, H]; a skipped slot reads union expert 0
    return combine_slots(per_slot, jnp.where(valid, slots.out_weight, 0.0))


def grouped_block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows of a block of the grouped plan: twice the mean pairs per expert, a power of two in [8, 128].

    Most experts then need one block.
    """
    mean = max(1, -(-num_pairs // num_experts))
    return int(min(128, max(8, 1 << (2 * mean - 1).bit_length())))


def grouped_plan(
    experts: Experts,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    *,
    block_rows: int | None = None,
) -> Array:
    """Routed output `[T, H]` float32 over pairs sorted by expert, in blocks (see the module docstring).

    An expert with n pairs gets `ceil(n / B)` blocks of B = `block_rows` rows (the last one padded): each
    expert's weights are read `ceil(n / B)` times, and every expert call has B rows whatever the routing. Each
    block row carries its pair's token's id when the experts read ids (`row_ids`).
    """
    ids = experts.row_ids(slots)
    experts = experts.stacked()
    T, K = slots.indices.shape
    E, H, M = experts.num_experts, x.shape[-1], T * K
    B = block_rows or grouped_block_rows(M, E)

    valid = computed_slots(slots.indices, E)
    expert_of_pair = jnp.where(valid, slots.indices, E).reshape(-1)  # [M]; skipped ids -> E (sorted last)
    order = jnp.argsort(expert_of_pair, stable=True)  # [M] pair at each sorted row
    counts = jnp.bincount(expert_of_pair, length=E + 1)[:E]  # [E]
    blocks = -(-counts // B)  # [E]
    first_block = jnp.cumsum(blocks) - blocks  # [E]
    first_row = jnp.cumsum(counts) - counts  # [E]
    max_blocks = -(-M // B) + E  # static bound on Σ ceil(count / B)
    block_ids = jnp.arange(max_blocks)
    block_expert = jnp.clip(jnp.searchsorted(first_block + blocks, block_ids, side="right"), 0, E - 1)
    nth = block_ids - first_block[block_expert]  # index of the block within its expert
    row_start = first_row[block_expert] + nth * B

    pair_token = order // K  # [M] token of each sorted row
    pair_scale = None if slots.in_scale is None else slots.in_scale.reshape(-1)[order]  # [M]

    def one_block(b: Array, sorted_out: Array) -> Array:
        rows = jnp.minimum(row_start[b] + jnp.arange(B), M - 1)  # clamped padding rows
        xb = x[pair_token[rows]]  # [B, H]
        if pair_scale is not None:
            xb = xb * pair_scale[rows][:, None]
        e = block_expert[b]
        extra = () if ids is None else (ids[pair_token[rows]],)  # [B]
        yb = experts.expert(e).ffn(xb, act, *extra)  # [B, H]
        return jax.lax.dynamic_update_slice_in_dim(sorted_out, yb, row_start[b], 0)

    sorted_out = jnp.zeros((M + B, H), jnp.float32)  # B spare rows: a last block never clamps its start
    sorted_out = jax.lax.fori_loop(0, jnp.sum(blocks), one_block, sorted_out)
    per_pair = jnp.zeros((M, H), jnp.float32).at[order].set(sorted_out[:M])  # un-sort; skipped: a block's spill
    return combine_slots(per_pair.reshape(T, K, H), jnp.where(valid, slots.out_weight, 0.0))
