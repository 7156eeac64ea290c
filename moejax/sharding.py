"""Where the block's arrays live on a mesh: the `PartitionSpec`s of the parameters and the LoRA stack, their
placement (`shard_params`, `shard_lora`), the mesh checks, and the two `shard_map` helpers every dispatch mode uses
(the compatibility shim and the reshard of an Explicit mesh)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import dispatch as jax_dispatch  # a private registry of jax 0.10, as pallas_kernels.platform
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.backends import may_run_kernels
from moejax.config import MoEConfig
from moejax.lora import LoRAPair, LoRAParams, check_lora, from_pairs
from moejax.params import MoEParams, array_specs, unflatten, with_experts_layout
from moejax.placement import Placement
from moejax.weights import ExpertFormat, ExpertWeights, PerExpert, format_of

Array = jax.Array

# The varying-manual-axes check is off: the plans' loops start from fresh (device-invariant) zeros and carry
# values that vary over the expert axis, and the math must not learn about sharding to satisfy the checker.
# Replication of the outputs holds by construction (psum results and terms computed from replicated inputs).
if hasattr(jax, "shard_map"):

    def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

else:  # JAX versions before `jax.shard_map` became public.
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
        return _experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def is_explicit(mesh: Mesh) -> bool:
    """Whether the mesh has Explicit axes (array types then carry their sharding)."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def meshless(x: Array) -> bool:
    """Whether x lives in a program without mesh types: x's type carries no mesh (under jit: x was not made or
    resharded on a mesh with Explicit axes) and no mesh context is set (`jax.set_mesh`)."""
    return jax.typeof(x).sharding.mesh.empty and jax.sharding.get_abstract_mesh().empty


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Auto: arrays computed on it carry no mesh in their types."""
    return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def traced(fn: Callable, *args) -> tuple[Callable[[], Any], bool]:
    """`fn(*args)` traced once: (a call that runs what was traced, whether it holds a primitive that asks for the
    program's devices while lowering). Such a primitive (a backend chosen by device kind,
    `pallas_kernels.platform.choose_at_lowering`) makes JAX require one mesh, axis types included, across the
    whole program. A JAX without that registry: False."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    check = getattr(jax_dispatch, "jaxpr_has_prim_requiring_devices", None)
    run = lambda: jax.tree.unflatten(jax.tree.structure(shape), jaxpr_as_fun(closed)(*jax.tree.leaves(args)))
    return run, check is not None and check(closed.jaxpr)


def match_specs(tree, specs, mesh: Mesh):
    """`tree` resharded to `specs` (a pytree prefix of it) on a mesh with Explicit axes, where `shard_map` wants
    the array types to equal its in_specs (a no-op when they already do). Auto meshes reshard on their own."""
    if not is_explicit(mesh):
        return tree
    place = lambda spec, a: jax.sharding.reshard(a, NamedSharding(mesh, spec))
    return jax.tree.map(lambda spec, sub: jax.tree.map(functools.partial(place, spec), sub), specs, tree)


# -- specs -------------------------------------------------------------------------------------------------


def logical_axis_rules(expert_axis: str = "expert", tensor_axis: str | None = None) -> tuple[tuple[str, str | None]]:
    """Logical axis name -> mesh axis (`flax.nnx.logical_axis_rules` form) for the names of `LOGICAL_AXES`."""
    return (("expert", expert_axis), ("mlp", tensor_axis), ("embed", None))


def runs_replicated(name: str) -> bool:
    """Whether parameter `name` is replicated whatever the rules: the router (Gemma-4's per-expert scale
    included, though its logical axis is `expert`) and the expert pre-norm run on every device for the tokens
    that device holds."""
    return not name.startswith(("experts.", "shared."))


def partition_specs(
    cfg: MoEConfig,
    *,
    expert_axis: str | None = "expert",
    tensor_axis: str | None = None,
    fmt: type[ExpertFormat] = ExpertWeights,
) -> MoEParams:
    """The `PartitionSpec` of every parameter of `cfg` (experts stacked in format `fmt`), as a `MoEParams` pytree
    (the `shard_map` in_specs), from the logical axes of `moejax.params.array_specs`."""
    rules = dict(logical_axis_rules(expert_axis, tensor_axis))
    specs = {
        name: P() if runs_replicated(name) else P(*(rules[a] if a else None for a in spec.axes))
        for name, spec in array_specs(cfg, fmt).items()
    }
    return unflatten(specs, fmt)


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


def operand_specs(operands: tuple[MoEParams, LoRAParams | None], cfg: MoEConfig, expert_axis, tensor_axis):
    """The in_specs of the pipeline's replicated operands `(params, lora)` (stacked experts) under expert
    parallelism."""
    params, lora = operands
    specs = partition_specs(cfg, expert_axis=expert_axis, tensor_axis=tensor_axis, fmt=format_of(params.experts))
    return specs, None if lora is None else lora_specs(lora, expert_axis=expert_axis, tensor_axis=tensor_axis)


# -- checks ------------------------------------------------------------------------------------------------


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


def logical_views(params: MoEParams, lora: LoRAParams | None, cfg: MoEConfig, placement: Placement):
    """`(params, lora)` laid out by `placement`'s S slots, seen as E experts (shapes only) for the input checks of
    `moe_forward`. Raises `ValueError` when the experts (or their adapters) are not S slots."""
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
    params = dataclasses.replace(params, experts=view, placement=None)  # the placement is checked on its own
    if lora is None or lora.experts is None:
        return params, lora
    first = next(p for p in (lora.experts.gate, lora.experts.up, lora.experts.down) if p is not None)
    if first.a.shape[1] != placement.num_slots:
        raise ValueError(
            f"lora.experts has {first.a.shape[1]} experts, but placement has num_slots={placement.num_slots}: "
            "lay the adapters out with shard_lora(..., placement=placement)"
        )
    logical = lambda w: jax.ShapeDtypeStruct((w.shape[0], E, *w.shape[2:]), w.dtype)
    as_logical = lambda p: dataclasses.replace(p, a=logical(p.a), b=logical(p.b))
    return params, dataclasses.replace(lora, experts=jax.tree.map(as_logical, lora.experts, is_leaf=_is_pair))


# -- placement on a mesh -----------------------------------------------------------------------------------


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
    specs = partition_specs(cfg, expert_axis=expert_axis, tensor_axis=tensor_axis, fmt=format_of(params.experts))
    placed = jax.tree.map(functools.partial(_place, mesh), params, specs)
    return dataclasses.replace(placed, placement=placement)  # the layout travels with the arrays


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
