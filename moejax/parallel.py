"""Expert parallelism (EP) and tensor parallelism (TP) of the MoE block with `shard_map`.

The only module that knows about meshes and collectives: it wraps the functional core (`moejax.route`,
`moejax.forward.expert_input`, the plans of `moejax.plans`, `moejax.experts.shared_expert_ffn`) in `shard_map`.

Layout (`shard_params`): routed experts split over `expert_axis` (each device holds E/n consecutive experts,
device d owns ids `[d·E/n, (d+1)·E/n)`); the router, its buffers and the experts' pre-norm replicated (every
device routes the tokens it holds); with a `tensor_axis`, the expert intermediate dimension I and the shared
expert's Is split over it (the gated activation is elementwise over I, so a split of I gives exact partial sums).

Two modes of `moe_forward_ep`:

"replicated" (decode, small batches): every device holds all T tokens.
  1. Route all tokens (identically on every device).
  2. Remap the routing to local expert ids; a slot whose expert lives elsewhere gets the sentinel id E/n,
     which every plan treats like a zero-computation expert: weight 0, never computed, its weights never read.
  3. Run the plan (decode or grouped) on the local experts: this device's partial routed sum `[T, H]`.
  4. `psum` over the expert axis (and the tensor axis).
  5. Exactly once, after the reduction: the output scaling (Step-3.7), the zero-expert term and the shared
     expert with its sigmoid gate (before the reduction they would be counted n times).

"all_to_all" (prefill): tokens sharded over the expert axis (T padded to a multiple of n). Per-device memory and
compute follow T/n: a device computes only the (token, slot) pairs of its own experts, about T·K/n.
  1. Each device routes its T/n tokens.
  2. Dispatch: a token visits device d when at least one of its slots is on d; it goes there once, as one row with
     its slots' local ids and weights (other slots carry the sentinel). The visits to d, in token order, are sent
     in rounds of C rows: `jax.lax.all_to_all` swaps `[n, C, H]` blocks.
  3. The receiver compacts the local pairs of its n·C rows and runs the plan on them P pairs at a time, one slot
     per row, adding each pair's weighted output to its row; the `[n, C, H]` float32 partial sums go back by a
     second `all_to_all`, and each token adds the partials of the devices it visited.
  4. Then the once-terms of step 5 above.

A row per visited device, not per pair: a token with several slots on d sends its row once. Buffers sized for
the worst case (every token to one device: T rows, T·K pairs) would not shrink with n; instead no token is
dropped, and the shapes stay static, this way: C and P (`all_to_all_capacity`) hold `capacity_factor` (1.25)
times the load of uniform routing (its mean plus three standard deviations), and a heavier load runs in more
rounds (every device runs as many as the busiest block needs, agreed by a `pmax`: the collectives must match) or
more chunks of P pairs (local: a `while` loop on the device). With K=8 of E=64 experts on 8 devices and T=4096 a
token visits 5.4 devices on average, so C is 0.93·T/n rows and P 1.31·T·K/n pairs. A skewed routing costs time,
never tokens or memory. Only the rows a token needs are filled, compacted at the front of each block, so a ragged
all-to-all (`jax.lax.ragged_all_to_all`, TPU and GPU) could later send just those rows; on CPU the static blocks move
whole.

LoRA adapters (`lora=` a `moejax.lora.stack`, `adapter_ids=` one id per row): the adapters of an expert live with
that expert. `shard_lora` splits the routed experts' adapter arrays `[n+1, E, r, in|out]` over the expert axis on E
like the weights (`lora_specs`), so each device holds its experts' adapters of every id, and a plan applies the
deltas of its local pairs. The router's adapters are replicated (every device routes the tokens it holds, with their
ids). Under a tensor axis the intermediate axis is split where the weights split it: B of gate/up (their output) and
A of down (its input), for the routed experts and for the shared expert; the down delta of an I slice,
`s·(h_slice·A_sliceᵀ)·Bᵀ`, is a partial sum that the psum reducing the base projection completes. The shared
expert's sigmoid gate adapter is replicated (its logit `[T, 1]` multiplies every partial). In "replicated" mode
every device holds every row's id; in "all_to_all" mode the ids are split with the tokens and each dispatched row
carries its id beside its slots' ids and weights (one more int32 column). Out-of-range ids count as 0 (no
adapter), as in `moe_forward`.

Expert placement (`placement=`, a `moejax.placement.Placement`; optional in `shard_params`, `shard_lora` and
`moe_forward_ep`): the experts are laid out by physical slot instead, `[S, ...]` (hot experts replicated; device d
holds slots `[d·S/n, (d+1)·S/n)`; E need not divide by n), and right after routing, in either mode, each (token,
slot) pair's logical expert is replaced by one of its replicas (`Placement.physical_ids`: replica `t mod count` for
the token's global row t). Everything after runs unchanged on slot ids. Each pair meets the same expert weights with
the same routing weight, so the result equals the unplaced forward up to the order in which a token's per-device
partial sums are added (its slots fall on other devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.analysis import expert_load
from moejax.backends import may_run_kernels, run_routed
from moejax.backends.xla import grouped_block_rows
from moejax.config import MoEConfig, SharedExpert
from moejax.eager import cached_when_eager
from moejax.experts import Slots, expert_activation, slots_from_routing
from moejax.forward import add_once_terms, check_inputs, check_lora_inputs, expert_input
from moejax.lora import ExpertLoRA, LoRAPair, LoRAParams, SharedLoRA, check_lora, clamp_ids, from_pairs
from moejax.params import MoEParams, SharedParams, unflatten, with_experts_layout
from moejax.params import param_specs as array_specs
from moejax.placement import Placement, check_layout
from moejax.routing import Routing, route
from moejax.stats import MoEStats
from moejax.weights import ExpertFormat, Experts, ExpertWeights, PerExpert, format_of

Array = jax.Array
EPMode = Literal["replicated", "all_to_all"]
EP_MODES = ("replicated", "all_to_all")
# "all_to_all" buffers hold 1.25x the load of uniform routing: room for the usual imbalance of a learned router
# within one round, while per-device memory still falls as 1/n (benchmarks/ep_memory.py).
CAPACITY_FACTOR = 1.25

# The varying-manual-axes check is off: the plans' loops start from fresh (device-invariant) zeros and carry
# values that vary over the expert axis, and the math must not learn about sharding to satisfy the checker.
# Replication of the outputs holds by construction (psum results and terms computed from replicated inputs).
if hasattr(jax, "shard_map"):

    def _shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

else:  # JAX versions before `jax.shard_map` became public.
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    def _shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
        return _experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def _is_explicit(mesh: Mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _match_specs(tree, specs, mesh: Mesh):
    """On a mesh with explicit axes, array types carry their sharding and `shard_map` wants them to equal its
    in_specs: reshard (a no-op when they already match). Auto meshes reshard on their own."""
    if not _is_explicit(mesh):
        return tree
    return jax.tree.map(lambda s, a: jax.sharding.reshard(a, NamedSharding(mesh, s)), specs, tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EPStats:
    """Device-side routing statistics of one `moe_forward_ep` call (n = size of the expert axis), as the
    `shard_map` returns them; `moe_forward_ep(..., return_stats=True)` completes them into `moejax.stats.MoEStats`.

    "Local" is relative to the device that holds the token: in "replicated" mode every device holds every
    token, so each device's pairs are all local and nothing is sent; in "all_to_all" mode a pair is local
    when its expert lives on the token's own device.
    """

    local_pairs: Array  # [n] int32 (token, slot) pairs computed where the token lives
    remote_pairs: Array  # [n] int32 pairs of this device's tokens computed on another device
    remote_rows: Array  # [n] int32 token rows this device sends to other devices (what a ragged all-to-all moves)
    expert_load: Array  # [E] int32 pairs routed to each expert (zero-computation experts left out)
    device_load: Array  # [n] int32 pairs computed on each device (follows the placement, when one is given)


# -- layout -------------------------------------------------------------------------------------------------


def logical_axis_rules(expert_axis: str = "expert", tensor_axis: str | None = None) -> tuple[tuple[str, str | None]]:
    """Logical axis name -> mesh axis (`flax.nnx.logical_axis_rules` form) for the names of `LOGICAL_AXES`."""
    return (("expert", expert_axis), ("mlp", tensor_axis), ("embed", None))


def runs_replicated(name: str) -> bool:
    """Whether parameter `name` is replicated whatever the rules: the router (Gemma-4's per-expert scale
    included, though its logical axis is `expert`) and the expert pre-norm run on every device for the tokens
    that device holds."""
    return not name.startswith(("experts.", "shared."))


def param_specs(
    cfg: MoEConfig,
    *,
    expert_axis: str | None = "expert",
    tensor_axis: str | None = None,
    fmt: type[ExpertFormat] = ExpertWeights,
) -> MoEParams:
    """The `PartitionSpec` of every parameter of `cfg` (experts stacked in format `fmt`), as a `MoEParams` pytree
    (the `shard_map` in_specs), from the logical axes of `moejax.params.param_specs`."""
    rules = dict(logical_axis_rules(expert_axis, tensor_axis))
    specs = {
        name: P() if runs_replicated(name) else P(*(rules[a] if a else None for a in spec.axes))
        for name, spec in array_specs(cfg, fmt).items()
    }
    return unflatten(specs, fmt)


def check_mesh(
    cfg: MoEConfig,
    mesh: Mesh,
    expert_axis: str | None,
    tensor_axis: str | None = None,
    *,
    placement: Placement | None = None,
) -> None:
    """`ValueError` when the mesh lacks an axis or an axis does not divide the dimension it splits, or when
    `placement` does not fit the config (E) and the expert axis (n) (with a placement, E need not divide by n)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for role, axis in (("expert_axis", expert_axis), ("tensor_axis", tensor_axis)):
        if axis is not None and axis not in mesh.shape:
            raise ValueError(f"{role}={axis!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})")
    if tensor_axis is not None and tensor_axis == expert_axis:
        raise ValueError(f"tensor_axis and expert_axis must differ, both are {expert_axis!r}")
    n = 1 if expert_axis is None else mesh.shape[expert_axis]
    if placement is not None:
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a moejax.placement.Placement, got {type(placement).__name__}")
        if expert_axis is None:
            raise ValueError("placement needs an expert_axis to place the experts over, got expert_axis=None")
        if placement.num_experts != cfg.num_experts:
            raise ValueError(f"placement.num_experts={placement.num_experts} != num_experts E={cfg.num_experts}")
        if placement.num_devices != n:
            raise ValueError(
                f"placement.num_devices={placement.num_devices} != the size {n} of expert axis {expert_axis!r}"
            )
    elif cfg.num_experts % n:
        raise ValueError(
            f"num_experts E={cfg.num_experts} is not divisible by the size {n} of expert axis {expert_axis!r}"
        )
    if tensor_axis is not None:
        tp = mesh.shape[tensor_axis]
        sizes = {"intermediate_size": cfg.intermediate_size, "shared_intermediate_size": cfg.shared_intermediate_size}
        for field, size in sizes.items():
            if size % tp:
                raise ValueError(f"{field}={size} is not divisible by the size {tp} of tensor axis {tensor_axis!r}")


