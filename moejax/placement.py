"""Expert placement for expert parallelism: physical slots -> logical experts, with replicas of hot experts.

A `Placement` lays `num_slots = num_devices · slots_per_device` physical expert slots over the devices of the
expert axis, device-major (device d holds slots `[d·S/n, (d+1)·S/n)`); each slot holds a copy of one logical
expert, and a hot expert may have several. `moejax.sharding.shard_params(..., placement=)` gathers the stacked
expert weights `[E, ...]` into slot order `[S, ...]`, and `moejax.parallel.moe_forward_ep(..., placement=)` sends
each (token, slot) pair to one replica of its expert (`Placement.physical_ids`): replica `t mod c`, in slot order,
of an expert with c replicas, for the token's row index t in the call. The choice depends on the row index only,
so it is deterministic and the same on every device, and rows choosing a hot expert alternate among its replicas.
The laid-out params record their placement (`MoEParams.placement`), and `moe_forward_ep` raises when run with
another (`check_placement`): two placements of the same slot count give the same shapes.

The balancing routine (`balance`) is DeepSeek's EPLB algorithm, on the host in numpy, from a load vector (pairs
per expert over a past trace, e.g. `moejax.analysis.expert_load`):

  global policy (one node):
    1. Replicate (`replicate`): one replica per expert, then the S - E redundant slots one at a time, each to the
       expert with the highest load per replica (load / replicas; ties to the lowest id).
    2. Pack (`balanced_packing`): each replica carries load / replicas of its expert; replicas heaviest first,
       each onto the least loaded device that has fewer than S/n slots (ties to the lowest device).
  hierarchical policy (`num_nodes` > 1 nodes of n/num_nodes devices, with expert groups: contiguous blocks of
  E/G experts, the groups of group-limited routing), when the G groups divide evenly over the nodes:
    1. Pack the groups onto the nodes by group load, G/num_nodes groups per node (step 2's packing).
    2. Within each node, replicate its experts to S/num_nodes slots (step 1).
    3. Pack each node's replicas onto that node's devices (step 2).
  A token whose group-limited selection stays within few groups then stays within few nodes. As in EPLB,
  groups that do not divide evenly over the nodes fall back to the global policy.

A replica's slot within its device is arbitrary; `balance` orders each device's slots by logical expert id.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Placement:
    """Physical expert slots over the devices of the expert axis (see the module docstring).

    Hashable: pass it as a static argument (`moe_forward_ep` builds its lookup tables as constants from it).

    slot_expert: `[S]` the logical expert id held by each physical slot, device-major.
    num_experts: E, the number of logical (routed) experts; each must have at least one slot.
    num_devices: n, the size of the expert axis; must divide S.
    """

    slot_expert: tuple[int, ...]
    num_experts: int
    num_devices: int

    def __post_init__(self) -> None:
        for field in ("num_experts", "num_devices"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"Placement.{field}={value!r}: must be a positive int")
            object.__setattr__(self, field, int(value))
        slots = np.asarray(self.slot_expert)
        if slots.ndim != 1 or slots.size == 0 or not np.issubdtype(slots.dtype, np.integer):
            raise ValueError(f"Placement.slot_expert: must be a non-empty sequence of ints, got {self.slot_expert!r}")
        object.__setattr__(self, "slot_expert", tuple(int(e) for e in slots))
        if slots.size % self.num_devices:
            raise ValueError(
                f"Placement.slot_expert: {slots.size} slots do not split evenly over num_devices={self.num_devices}"
            )
        outside = sorted({int(e) for e in slots if not 0 <= e < self.num_experts})
        if outside:
            raise ValueError(f"Placement.slot_expert: ids {outside} outside [0, num_experts={self.num_experts})")
        missing = np.flatnonzero(np.bincount(slots, minlength=self.num_experts) == 0)
        if missing.size:
            raise ValueError(f"Placement.slot_expert: experts {missing.tolist()} have no slot (each needs >= 1)")

    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int) -> Placement:
        """The layout without placement: slot e holds expert e, device d experts `[d·E/n, (d+1)·E/n)`."""
        return cls(tuple(range(num_experts)), num_experts, num_devices)

    def describe(self) -> str:
        """A short name for error messages: the sizes and the slot table (a digest of it past 16 slots)."""
        if self.num_slots <= 16:
            slots = f"slot_expert={self.slot_expert}"
        else:
            digest = hashlib.sha1(np.asarray(self.slot_expert, np.int64).tobytes()).hexdigest()[:10]
            slots = f"slot_expert sha1 {digest}"
        return f"Placement(E={self.num_experts}, n={self.num_devices}, S={self.num_slots}, {slots})"

    # -- derived (host numpy) ------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """S = num_devices · slots_per_device."""
        return len(self.slot_expert)

    @property
    def slots_per_device(self) -> int:
        return self.num_slots // self.num_devices

    @property
    def replica_counts(self) -> np.ndarray:
        """`[E]` int32: how many slots hold each expert (>= 1)."""
        return np.bincount(np.asarray(self.slot_expert), minlength=self.num_experts).astype(np.int32)

    @property
    def replica_slots(self) -> np.ndarray:
        """`[E, R]` int32, R = the largest replica count: row e lists expert e's slots in increasing order, then
        repeats them cyclically to fill the row (so `row[r]` for `r < count` is replica r, and no entry is a
        sentinel)."""
        counts = self.replica_counts
        table = np.empty((self.num_experts, int(counts.max())), np.int32)
        slot_expert = np.asarray(self.slot_expert)
        for e in range(self.num_experts):
            slots = np.flatnonzero(slot_expert == e)
            table[e] = np.resize(slots, table.shape[1])
        return table

    @property
    def device_of_slot(self) -> np.ndarray:
        """`[S]` int32: the device holding each slot."""
        return np.arange(self.num_slots, dtype=np.int32) // self.slots_per_device

    def expected_device_load(self, load: Sequence[float] | np.ndarray) -> np.ndarray:
        """`[n]` float64: the load of each device when expert e's load `load[e]` splits evenly over its replicas
        (what `balance` balances; the realised split of a trace is `moejax.analysis.device_load`)."""
        load = _load_vector(load, self.num_experts)
        per_slot = load[np.asarray(self.slot_expert)] / self.replica_counts[np.asarray(self.slot_expert)]
        return per_slot.reshape(self.num_devices, self.slots_per_device).sum(1)

    # -- on device ---------------------------------------------------------------------------------------
    def physical_ids(self, indices: Array, token_index: Array) -> Array:
        """Logical expert ids -> physical slot ids: `[T, K]` int32. Jit-able (the tables are constants).

        Args:
          indices: `[T, K]` logical ids; ids >= E (zero-computation experts) map to S, a slot nobody holds.
          token_index: `[T]` each row's index in the call (its global index when rows are split over devices);
            row t's pair with expert e goes to replica `t mod count[e]` of e.
        """
        E = self.num_experts
        real = (indices >= 0) & (indices < E)
        e = jnp.where(real, indices, 0)
        counts = jnp.asarray(self.replica_counts)
        replica = token_index.astype(jnp.int32)[:, None] % counts[e]
        return jnp.where(real, jnp.asarray(self.replica_slots)[e, replica], self.num_slots).astype(jnp.int32)


def check_placement(laid_out: Placement | None, placement: Placement | None) -> None:
    """`ValueError` naming both when experts laid out by `laid_out` (`MoEParams.placement`; None: logical order)
    are about to run with `placement`: with the same slot count the shapes agree and every pair would silently
    meet another expert's weights."""
    if laid_out == placement:
        return
    name = lambda p: "no placement (experts in logical order)" if p is None else p.describe()
    where = ""
    if laid_out is not None and placement is not None:
        pairs = zip(laid_out.slot_expert, placement.slot_expert, strict=False)
        slot = next((s for s, (a, b) in enumerate(pairs) if a != b), None)
        if slot is not None:
            where = f"; slot {slot} holds expert {laid_out.slot_expert[slot]}, not {placement.slot_expert[slot]}"
    raise ValueError(
        f"params are laid out by {name(laid_out)} but run with placement={name(placement)}{where}: lay them out "
        "with moejax.sharding.shard_params(..., placement=) of the placement they run with"
    )


