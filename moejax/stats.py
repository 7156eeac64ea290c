"""`MoEStats`: routing statistics of MoE calls, computed on device: `.stats` of the `moejax.MoEOutput` that
`moejax.moe_forward`, `moejax.parallel.moe_forward_ep` and `moejax.MoE` return with `return_stats=True` (or, for
`moejax.MoE`, accumulated in the layer's `stats` variable with `collect_stats=True`).

Every field is an int32 count, so the statistics of several calls add up exactly: `total = total + stats` inside
a jitted loop (`jax.lax.fori_loop`, `jax.lax.scan`), starting from `MoEStats.zeros(E, n)`. The ratios people look
at (mean union, zero-expert share, imbalance) are methods computed from the sums, on device. Nothing here reads a
value on the host: the statistics of a jitted step stay on the device until the caller asks for them.

The per-device fields describe the expert axis of an EP call (`n` devices); a call without EP is one device
holding every expert (`n = 1`: all pairs local, nothing remote), so the three entry points share one type and
the statistics of a single-device run and of an EP run of the same tokens agree on every per-expert field.

Counts are int32 (JAX's default without x64): a sum wraps past 2**31 pairs, e.g. after ~260 calls of 1M tokens
at top-8; accumulate longer runs in chunks and add the chunks on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.analysis import expert_load
from moejax.config import MoEConfig
from moejax.routing import Routing

Array = jax.Array
_PER_DEVICE = ("device_load", "local_pairs", "remote_pairs", "remote_rows")  # [n] over the expert axis


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """Routing statistics of one MoE call (or the sum over several calls, `+`). All fields int32.

    "Local" is relative to the device that holds the token: in the "replicated" EP mode every device holds every
    token, so all pairs are local; in "all_to_all" mode a pair is local when its expert lives on the token's own
    device. With a placement (`moejax.placement`) `device_load` follows the physical slots; `expert_load` stays
    per logical expert.
    """

    expert_load: Array  # [E] (token, slot) pairs routed to each routed expert (zero experts left out)
    union_size: Array  # [] distinct routed experts chosen in a call (a sum over calls: see `mean_union`)
    zero_pairs: Array  # [] pairs routed to zero-computation experts (LongCat-Flash's identity experts)
    tokens: Array  # [] tokens routed
    calls: Array  # [] calls summed into these statistics
    device_load: Array  # [n] pairs computed on each device of the expert axis (n = 1 without EP)
    local_pairs: Array  # [n] pairs computed on the device that holds the token
    remote_pairs: Array  # [n] pairs of this device's tokens computed on another device
    remote_rows: Array  # [n] token rows this device sends to other devices

    def __add__(self, other: MoEStats) -> MoEStats:
        """The statistics of both sets of calls (fieldwise sum).

        Raises:
          ValueError: a field's shapes differ (other E or n), naming the field and both shapes; broadcasting
            would count the pairs of a 1-device `[1]` field once per device of an `[n]` one.
        """
        if not isinstance(other, MoEStats):
            return NotImplemented
        for field in dataclasses.fields(self):
            mine, theirs = jnp.shape(getattr(self, field.name)), jnp.shape(getattr(other, field.name))
            if mine != theirs:
                raise ValueError(
                    f"MoEStats.{field.name}: cannot add shapes {mine} and {theirs} (statistics of another number "
                    f"of experts or devices: E={self.num_experts} n={self.num_devices} vs "
                    f"E={other.num_experts} n={other.num_devices})"
                )
        return jax.tree.map(jnp.add, self, other)

    @classmethod
    def zeros(cls, num_experts: int, num_devices: int = 1) -> MoEStats:
        """The statistics of no call: the start of an accumulation over E experts and n devices."""
        shapes = {"expert_load": (num_experts,)} | dict.fromkeys(_PER_DEVICE, (num_devices,))
        return cls(**{f.name: jnp.zeros(shapes.get(f.name, ()), jnp.int32) for f in dataclasses.fields(cls)})

    @classmethod
    def from_load(
        cls,
        load: Array,
        *,
        tokens: int,
        top_k: int,
        device_load: Array,
        local_pairs: Array,
        remote_pairs: Array,
        remote_rows: Array,
    ) -> MoEStats:
        """One call's statistics from its per-expert load `[E]` and per-device counts `[n]`.

        Every one of the `tokens · top_k` pairs goes to a routed expert or to a zero-computation expert, so the
        zero pairs are what the load leaves; the union is the number of experts with a load.
        """
        load = load.astype(jnp.int32)
        return cls(
            expert_load=load,
            union_size=jnp.sum(load > 0, dtype=jnp.int32),
            zero_pairs=jnp.int32(tokens * top_k) - jnp.sum(load, dtype=jnp.int32),
            tokens=jnp.int32(tokens),
            calls=jnp.int32(1),
            device_load=device_load.astype(jnp.int32),
            local_pairs=local_pairs.astype(jnp.int32),
            remote_pairs=remote_pairs.astype(jnp.int32),
            remote_rows=remote_rows.astype(jnp.int32),
        )

    @classmethod
    def all_local(cls, load: Array, *, tokens: int, top_k: int, computed: Array | None = None) -> MoEStats:
        """One call's statistics where each device computes `computed` `[1]` pairs (default: the whole load), all
        where their tokens live: one device holding every expert, or a device of an EP call with every token."""
        computed = jnp.sum(load, dtype=jnp.int32)[None] if computed is None else computed
        nothing = jnp.zeros((1,), jnp.int32)
        counts = {"device_load": computed, "local_pairs": computed, "remote_pairs": nothing, "remote_rows": nothing}
        return cls.from_load(load, tokens=tokens, top_k=top_k, **counts)

    # -- derived, on device (float32 scalars) ------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.expert_load.shape[-1]

    @property
    def num_devices(self) -> int:
        return self.device_load.shape[-1]

    def pairs(self) -> Array:
        """All (token, slot) pairs: routed plus zero-expert pairs (tokens · K for calls of one config)."""
        return jnp.sum(self.expert_load) + self.zero_pairs

    def mean_union(self) -> Array:
        """Mean number of distinct routed experts per call: the experts a decode step reads."""
        return self.union_size / jnp.maximum(self.calls, 1).astype(jnp.float32)

    def zero_share(self) -> Array:
        """Share of the pairs that went to zero-computation experts (0 for families without them)."""
        return self.zero_pairs / jnp.maximum(self.pairs(), 1).astype(jnp.float32)

    def expert_imbalance(self) -> Array:
        """Busiest expert / mean expert load (1 when even; NaN without any routed pair)."""
        load = self.expert_load.astype(jnp.float32)
        return jnp.max(load) / jnp.mean(load)

    def device_imbalance(self) -> Array:
        """Busiest device / mean device load over the expert axis (1 without EP)."""
        load = self.device_load.astype(jnp.float32)
        return jnp.max(load) / jnp.mean(load)

    def remote_share(self) -> Array:
        """Share of the computed pairs that ran on another device than their token's (0 without EP)."""
        remote = jnp.sum(self.remote_pairs)
        return remote / jnp.maximum(remote + jnp.sum(self.local_pairs), 1).astype(jnp.float32)


def routing_stats(routing: Routing, cfg: MoEConfig) -> MoEStats:
    """The statistics of one single-device call (`moe_forward`) from its routing `[T, K]`: one device holding
    every expert computes every routed pair locally."""
    T, K = routing.indices.shape
    return MoEStats.all_local(expert_load(routing.indices, cfg), tokens=T, top_k=K)