def check_kernels_can_run(impl: str, mesh: Mesh) -> None:
    """`NotImplementedError` for Pallas kernels on a CPU mesh of several devices, which would hang.

    On CPU the kernels run under the Mosaic GPU interpreter, which simulates one GPU per process: the kernels of
    several devices running at once would share it, so the second fails inside its host callback, and the other
    devices then wait forever in the next collective.
    """
    platform = mesh.devices.flat[0].platform
    if mesh.size > 1 and platform == "cpu" and may_run_kernels(impl):
        raise NotImplementedError(
            f"impl={impl!r} runs the Pallas kernels, which on CPU run under the Mosaic GPU interpreter: one "
            f"simulated GPU per process cannot serve the {mesh.size} CPU devices of this mesh at once (they would "
            "deadlock). Use impl='xla' (or 'reference') on a CPU mesh, or a 1-device mesh or a GPU mesh for the "
            "kernels."
        )


def shard_params(
    params: MoEParams,
    cfg: MoEConfig,
    mesh: Mesh,
    *,
    expert_axis: str | None = "expert",
    tensor_axis: str | None = None,
    placement: Placement | None = None,
) -> MoEParams:
    """Place `params` on `mesh`: experts split over `expert_axis` (and I over `tensor_axis`), the rest replicated.

    `expert_axis=None` replicates the experts too (a mesh used for other axes only). With a `placement`, the
    experts `[E, ...]` (in logical order, as loaded) are first gathered into slot order `[S, ...]`
    (`experts[placement.slot_expert]`: a replicated expert's weights are copied to each of its slots), the
    layout `moe_forward_ep(..., placement=placement)` takes; the result records it (`MoEParams.placement`), and
    `moe_forward_ep` raises when run with another.

    Works across processes (multi-host): every process passes the same full values (e.g. host numpy arrays
    or its own copy) and keeps only the shards of its own devices.

    Raises:
      ValueError: E is not divisible by the expert-axis size (the message names both), I or Is not divisible
        by the tensor-axis size, an axis is missing from the mesh, or `placement` does not fit (E, n, or
        experts that are not in logical order, e.g. already laid out by a placement).
    """
    check_mesh(cfg, mesh, expert_axis, tensor_axis, placement=placement)
    params = with_experts_layout(params, "stacked")  # the experts are split along their stacked E axis
    if placement is not None and params.experts.num_experts != cfg.num_experts:
        raise ValueError(
            f"params.experts has {params.experts.num_experts} experts; shard_params(..., placement=) takes "
            f"them in logical order, E={cfg.num_experts}"
        )
    if params.placement is not None:  # gathering slots again would scramble them
        raise ValueError(
            f"params are already laid out by {params.placement.describe()}; shard_params takes the experts in "
            f"logical order, E={cfg.num_experts}"
        )
    if placement is not None:
        slot_expert = np.asarray(placement.slot_expert)
        params = dataclasses.replace(params, experts=jax.tree.map(lambda w: w[slot_expert], params.experts))
    specs = param_specs(cfg, expert_axis=expert_axis, tensor_axis=tensor_axis, fmt=format_of(params.experts))
    placed = jax.tree.map(functools.partial(_place, mesh), params, specs)
    return dataclasses.replace(placed, placement=placement)  # the layout travels with the arrays