# -- EPLB ----------------------------------------------------------------------------------------------------


def _load_vector(load, num_experts: int | None = None) -> np.ndarray:
    load = np.asarray(load, np.float64)
    if load.ndim != 1 or load.size == 0:
        raise ValueError(f"load must be a non-empty [E] vector, got shape {load.shape}")
    if num_experts is not None and load.size != num_experts:
        raise ValueError(f"load has {load.size} entries, expected num_experts={num_experts}")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("load must be finite and >= 0")
    return load


def replicate(load: Sequence[float] | np.ndarray, num_slots: int) -> np.ndarray:
    """EPLB step 1: replica counts `[E]` int32 summing to `num_slots`, each >= 1.

    Starting from one replica each, the `num_slots - E` redundant replicas go one at a time to the expert with
    the highest load per replica (ties: lowest id). This minimises the largest load per replica.
    """
    load = _load_vector(load)
    if num_slots < load.size:
        raise ValueError(f"num_slots={num_slots} must be >= the number of experts {load.size}")
    counts = np.ones(load.size, np.int64)
    for _ in range(num_slots - load.size):
        counts[np.argmax(load / counts)] += 1
    return counts.astype(np.int32)


def balanced_packing(weights: Sequence[float] | np.ndarray, num_packs: int) -> np.ndarray:
    """EPLB's packing: `[N]` int32 pack of each item, every pack receiving exactly N / num_packs items.

    Items heaviest first (ties: lowest index), each into the lightest pack that still has room (ties: lowest pack).
    """
    weights = _load_vector(weights)
    if num_packs < 1 or weights.size % num_packs:
        raise ValueError(f"num_packs={num_packs} must be >= 1 and divide the number of items {weights.size}")
    capacity = weights.size // num_packs
    pack_of = np.empty(weights.size, np.int32)
    totals = np.zeros(num_packs)
    sizes = np.zeros(num_packs, np.int64)
    for item in np.argsort(-weights, kind="stable"):
        open_totals = np.where(sizes < capacity, totals, np.inf)
        pack = int(np.argmin(open_totals))
        pack_of[item] = pack
        totals[pack] += weights[item]
        sizes[pack] += 1
    return pack_of


