"""`EPAllToAll` (prefill): rows split over the expert axis (T padded to a multiple of n); each device routes its
T/n rows, sends each row once to every device holding one of its experts (in rounds of C rows per device pair),
computes the pairs of its own experts on what it received, P pairs at a time, and sends the partial sums back.
Buffers hold `capacity_factor` times the load of uniform routing; a heavier load runs more rounds or chunks (no
row is dropped). docs/DESIGN.md explains the sizes.

The transport (`_exchange`): the rows for each device are compacted at the front of its block of C, so a ragged
all-to-all (`jax.lax.ragged_all_to_all`) sends just them, and just their partial sums back; XLA:CPU has no
ragged all-to-all (jax 0.10.2: "HLO opcode `ragged-all-to-all` is not supported"), where `jax.lax.all_to_all`
moves the whole blocks. `transport="auto"` picks by the platform the program is lowered for: ragged on TPU and
CUDA, whole blocks elsewhere. Both give the same bits: a receiver reads only the rows that were sent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from moejax.analysis import expert_load
from moejax.dispatch.ep import ExpertParallel
from moejax.slots import Slots
from moejax.stats import MoEStats

Array = jax.Array
# The buffers hold 1.25x the load of uniform routing: room for the usual imbalance of a learned router
# within one round, while per-device memory still falls as 1/n (benchmarks/ep_memory.py).
CAPACITY_FACTOR = 1.25
Transport = Literal["auto", "ragged", "dense"]
TRANSPORTS = ("auto", "ragged", "dense")
# The collective of the "ragged" transport; one name here so that a test on CPU (which has none) can put an
# emulation of it in its place.
ragged_all_to_all = jax.lax.ragged_all_to_all


def check_capacity_factor(capacity_factor) -> None:
    if not (isinstance(capacity_factor, int | float) and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0")


def all_to_all_capacity(cfg, num_tokens: int, n: int, capacity_factor: float) -> tuple[int, int]:
    """Static buffer sizes of "all_to_all" mode: (rows per block and round, pairs per compute chunk).

    Sized for uniform routing: `capacity_factor` times its mean plus three standard deviations (the sampling noise
    of a few tokens). More is not dropped but costs another round (rows) or another chunk (pairs).

    Rows: each of a source device's T/n tokens visits device d when at least one of its K distinct experts lives
    there, with probability q = 1 - C(E - E/n, K) / C(E, K): a binomial count, at most T/n. Pairs: a device
    computes T·K/n pairs on average (about as many, as a count, as the variance), at most n·rows·K per round.
    """
    tokens_per_device = max(1, -(-num_tokens // n))
    E, K = cfg.num_experts, min(cfg.top_k, cfg.num_experts)
    misses = math.prod(max(0.0, 1 - (E / n) / (E - i)) for i in range(K))  # no expert of the token on d
    visits = (1 - misses) * tokens_per_device
    rows = math.ceil(capacity_factor * (visits + 3 * math.sqrt(visits * misses)))
    pairs = math.ceil(capacity_factor * (tokens_per_device * K + 3 * math.sqrt(tokens_per_device * K)))
    rows = min(tokens_per_device, max(1, rows))
    return rows, min(n * rows * K, max(1, pairs))


def check_transport(transport) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")


@dataclasses.dataclass(frozen=True)
class EPAllToAll(ExpertParallel):
    """Rows split over the expert axis, dispatched to and combined from the devices of their experts.

    `transport`: "ragged" sends only the rows each device needs (`jax.lax.ragged_all_to_all`: TPU, CUDA), "dense"
    whole blocks of C rows (`jax.lax.all_to_all`: any platform), "auto" ragged where the program is lowered for TPU
    or CUDA and dense elsewhere (CPU, ROCm)."""

    capacity_factor: float = CAPACITY_FACTOR
    transport: Transport = "auto"
    token_split = True

    def __post_init__(self) -> None:
        check_capacity_factor(self.capacity_factor)
        check_transport(self.transport)

    def routed_sum(self, step, x_e, slots, routing, *, cfg, num_tokens):
        """Per device: its `[T/n, H]` rows; dispatch, compute, return, combine -> (`[T/n, H]` float32, stats).

        `num_local` is the number of experts (or, with a placement, slots) per device; `ids` the expert (or slot)
        id of each pair. Per-row ids of the slots (`slots.adapter`) travel with their rows as one more column."""
        T_l, H = x_e.shape
        K, E, n = cfg.top_k, cfg.num_experts, self.num_devices
        rows_per_block, pairs_per_chunk = all_to_all_capacity(cfg, num_tokens, n, self.capacity_factor)
        num_local = step.num_experts
        me = jax.lax.axis_index(self.expert_axis)
        rows = me * T_l + jnp.arange(T_l)  # [T_l] global row index
        valid = rows < num_tokens  # [T_l] False on the padding rows
        real = (routing.indices < E) & valid[:, None]  # [T_l, K] slots that need an expert
        ids = routing.indices if self.placement is None else self.placement.physical_ids(routing.indices, rows)
        devices = jnp.arange(n)
        owner = jnp.where(real, ids // num_local, n)  # [T_l, K]; n: nobody
        needs = (owner[:, None, :] == devices[None, :, None]).any(-1)  # [T_l, n] token t visits device d
        # One weight per slot travels: the input scale where the family scales inputs (Llama-4), else the output.
        weight = slots.out_weight if slots.in_scale is None else slots.in_scale  # [T_l, K]

        # The visits to each device in token order, T_l past the last: visit v to d is sent in round v // C.
        num_rounds = -(-T_l // rows_per_block)
        rank = jnp.where(needs, jnp.cumsum(needs, axis=0) - 1, num_rounds * rows_per_block)  # [T_l, n]
        visits = jnp.full((n, num_rounds * rows_per_block), T_l, jnp.int32)
        visits = visits.at[devices[None, :], rank].set(jnp.arange(T_l, dtype=jnp.int32)[:, None], mode="drop")
        # Every device runs the same number of rounds (each round is a collective): enough for the busiest block.
        visits_to = needs.sum(0, dtype=jnp.int32)  # [n] rows this device sends to each device, over all rounds
        visits_from = jax.lax.all_to_all(visits_to, self.expert_axis, 0, 0, tiled=True)  # [n] it receives from each
        rounds = jax.lax.pmax(-(-visits_to.max() // rows_per_block), self.expert_axis)
        step = self.tensor_step(step)
        exchange = functools.partial(_exchange, axis=self.expert_axis, transport=self.transport)

        def one_round(r: Array, routed: Array) -> Array:
            token = jax.lax.dynamic_slice_in_dim(visits, r * rows_per_block, rows_per_block, 1)  # [n, C]
            sent = token < T_l
            token = jnp.minimum(token, T_l - 1)
            here = (owner[token] == devices[:, None, None]) & sent[..., None]  # [n, C, K] slots block d computes
            local_ids = jnp.where(here, ids[token] - devices[:, None, None] * num_local, num_local)
            local_w = jnp.where(here, weight[token], 0.0)
            # Ids travel in one int32 buffer; the weights in a float32 one of their own, so that gradients reach them
            # (and through them the router) by the exchange's transpose.
            columns = [local_ids]
            if slots.adapter is not None:  # the row's id travels with it
                columns.append(slots.adapter[token][..., None])
            meta = jnp.concatenate(columns, -1)  # [n, C, K (+1)]
            # This round's rows: block d's first `sent_to[d]` (they are compacted at the front of each block).
            sent_to = jnp.clip(visits_to - r * rows_per_block, 0, rows_per_block)  # [n]
            arrive_from = jnp.clip(visits_from - r * rows_per_block, 0, rows_per_block)  # [n]
            recv_x = exchange(x_e[token], sent_to, arrive_from)  # [n, C, H] block s: from device s
            recv_meta = exchange(meta, sent_to, arrive_from).reshape(n * rows_per_block, -1)
            recv_w = exchange(local_w, sent_to, arrive_from).reshape(n * rows_per_block, K)
            # Only the rows that arrived are read: past them a block holds zeros (ragged) or what the sender's
            # block held there (dense), so their slots are made "not here".
            arrived = (jnp.arange(rows_per_block) < arrive_from[:, None]).reshape(-1, 1)  # [n·C, 1]
            partial = _compute_received(
                step,
                recv_x.reshape(n * rows_per_block, H),
                jnp.where(arrived, recv_meta[:, :K], num_local),
                jnp.where(arrived, recv_w, 0.0),
                None if slots.adapter is None else recv_meta[:, K],
                cfg=cfg,
                pairs=pairs_per_chunk,
                in_scale=slots.in_scale is not None,
            )  # [n·C, H] float32
            back = exchange(partial.reshape(n, rows_per_block, H), arrive_from, sent_to)  # the way back
            return routed.at[jnp.where(sent, token, T_l)].add(back, mode="drop")

        routed = _repeat(one_round, rounds, num_rounds, jnp.zeros((T_l, H), jnp.float32))  # [T_l, H]
        if self.tensor_axis is not None:
            routed = jax.lax.psum(routed, self.tensor_axis)

        local_pairs = (owner == me).sum(dtype=jnp.int32)
        pairs_to = jnp.bincount(owner.reshape(-1), length=n + 1)[:n].astype(jnp.int32)  # [n] my pairs per device
        valid_ids = jnp.where(valid[:, None], routing.indices, -1)
        stats = MoEStats.from_load(
            jax.lax.psum(expert_load(valid_ids, cfg), self.expert_axis),
            tokens=num_tokens,
            top_k=K,
            device_load=jax.lax.psum(pairs_to, self.expert_axis)[me][None],
            local_pairs=local_pairs[None],
            remote_pairs=(real.sum(dtype=jnp.int32) - local_pairs)[None],
            remote_rows=(needs.sum(dtype=jnp.int32) - needs[:, me].sum(dtype=jnp.int32))[None],
        )
        return routed, stats


def _exchange(blocks: Array, send_sizes: Array, recv_sizes: Array, *, axis: str, transport: Transport) -> Array:
    """Swap blocks over `axis`: `blocks [n, C, ...]` holds in block d the rows for device d, the first
    `send_sizes[d]` of them filled; returns `[n, C, ...]` whose block s holds the `recv_sizes[s]` rows device s
    sent here, at its front; the rows past them are undefined (zeros or the sender's unfilled rows).

    "auto" is `jax.lax.platform_dependent`: only the branch of the platform the program is lowered for is kept
    (jax 0.10 prunes the others while lowering; a CPU program never holds a ragged all-to-all), and, unlike a
    primitive chosen while lowering, it is differentiable (JAX transposes both collectives)."""
    dense = functools.partial(_dense_exchange, axis=axis)
    ragged = functools.partial(_ragged_exchange, axis=axis)
    if transport == "dense":
        return dense(blocks, send_sizes, recv_sizes)
    if transport == "ragged":
        return ragged(blocks, send_sizes, recv_sizes)
    return jax.lax.platform_dependent(blocks, send_sizes, recv_sizes, tpu=ragged, cuda=ragged, default=dense)


def _dense_exchange(blocks: Array, send_sizes: Array, recv_sizes: Array, *, axis: str) -> Array:
    del send_sizes, recv_sizes  # whole blocks move
    return jax.lax.all_to_all(blocks, axis, 0, 0)


def _ragged_exchange(blocks: Array, send_sizes: Array, recv_sizes: Array, *, axis: str) -> Array:
    """Block d's first `send_sizes[d]` rows to device d, written there into block `me` (this device's index);
    block s here receives `recv_sizes[s]` rows from device s. One ragged all-to-all of the flattened blocks."""
    n, C = blocks.shape[:2]
    flat = blocks.reshape(n * C, *blocks.shape[2:])
    starts = jnp.arange(n, dtype=jnp.int32) * C  # block d begins at row d·C, here and on every device
    there = jnp.full((n,), jax.lax.axis_index(axis) * C, jnp.int32)  # where this device's rows land on each
    out = ragged_all_to_all(flat, jnp.zeros_like(flat), starts, send_sizes, there, recv_sizes, axis_name=axis)
    return out.reshape(blocks.shape)


def _repeat(body: Callable[[Array, Array], Array], trips: Array, max_trips: int, init: Array) -> Array:
    """`body` applied for `i` in `[0, trips)`, where `body` adds nothing on a trip past the work (so that when at
    most one trip is ever needed it runs once, with no loop: less to compile). A scan over the static bound with
    the trips past `trips` skipped by a cond: reverse-differentiable, unlike a loop of a data trip count."""
    if max_trips == 1:
        return body(jnp.int32(0), init)

    def trip(out: Array, i: Array) -> tuple[Array, None]:
        return jax.lax.cond(i < trips, body, lambda i, out: out, i, out), None

    return jax.lax.scan(trip, init, jnp.arange(max_trips, dtype=jnp.int32))[0]


def _compute_received(step, x: Array, ids: Array, weight: Array, row_ids: Array | None, *, cfg, pairs, in_scale):
    """The weighted partial sums `[R, H]` float32 of the received rows `x [R, H]` over their local slots.

    Only the local (token, slot) pairs are computed: they are compacted (in row order) into a list, which is run
    through the expert step `pairs` at a time, one slot per row (`Slots [pairs, 1]`), and each result is added to
    its row. A `while` loop over ceil(local pairs / pairs) chunks: a device that received more than the capacity
    computes it all, in more chunks.

    Args:
      ids: `[R, K]` local expert ids; >= the number of local experts: not here (another device's, or padding).
      weight: `[R, K]` each slot's output weight, or its input scale when `in_scale`.
      row_ids: `[R]` each received row's per-row id (`Slots.adapter`), or None.
    """
    R, K = ids.shape
    num_local = step.num_experts
    local = (ids < num_local).reshape(-1)  # [R·K]
    count = local.sum(dtype=jnp.int32)
    position = jnp.where(local, jnp.cumsum(local) - 1, R * K)
    pair_slot = jnp.zeros(R * K, jnp.int32).at[position].set(jnp.arange(R * K, dtype=jnp.int32), mode="drop")
    # The plan's blocks are sized for a chunk's expected load per local expert.
    num_pairs = -(-pairs * cfg.num_experts // num_local)

    def one_chunk(c: Array, out: Array) -> Array:
        index = c * pairs + jnp.arange(pairs)
        live = index < count  # [pairs] False past the last local pair
        flat = jnp.where(live, pair_slot[jnp.minimum(index, R * K - 1)], 0)  # [pairs] into [R·K]
        row = flat // K
        chunk_ids = jnp.where(live, ids.reshape(-1)[flat], num_local)[:, None]  # [pairs, 1]
        chunk_w = jnp.where(live, weight.reshape(-1)[flat], 0.0)[:, None]
        # Llama-4 scales the input by the routing weight and sums the outputs unweighted.
        slots = Slots(chunk_ids, live[:, None].astype(jnp.float32), chunk_w) if in_scale else Slots(chunk_ids, chunk_w)
        if row_ids is not None:
            slots = dataclasses.replace(slots, adapter=row_ids[row])
        y = step(x[row], slots, num_pairs=num_pairs)  # [pairs, H]
        return out.at[jnp.where(live, row, R)].add(y, mode="drop")

    out = jnp.zeros((R, x.shape[-1]), jnp.float32)
    return _repeat(one_chunk, -(-count // pairs), -(-R * K // pairs), out)