def lora_specs(
    lora: LoRAParams,
    *,
    expert_axis: str | None = "expert",
    tensor_axis: str | None = None,
) -> LoRAParams:
    """The `PartitionSpec` of every array of an adapter stack `lora` (the `shard_map` in_specs), as a `LoRAParams`.

    The adapters of an expert live with that expert: routed-expert pairs (`a [n+1, E, r, in]`, `b [n+1, E, out, r]`)
    split their E axis over `expert_axis` like the expert weights, and with a `tensor_axis` the intermediate axis I
    where the expert weights split it (B of gate and up, A of down: `h·A_downᵀ` over an I slice is a partial sum,
    exact after the psum that reduces the base down projection). The shared expert's pairs split its Is the same
    way (B of gate/up, A of down) when a tensor axis splits it, else they are replicated. The router's pairs and the
    shared expert's sigmoid gate (`[T, 1]`, applied to every partial) are replicated; so are the scales.
    """
    split_in = {"experts.down", "shared.down"}  # I is the input axis of the down projections, the output of the rest

    def spec(name: str, pair: LoRAPair) -> LoRAPair:
        if name == "router" or name == "shared.gate_kernel":
            return LoRAPair(P(), P(), P())
        e = (expert_axis,) if name.startswith("experts.") else ()
        t_a, t_b = (tensor_axis, None) if name in split_in else (None, tensor_axis)
        return LoRAPair(P(None, *e, None, t_a), P(None, *e, t_b, None), P())

    return from_pairs({name: spec(name, pair) for name, pair in lora.pairs().items()})


