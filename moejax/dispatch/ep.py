"""What the two expert-parallel modes share: the mesh, its axes and the placement, the checks, the `shard_map`
of the pipeline with the experts split over the expert axis, and the statistics."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.dispatch.base import Dispatch
from moejax.params import with_experts_layout
from moejax.placement import Placement, check_placement
from moejax.sharding import (
    auto_axes,
    check_kernels_can_run,
    check_mesh,
    is_explicit,
    logical_views,
    match_specs,
    meshless,
    operand_specs,
    shard_map,
    traced,
)
from moejax.stats import MoEStats


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Dispatch):
    """Routed experts split over `expert_axis` of `mesh` (each device holds E/n consecutive experts, or with a
    `placement` S/n of its slots); with a `tensor_axis`, I and the shared expert's Is split over it."""

    mesh: Mesh
    expert_axis: str = "expert"
    tensor_axis: str | None = None
    placement: Placement | None = None

    token_split = False  # whether the rows are split over the expert axis (else every device holds them all)

    @property
    def num_devices(self) -> int:
        return self.mesh.shape[self.expert_axis]

    @property
    def reduce_shared(self):
        if self.tensor_axis is None:
            return None
        return lambda y: jax.lax.psum(y, self.tensor_axis)

    def check(self, operands, cfg, impl):
        """The mesh, the kernels on it, and the placement `params` were laid out by; views in logical order."""
        check_mesh(cfg, self.mesh, self.expert_axis, self.tensor_axis, placement=self.placement)
        check_kernels_can_run(impl, self.mesh)
        params, adapters = operands
        views = operands if self.placement is None else logical_views(params, adapters, cfg, self.placement)
        check_placement(getattr(params, "placement", None), self.placement)
        # The placement is recorded and checked: the specs carry none. Per-expert params are stacked on every call.
        params = with_experts_layout(dataclasses.replace(params, placement=None), "stacked")
        return (params, adapters), views

    def run(self, body, operands, rows, *, cfg, with_stats):
        x = rows["x"]
        lead = x.shape[:-1]
        T = math.prod(lead)
        flat = jax.tree.map(lambda a: a.reshape(T, *a.shape[len(lead) :]), rows)
        n = self.num_devices
        padded = -(-T // n) * n if self.token_split else T
        if padded != T:  # padding rows are marked invalid inside and send nothing
            flat = jax.tree.map(lambda a: jnp.pad(a, ((0, padded - T),) + ((0, 0),) * (a.ndim - 1)), flat)
        spec = P(self.expert_axis) if self.token_split else P()
        in_specs = (operand_specs(operands, cfg, self.expert_axis, self.tensor_axis), spec)
        out_specs = (spec, self._stat_specs() if with_stats else P())
        explicit = is_explicit(self.mesh)
        fn = shard_map(body, self.mesh, in_specs, out_specs)
        run = lambda: fn(*match_specs((operands, flat), in_specs, self.mesh))
        if explicit and meshless(x):
            # x's type carries no mesh (a model's activations, made inside its jit outside any mesh context): run
            # on the mesh's Auto view, so that y's type carries none either and meets the model's other arrays
            # (a KV cache made in the same jit) without a sharding type error. Not where a backend asks for the
            # devices while lowering: JAX then wants one mesh across the program (y then carries the mesh).
            on_auto_view, needs_devices = traced(
                _forward_only(shard_map(body, auto_axes(self.mesh), in_specs, out_specs)),
                operands,
                flat,
            )
            if not needs_devices:
                run, explicit = on_auto_view, False
        outputs, stats = run()
        if explicit and self.token_split and (padded != T or len(lead) != 1):
            # Explicit sharding types reject slicing off the padding or splitting T back into x's leading dims
            # while T is split unevenly: gather first (the result then follows x's own sharding below).
            outputs = jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(self.mesh, P())), outputs)
        outputs = jax.tree.map(lambda a: a[:T].reshape(*lead, *a.shape[1:]), outputs)
        if explicit:
            x_spec = P(*tuple(jax.typeof(x).sharding.spec)[: len(lead)])
            outputs = jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(self.mesh, x_spec)), outputs)
        return outputs, stats

    def _stat_specs(self) -> MoEStats:
        per_device = P(self.expert_axis)
        return MoEStats(
            expert_load=P(),
            union_size=P(),
            zero_pairs=P(),
            tokens=P(),
            calls=P(),
            device_load=per_device,
            local_pairs=per_device,
            remote_pairs=per_device,
            remote_rows=per_device,
        )

    def tensor_step(self, step):
        """`step` on this device's slice of I: the down-projection bias is added by tensor shard 0 only."""
        experts = step.experts
        if self.tensor_axis is None or getattr(experts, "down_bias", None) is None:
            return step
        first_shard = jax.lax.axis_index(self.tensor_axis) == 0
        experts = dataclasses.replace(experts, down_bias=jnp.where(first_shard, experts.down_bias, 0))
        return dataclasses.replace(step, experts=experts)


def _forward_only(fn):
    """`fn(operands, rows)` (a `shard_map` on a mesh's Auto view) whose gradient raises a moejax error naming the
    fix: parameters placed on the Explicit axes (`shard_params`) would get cotangents of the Auto view's type,
    which JAX's backward refuses with an error about equal-looking types."""

    @jax.custom_vjp
    def forward_only(operands, rows):
        return fn(operands, rows)

    def backward(residuals, cotangent):
        raise NotImplementedError(
            "moejax: gradients of moe_forward_ep on a mesh with Explicit axes need x typed on that mesh: place it "
            "(jax.device_put(x, NamedSharding(mesh, P()))) or call inside `with jax.set_mesh(mesh):`; an x without "
            "a mesh runs the forward on the mesh's Auto view, which has no backward for Explicit-typed parameters"
        )

    forward_only.defvjp(lambda operands, rows: (fn(operands, rows), None), backward)
    return forward_only