def _replicate_and_pack(load: np.ndarray, num_slots: int, num_devices: int) -> np.ndarray:
    """Global policy on `load [E']`: `[num_slots]` local expert ids, device-major, sorted within each device."""
    counts = replicate(load, num_slots)
    replica_expert = np.repeat(np.arange(load.size), counts)  # [num_slots]
    device = balanced_packing(load[replica_expert] / counts[replica_expert], num_devices)
    order = np.lexsort((replica_expert, device))  # by device, then by expert id
    return replica_expert[order]


def balance(
    load: Sequence[float] | np.ndarray,
    *,
    num_devices: int,
    num_slots: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> Placement:
    """A `Placement` of `num_slots` slots over `num_devices` devices balancing `load` (EPLB; module docstring).

    Args:
      load: `[E]` load per logical expert (e.g. pairs routed to it over a trace), >= 0.
      num_devices: n, devices of the expert axis; must divide `num_slots`.
      num_slots: S >= E physical slots (S - E redundant replicas).
      num_groups: G expert groups (contiguous blocks of E/G experts) for the hierarchical policy.
      num_nodes: nodes the devices are split into (consecutive devices per node). With `num_nodes > 1` and G
        divisible by it, the hierarchical policy; otherwise the global one.
    Raises:
      ValueError: a size that does not divide (naming it), S < E, or a negative or non-finite load.
    """
    load = _load_vector(load)
    E = load.size
    for name, value in (("num_devices", num_devices), ("num_slots", num_slots), ("num_groups", num_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be a positive int")
    if num_slots % num_devices:
        raise ValueError(f"num_slots={num_slots} must be divisible by num_devices={num_devices}")
    if num_slots < E:
        raise ValueError(f"num_slots={num_slots} must be >= the number of experts E={E}")
    if E % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of experts E={E}")
    if num_nodes == 1 or num_groups % num_nodes:
        return Placement(tuple(_replicate_and_pack(load, num_slots, num_devices)), E, num_devices)
    if num_devices % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} must divide num_devices={num_devices}")
    group_size = E // num_groups
    group_experts = np.arange(E).reshape(num_groups, group_size)  # [G, E/G]
    node_of_group = balanced_packing(load.reshape(num_groups, group_size).sum(1), num_nodes)  # [G]
    slots = []
    for node in range(num_nodes):
        experts = group_experts[node_of_group == node].reshape(-1)  # this node's experts, by group id
        local = _replicate_and_pack(load[experts], num_slots // num_nodes, num_devices // num_nodes)
        slots.append(experts[local])
    return Placement(tuple(np.concatenate(slots)), E, num_devices)