def shard_lora(
    lora: LoRAParams,
    cfg: MoEConfig,
    mesh: Mesh,
    *,
    expert_axis: str | None = "expert",
    tensor_axis: str | None = None,
    placement: Placement | None = None,
) -> LoRAParams:
    """Place an adapter stack on `mesh` by `lora_specs` (each expert's adapters with the expert), the companion of
    `shard_params` (same axes, same `placement`: with one, the experts' adapters `[n+1, E, ...]` are gathered into
    slot order `[n+1, S, ...]` as `shard_params` gathers the weights). Works across processes like `shard_params`.

    Raises:
      ValueError: `lora` is not a stack for `cfg` (`moejax.lora.check_lora`), or the mesh checks of `shard_params`.
    """
    check_mesh(cfg, mesh, expert_axis, tensor_axis, placement=placement)
    check_lora(lora, cfg)
    if placement is not None and lora.experts is not None:
        slot_expert = np.asarray(placement.slot_expert)
        gather = lambda p: dataclasses.replace(p, a=p.a[:, slot_expert], b=p.b[:, slot_expert])
        lora = dataclasses.replace(lora, experts=jax.tree.map(gather, lora.experts, is_leaf=_is_pair))
    specs = lora_specs(lora, expert_axis=expert_axis, tensor_axis=tensor_axis)
    return jax.tree.map(functools.partial(_place, mesh), lora, specs)


def _is_pair(value) -> bool:
    return isinstance(value, LoRAPair)


def _place(mesh: Mesh, value, spec: P) -> Array:
    """`value` on `mesh` by `spec`; across processes, built from this process's shards of the full value."""
    sharding = NamedSharding(mesh, spec)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# -- per-device pieces (run inside shard_map) ----------------------------------------------------------------


def localize(slots: Slots, first: Array, num_local: int) -> Slots:
    """Slots restricted to experts `[first, first + num_local)`, renumbered from 0.

    Other slots (remote experts and zero-computation experts) get the id `num_local` and output weight 0: every
    plan skips ids >= the number of experts it holds, so they are never computed or read.
    """
    local = slots.indices - first
    mine = (local >= 0) & (local < num_local)
    return dataclasses.replace(
        slots, indices=jnp.where(mine, local, num_local), out_weight=jnp.where(mine, slots.out_weight, 0.0)
    )


def partial_routed_sum(
    experts: Experts,
    x_e: Array,
    slots: Slots,
    cfg: MoEConfig,
    *,
    impl: str,
    num_pairs: int,
    tensor_axis: str | None = None,
    lora: ExpertLoRA | None = None,
) -> Array:
    """This device's share of `Σ_k w_k·E_k(x_e)`: `[R, H]` float32 over the local experts (and I-slice).

    Args:
      experts: the local experts `[E/n, ...]` (stacked; a slice of I when `tensor_axis` splits it).
      x_e: `[R, H]` expert input.
      slots: `[R, K]` in local ids (`localize`); ids >= E/n contribute nothing.
      cfg: the global config (the activation and the global expert count).
      impl: the routed implementation as `moe_forward` takes it.
      num_pairs: the global number of (token, slot) pairs; sizes the grouped plan's blocks for the expected
        load per expert rather than for the R·K slots seen here, most of which are not local.
      tensor_axis: when I is split, the down-projection bias is added by tensor shard 0 only.
      lora: the local experts' adapters (`a [n+1, E/n, r, in]`, sliced like the experts by `lora_specs`), applied by
        each row's `slots.adapter`.
    """
    if tensor_axis is not None and getattr(experts, "down_bias", None) is not None:
        first_shard = jax.lax.axis_index(tensor_axis) == 0
        experts = dataclasses.replace(experts, down_bias=jnp.where(first_shard, experts.down_bias, 0))
    block_rows = grouped_block_rows(num_pairs, cfg.num_experts)
    return run_routed(impl, experts, x_e, slots, expert_activation(cfg), lora=lora, block_rows=block_rows)


def add_once(
    routed: Array,
    x_e: Array,
    routing: Routing,
    shared: SharedParams | None,
    cfg: MoEConfig,
    *,
    tensor_axis: str | None = None,
    float32: bool = False,
    lora: SharedLoRA | None = None,
    adapter: Array | None = None,
) -> Array:
    """The terms added exactly once, to the routed sum already reduced over the expert axis. `[T, H]` float32.

    Output scaling (Step-3.7), `+ zero_weight·x_e` (LongCat), `+ shared(x_e)` with its sigmoid gate; with a
    tensor axis the shared expert's partial sums (over its Is slice) are reduced over it. The gate multiplies
    each partial, which is exact because the reduction is linear. `lora` (the shared expert's adapters, split like
    it by `lora_specs`) applies by the rows' `adapter` ids: its down delta over an Is slice is a partial sum too.
    """
    reduce = None if tensor_axis is None else functools.partial(jax.lax.psum, axis_name=tensor_axis)
    return add_once_terms(
        routed, x_e, routing, shared, cfg, float32=float32, reduce_shared=reduce, lora=lora, adapter=adapter
    )


def _expert_load(routing: Routing, cfg: MoEConfig, valid: Array | None = None) -> Array:
    """Pairs per routed expert `[E]` int32 (zero experts and invalid rows left out)."""
    ids = routing.indices if valid is None else jnp.where(valid[:, None], routing.indices, -1)
    return expert_load(ids, cfg)


def _route_and_slots(params, x, token_ids, lora: LoRAParams | None, adapter: Array | None, cfg: MoEConfig):
    """Routing (with the router adapters of the rows' ids), the expert input and the slots (carrying the ids)."""
    if lora is None:
        routing = route(params, x, cfg, token_ids)
    else:
        routing = route(params, x, cfg, token_ids, lora=lora.router, adapter=adapter)
    return routing, expert_input(params, x, cfg), slots_from_routing(routing, cfg, adapter)


def _part(lora: LoRAParams | None, name: str):
    return None if lora is None else getattr(lora, name)


def _replicated_body(params, x, token_ids, lora, adapter, *, cfg, impl, expert_axis, tensor_axis, placement=None):
    """Per device: all T tokens `x [T, H]`, local experts (or slots) -> (`[T, H]` float32 replicated, stats).

    `lora`: the adapter stack with the local experts' adapters (`lora_specs`), `adapter [T]` the rows' ids."""
    T = x.shape[0]
    num_local = params.experts.num_experts
    me = jax.lax.axis_index(expert_axis)
    routing, x_e, slots = _route_and_slots(params, x, token_ids, lora, adapter, cfg)
    if placement is not None:  # each pair to one replica of its expert: physical slot ids from here on
        slots = dataclasses.replace(slots, indices=placement.physical_ids(slots.indices, jnp.arange(T)))
    local = localize(slots, me * num_local, num_local)
    partial = partial_routed_sum(
        params.experts,
        x_e,
        local,
        cfg,
        impl=impl,
        num_pairs=T * cfg.top_k,
        tensor_axis=tensor_axis,
        lora=_part(lora, "experts"),
    )
    axes = expert_axis if tensor_axis is None else (expert_axis, tensor_axis)
    routed = jax.lax.psum(partial, axes)
    out = add_once(
        routed,
        x_e,
        routing,
        params.shared,
        cfg,
        tensor_axis=tensor_axis,
        float32=impl == "reference",
        lora=_part(lora, "shared"),
        adapter=adapter,
    )
    load = _expert_load(routing, cfg)
    if placement is None:
        mine = jax.lax.dynamic_slice_in_dim(load, me * num_local, num_local).sum(keepdims=True)
    else:
        mine = (local.indices < num_local).sum(dtype=jnp.int32)[None]
    zero = jnp.zeros((1,), jnp.int32)
    return out, EPStats(local_pairs=mine, remote_pairs=zero, remote_rows=zero, expert_load=load, device_load=mine)


def all_to_all_capacity(cfg: MoEConfig, num_tokens: int, n: int, capacity_factor: float) -> tuple[int, int]:
    """Static buffer sizes of "all_to_all" mode: (rows per block and round, pairs per compute chunk).

    Sized for uniform routing: `capacity_factor` times its mean plus three standard deviations (the sampling noise
    of a few tokens). More is not dropped but costs another round (rows) or another chunk (pairs), see the
    module docstring.

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


def _repeat(body: Callable[[Array, Array], Array], trips: Array, max_trips: int, init: Array) -> Array:
    """`fori_loop(0, trips, body, init)`, where `body` adds nothing on a trip past the work (so that when at most one
    trip is ever needed it runs once, with no loop: less to compile)."""
    if max_trips == 1:
        return body(jnp.int32(0), init)
    return jax.lax.fori_loop(0, trips, body, init)


def _compute_received(
    experts: Experts,
    x: Array,
    ids: Array,
    weight: Array,
    cfg: MoEConfig,
    *,
    impl,
    pairs,
    in_scale,
    tensor_axis,
    lora: ExpertLoRA | None = None,
    adapter: Array | None = None,
) -> Array:
    """The weighted partial sums `[R, H]` float32 of the received rows `x [R, H]` over their local slots.

    Only the local (token, slot) pairs are computed: they are compacted (in row order) into a list, which is run
    through the plan `pairs` at a time, one slot per row (`Slots [pairs, 1]`), and each result is added to its
    row. A `while` loop over ceil(local pairs / pairs) chunks: a device that received more than the capacity
    computes it all, in more chunks.

    Args:
      ids: `[R, K]` local expert ids; >= the number of local experts: not here (another device's, or padding).
      weight: `[R, K]` each slot's output weight, or its input scale when `in_scale`.
      lora, adapter: the local experts' adapters and each received row's adapter id `[R]` (with `lora` only).
    """
    R, K = ids.shape
    num_local = experts.num_experts
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
        if lora is not None:
            slots = dataclasses.replace(slots, adapter=adapter[row])
        y = partial_routed_sum(
            experts, x[row], slots, cfg, impl=impl, num_pairs=num_pairs, tensor_axis=tensor_axis, lora=lora
        )  # [pairs, H]
        return out.at[jnp.where(live, row, R)].add(y, mode="drop")

    out = jnp.zeros((R, x.shape[-1]), jnp.float32)
    return _repeat(one_chunk, -(-count // pairs), -(-R * K // pairs), out)


def _all_to_all_body(
    params,
    x,
    token_ids,
    lora,
    adapter,
    *,
    cfg,
    impl,
    expert_axis,
    tensor_axis,
    num_tokens,
    n,
    capacity,
    placement=None,
):
    """Per device: its `x [T/n, H]` tokens; dispatch, compute, return, combine -> (`[T/n, H]` float32, stats).

    `num_local` is the number of experts (or, with a placement, slots) per device; `ids` the expert (or slot)
    id of each pair; `capacity` = `all_to_all_capacity(...)`. With adapters (`lora`, the local experts' share, and
    `adapter [T/n]` the ids of this device's rows), each dispatched row carries its adapter id beside its slots."""
    T_l, H = x.shape
    K, E = cfg.top_k, cfg.num_experts
    rows_per_block, pairs_per_chunk = capacity
    num_local = params.experts.num_experts
    me = jax.lax.axis_index(expert_axis)
    routing, x_e, slots = _route_and_slots(params, x, token_ids, lora, adapter, cfg)  # [T_l, K], [T_l, H]
    rows = me * T_l + jnp.arange(T_l)  # [T_l] global row index
    valid = rows < num_tokens  # [T_l] False on the padding rows
    real = (routing.indices < E) & valid[:, None]  # [T_l, K] slots that need an expert
    ids = routing.indices if placement is None else placement.physical_ids(routing.indices, rows)  # [T_l, K]
    devices = jnp.arange(n)
    owner = jnp.where(real, ids // num_local, n)  # [T_l, K]; n: nobody
    needs = (owner[:, None, :] == devices[None, :, None]).any(-1)  # [T_l, n] token t visits device d
    # One weight per slot travels: the input scale where the family scales inputs (Llama-4), else the output weight.
    weight = slots.out_weight if slots.in_scale is None else slots.in_scale  # [T_l, K]

    # The visits to each device in token order, T_l past the last: visit v to d is sent in round v // rows_per_block.
    num_rounds = -(-T_l // rows_per_block)
    rank = jnp.where(needs, jnp.cumsum(needs, axis=0) - 1, num_rounds * rows_per_block)  # [T_l, n]
    visits = jnp.full((n, num_rounds * rows_per_block), T_l, jnp.int32)
    visits = visits.at[devices[None, :], rank].set(jnp.arange(T_l, dtype=jnp.int32)[:, None], mode="drop")
    # Every device runs the same number of rounds (each round is a collective): enough for the busiest block.
    rounds = jax.lax.pmax(-(-needs.sum(0, dtype=jnp.int32).max() // rows_per_block), expert_axis)

    def one_round(r: Array, routed: Array) -> Array:
        token = jax.lax.dynamic_slice_in_dim(visits, r * rows_per_block, rows_per_block, 1)  # [n, C] T_l: empty
        sent = token < T_l
        token = jnp.minimum(token, T_l - 1)
        here = (owner[token] == devices[:, None, None]) & sent[..., None]  # [n, C, K] slots block d computes
        local_ids = jnp.where(here, ids[token] - devices[:, None, None] * num_local, num_local)
        local_w = jnp.where(here, weight[token], 0.0)
        # Ids and weights travel in one int32 buffer (weights bitcast: integers are never flushed or rounded).
        columns = [local_ids, jax.lax.bitcast_convert_type(local_w, jnp.int32)]
        if lora is not None:  # the row's adapter id travels with it
            columns.append(adapter[token][..., None])
        meta = jnp.concatenate(columns, -1)  # [n, C, 2K (+1)]
        recv_x = jax.lax.all_to_all(x_e[token], expert_axis, 0, 0)  # [n, C, H] block s: rows from device s
        recv_meta = jax.lax.all_to_all(meta, expert_axis, 0, 0).reshape(n * rows_per_block, meta.shape[-1])
        partial = _compute_received(
            params.experts,
            recv_x.reshape(n * rows_per_block, H),
            recv_meta[:, :K],
            jax.lax.bitcast_convert_type(recv_meta[:, K : 2 * K], jnp.float32),
            cfg,
            impl=impl,
            pairs=pairs_per_chunk,
            in_scale=slots.in_scale is not None,
            tensor_axis=tensor_axis,
            lora=_part(lora, "experts"),
            adapter=None if lora is None else recv_meta[:, 2 * K],
        )  # [n·C, H] float32
        back = jax.lax.all_to_all(partial.reshape(n, rows_per_block, H), expert_axis, 0, 0)  # block d: done by d
        return routed.at[jnp.where(sent, token, T_l)].add(back, mode="drop")

    routed = _repeat(one_round, rounds, num_rounds, jnp.zeros((T_l, H), jnp.float32))  # [T_l, H]
    if tensor_axis is not None:
        routed = jax.lax.psum(routed, tensor_axis)
    out = add_once(
        routed,
        x_e,
        routing,
        params.shared,
        cfg,
        tensor_axis=tensor_axis,
        float32=impl == "reference",
        lora=_part(lora, "shared"),
        adapter=adapter,
    )

    local_pairs = (owner == me).sum(dtype=jnp.int32)
    pairs_to = jnp.bincount(owner.reshape(-1), length=n + 1)[:n].astype(jnp.int32)  # [n] my pairs per device
    stats = EPStats(
        local_pairs=local_pairs[None],
        remote_pairs=(real.sum(dtype=jnp.int32) - local_pairs)[None],
        remote_rows=(needs.sum(dtype=jnp.int32) - needs[:, me].sum(dtype=jnp.int32))[None],
        expert_load=jax.lax.psum(_expert_load(routing, cfg, valid), expert_axis),
        device_load=jax.lax.psum(pairs_to, expert_axis)[me][None],
    )
    return out, stats


# -- communication volume ------------------------------------------------------------------------------------


def communication_bytes(
    cfg: MoEConfig,
    num_tokens: int,
    *,
    mode: EPMode,
    expert_size: int,
    tensor_size: int = 1,
    dtype: jnp.dtype = jnp.float32,
    capacity_factor: float = CAPACITY_FACTOR,
    adapters: bool = False,
) -> dict[str, int]:
    """Bytes one device sends per `moe_forward_ep` call, from the shapes (the static buffers, whatever the routing).

    A psum over g devices is counted as a ring all-reduce, `2·(g-1)/g` of the buffer; an all-to-all over n devices
    sends `(n-1)/n` of its buffer (the block for the device itself stays). Inputs are taken as already placed
    (replicated for "replicated", split for "all_to_all"). "all_to_all" is counted for one round, which holds the
    load of uniform routing times `capacity_factor` (`all_to_all_capacity`); a call whose routing overflows a
    block runs more rounds, each sending as much again. With `adapters` (a call with LoRA), each "all_to_all" row
    carries its int32 adapter id too.

    Returns:
      {"dispatch": tokens and slot metadata sent, "combine": partial results sent back, "reduce": psums, "total"}.
    """
    n, tp, H, K = expert_size, tensor_size, cfg.hidden_size, cfg.top_k
    itemsize, f32 = jnp.dtype(dtype).itemsize, 4

    def all_reduce(group: int, nbytes: int) -> int:
        return 2 * (group - 1) * nbytes // group

    shared = cfg.shared_expert is not SharedExpert.NONE and tp > 1
    if mode == "replicated":
        reduce = all_reduce(n * tp, num_tokens * H * f32) + shared * all_reduce(tp, num_tokens * H * f32)
        sizes = {"dispatch": 0, "combine": 0, "reduce": reduce}
    elif mode == "all_to_all":
        rows_per_block, _ = all_to_all_capacity(cfg, num_tokens, n, capacity_factor)
        sent_rows = (n - 1) * rows_per_block  # [n, rows] minus this device's own block
        sizes = {
            # token row + int32 ids and weights per slot (+ the row's adapter id)
            "dispatch": sent_rows * (H * itemsize + (2 * K + adapters) * 4),
            "combine": sent_rows * H * f32,
            "reduce": (1 + shared) * all_reduce(tp, -(-num_tokens // n) * H * f32),
        }
    else:
        raise ValueError(f"mode={mode!r} is not one of {EP_MODES}")
    return {**sizes, "total": sum(sizes.values())}


# -- public entry point ------------------------------------------------------------------------------------


def _logical_view(params: MoEParams, cfg: MoEConfig, placement: Placement) -> MoEParams:
    """`params` with experts laid out by `placement`'s S slots, seen as E experts (shapes only) for the checks of
    `moe_forward`; `ValueError` when the experts are not S slots."""
    experts = params.experts
    if experts.num_experts != placement.num_slots:
        raise ValueError(
            f"params.experts has {experts.num_experts} experts, but placement has num_slots={placement.num_slots}: "
            "lay the experts out with shard_params(..., placement=placement)"
        )
    E = cfg.num_experts
    if isinstance(experts, PerExpert):
        view = dataclasses.replace(experts, parts=experts.parts[:E])
    else:
        view = jax.tree.map(lambda w: jax.ShapeDtypeStruct((E, *w.shape[1:]), w.dtype), experts)
    return dataclasses.replace(params, experts=view, placement=None)  # the placement is checked on its own


def _adapter_rows(
    lora: LoRAParams | None, adapter_ids: Array | None, x: Array, cfg: MoEConfig, placement: Placement | None
) -> Array | None:
    """The rows' adapter ids `[T]` int32 (ids outside the stack as 0), or None without adapters, after the checks
    of `moe_forward` (`moejax.forward.check_lora_inputs`); with a placement the stack's experts are its S slots."""
    view = lora
    if lora is not None and placement is not None and lora.experts is not None:
        first = next(p for p in (lora.experts.gate, lora.experts.up, lora.experts.down) if p is not None)
        if first.a.shape[1] != placement.num_slots:
            raise ValueError(
                f"lora.experts has {first.a.shape[1]} experts, but placement has num_slots={placement.num_slots}: "
                "lay the adapters out with shard_lora(..., placement=placement)"
            )
        logical = lambda w: jax.ShapeDtypeStruct((w.shape[0], cfg.num_experts, *w.shape[2:]), w.dtype)
        as_logical = lambda p: dataclasses.replace(p, a=logical(p.a), b=logical(p.b))
        view = dataclasses.replace(lora, experts=jax.tree.map(as_logical, lora.experts, is_leaf=_is_pair))
    ids = check_lora_inputs(view, adapter_ids, x, cfg)
    return None if ids is None else clamp_ids(ids.reshape(-1), lora.num_ids)


# Static under the jit of eager calls (`moejax.eager`): a new mesh, mode or placement is a new program.
_EP_STATIC = (
    "cfg",
    "mesh",
    "expert_axis",
    "tensor_axis",
    "mode",
    "impl",
    "return_stats",
    "placement",
    "capacity_factor",
)


@cached_when_eager(static_argnames=_EP_STATIC, host_id_args=("adapter_ids",))
def moe_forward_ep(
    params: MoEParams,
    x: Array,
    cfg: MoEConfig,
    *,
    mesh: Mesh,
    expert_axis: str = "expert",
    tensor_axis: str | None = None,
    mode: EPMode = "replicated",
    token_ids: Array | None = None,
    impl: str = "auto",
    return_stats: bool = False,
    placement: Placement | None = None,
    capacity_factor: float = CAPACITY_FACTOR,
    lora: LoRAParams | None = None,
    adapter_ids: Array | None = None,
) -> Array | tuple[Array, MoEStats]:
    """`moejax.moe_forward` with the routed experts split over `expert_axis` of `mesh`. Jit-able.

    Args:
      params: `MoEParams`, best placed by `shard_params` (other placements are resharded by XLA, and per-expert
        experts are stacked on every call).
      x: `[..., H]` block input.
      cfg: the block's math (static).
      mesh: a mesh with `expert_axis` (and `tensor_axis`); may span several processes.
      expert_axis: the axis the experts (and, in "all_to_all" mode, the tokens) are split over.
      tensor_axis: optional axis the intermediate dims I and Is are split over.
      mode: "replicated" (tokens on every device, one psum) or "all_to_all" (tokens split, dispatch/combine);
        see the module docstring.
      token_ids: `[...]` integer token ids (hash routing).
      impl: routed implementation as in `moe_forward` ("auto" picks the decode plan for at most 8 rows).
      return_stats: also return the call's routing statistics, `moejax.stats.MoEStats` (per-device fields over
        the expert axis), computed on device.
      placement: a `moejax.placement.Placement` over the expert axis; `params` then hold the experts in its slot
        order (`shard_params(..., placement=placement)`, which records it in `params.placement`; another one
        raises), and each pair runs on one replica of its expert (module docstring). Static (hashable): a new
        placement compiles a new program.
      capacity_factor: "all_to_all" mode: the dispatch and compute buffers hold this many times the load of uniform
        routing (`all_to_all_capacity`); a heavier load is still computed exactly, in more rounds or chunks.
      lora: an adapter stack (`moejax.lora.stack`), best placed by `shard_lora` (each expert's adapters with the
        expert; with a `placement`, in its slot order); as in `moe_forward`.
      adapter_ids: `[...]` int32 adapter id of each row (0: none; ids outside [0, n] count as 0), with `lora`. In
        "all_to_all" mode each dispatched row carries its id.
    Returns:
      `[..., H]` in x's dtype (and `MoEStats` when `return_stats`).

    Raises:
      ValueError: unknown mode or impl, a mesh axis missing, E not divisible by the expert-axis size (without a
        placement), a placement that does not fit or is not the one `params` were laid out by, a capacity_factor
        that is not > 0, or the shape errors of `moe_forward`.
      NotImplementedError: an impl that runs the Pallas kernels on a CPU mesh of more than one device
        (`check_kernels_can_run`).
    """
    if mode not in EP_MODES:
        raise ValueError(f"mode={mode!r} is not one of {EP_MODES}")
    if not (isinstance(capacity_factor, int | float) and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0")
    check_mesh(cfg, mesh, expert_axis, tensor_axis, placement=placement)
    check_kernels_can_run(impl, mesh)
    if placement is None:
        check_layout(getattr(params, "placement", None), None)
        check_inputs(params, x, cfg, token_ids)
    else:
        check_inputs(_logical_view(params, cfg, placement), x, cfg, token_ids)
        check_layout(params.placement, placement)
        params = dataclasses.replace(params, placement=None)  # recorded and checked: the specs below carry none
    adapter = _adapter_rows(lora, adapter_ids, x, cfg, placement)
    n = mesh.shape[expert_axis]
    if math.prod(x.shape[:-1]) == 0:  # an empty batch: nothing to route, send or compute
        empty = jnp.zeros(x.shape, x.dtype)
        stats = dataclasses.replace(MoEStats.zeros(cfg.num_experts, n), calls=jnp.int32(1))
        return (empty, stats) if return_stats else empty
    flat = x.reshape(-1, cfg.hidden_size)  # [T, H]
    tids = None if token_ids is None else token_ids.reshape(-1)
    T = flat.shape[0]
    lspecs = None if lora is None else lora_specs(lora, expert_axis=expert_axis, tensor_axis=tensor_axis)
    params = with_experts_layout(params, "stacked")  # a copy for per-expert params: place them with shard_params
    specs = param_specs(cfg, expert_axis=expert_axis, tensor_axis=tensor_axis, fmt=format_of(params.experts))
    stat_specs = EPStats(
        local_pairs=P(expert_axis),
        remote_pairs=P(expert_axis),
        remote_rows=P(expert_axis),
        expert_load=P(),
        device_load=P(expert_axis),
    )
    if mode == "replicated":
        body = functools.partial(
            _replicated_body,
            cfg=cfg,
            impl=impl,
            expert_axis=expert_axis,
            tensor_axis=tensor_axis,
            placement=placement,
        )
        token_spec = P()
    else:
        T_pad = math.ceil(T / n) * n
        if T_pad != T:  # padding rows are marked invalid inside and send nothing
            flat = jnp.pad(flat, ((0, T_pad - T), (0, 0)))
            tids = None if tids is None else jnp.pad(tids, (0, T_pad - T))
            adapter = None if adapter is None else jnp.pad(adapter, (0, T_pad - T))
        body = functools.partial(
            _all_to_all_body,
            cfg=cfg,
            impl=impl,
            expert_axis=expert_axis,
            tensor_axis=tensor_axis,
            num_tokens=T,
            n=n,
            capacity=all_to_all_capacity(cfg, T, n, capacity_factor),
            placement=placement,
        )
        token_spec = P(expert_axis)
    in_specs = (specs, token_spec, token_spec, lspecs if lora is not None else P(), token_spec)
    fn = _shard_map(body, mesh, in_specs=in_specs, out_specs=(token_spec, stat_specs))
    args = _match_specs((params, flat, tids, lora, adapter), in_specs, mesh)
    out, stats = fn(*args)
    if _is_explicit(mesh) and token_spec != P() and (out.shape[0] != T or x.ndim != 2):
        # Explicit sharding types reject slicing off the padding or splitting T back into x's leading dims
        # while T is split unevenly: gather first (the result then follows x's own sharding below).
        out = jax.sharding.reshard(out, NamedSharding(mesh, P()))
    y = out[:T].astype(x.dtype).reshape(x.shape)
    if _is_explicit(mesh):
        y = jax.sharding.reshard(y, NamedSharding(mesh, jax.typeof(x).sharding.spec))
    if not return_stats:
        return y
    counts = {name: getattr(stats, name) for name in ("device_load", "local_pairs", "remote_pairs", "remote_rows")}
    return y, MoEStats.from_load(stats.expert_load, tokens=T, top_k=cfg.top_k, **counts)
