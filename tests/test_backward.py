"""The routed experts' backward (`moejax.backends.backward`) beyond the cases every backend passes
(tests/test_backends.py): quantized bases, only what is differentiated, work and memory that do not grow with the
number of experts, expert parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from native_inputs import ACTIVATIONS, dense, rows
from oracles import assert_close
from test_backends import random_slots

import moejax
from moejax import backends
from moejax.backends import native
from moejax.slots import Slots
from moejax.weights import to_layout


@pytest.mark.parametrize("fmt", ["int8", "int4_asym", "fp8_block", "mxfp4", "nvfp4", "int4_a8"])
@pytest.mark.parametrize("impl", ["xla_grouped", "cpu_grouped", *(["native"] * native.available())])
def test_quantized_bases_give_the_reference_input_gradients(fmt, impl):
    """QLoRA-style: the base frozen and quantized, gradients w.r.t. x and the routing weights."""
    options = {
        "int8": ("int8", {"group_size": 16}),
        "int4_asym": ("int4", {"group_size": 16, "symmetric": False}),
        "fp8_block": ("fp8_block", {}),
        "mxfp4": ("mxfp4", {}),
        "nvfp4": ("nvfp4", {}),
        "int4_a8": ("int4", {"group_size": 32, "activations": "int8"}),
    }
    name, kwargs = options[fmt]
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=6, top_k=2, hidden_size=160, intermediate_size=96)
    q = moejax.quantize(moejax.init_params(cfg, jax.random.key(0), layout="stacked"), cfg, name, **kwargs)
    experts = to_layout(q.experts, "stacked" if impl == "xla_grouped" else "per_expert")
    T = 11
    x, slots, act, probe = rows(T, 160, 1), random_slots(T, 2, 6, 2), ACTIVATIONS["silu"], rows(T, 160, 3)

    def loss(x, out_weight, impl, experts):
        return jnp.sum(backends.run_routed(impl, experts, x, Slots(slots.indices, out_weight), act) * probe)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    got = grad(x, slots.out_weight, impl, experts)
    want = grad(x, slots.out_weight, "reference", q.experts)
    assert_close(got, want, 2e-4, floor=1e-3)


def test_empty_batch_has_zero_gradients():
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=4, top_k=2, hidden_size=8, intermediate_size=6)
    params = moejax.init_params(cfg, jax.random.key(0))
    loss = lambda params, x: jnp.sum(moejax.moe_forward(params, x, cfg) ** 2)
    value, (d_params, d_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, jnp.zeros((0, 8)))
    assert float(value) == 0.0 and d_x.shape == (0, 8)
    assert all(float(jnp.abs(g).sum()) == 0 for g in jax.tree.leaves(d_params))


def test_only_what_is_differentiated_is_computed():
    """With the experts frozen (adapters or x trained) the backward forms no weight gradient: the grad program
    w.r.t. x alone has fewer dots than w.r.t. x and the experts."""
    experts, act = dense(4, 16, 8), ACTIVATIONS["silu"]
    x, slots, probe = rows(20, 16, 1), random_slots(20, 2, 4, 2), rows(20, 16, 3)
    loss = lambda experts, x: jnp.sum(backends.run_routed("xla_grouped", experts, x, slots, act) * probe)
    dots = lambda argnums: str(jax.make_jaxpr(jax.grad(loss, argnums))(experts, x)).count("dot_general")
    assert dots(1) < dots((0, 1))


def _static_work(jaxpr, multiplicity: int = 1) -> int:
    """FLOPs of the dots that run whatever the routing: a scan's body `length` times, the cheapest branch of a
    cond, a while loop's body not at all (its trip count is data: the experts used and their routed pairs)."""
    as_jaxpr = lambda v: v if hasattr(v, "eqns") else v.jaxpr if hasattr(getattr(v, "jaxpr", None), "eqns") else None
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
            total += multiplicity * 2 * int(np.prod(out.shape)) * int(np.prod([lhs.shape[d] for d in lc]))
        length = {"scan": eqn.params.get("length", 1), "while": 0}.get(eqn.primitive.name, 1)
        for param in eqn.params.values():
            if isinstance(param, tuple):  # a cond's branches: the cheapest runs whatever the routing
                total += min([_static_work(as_jaxpr(b), multiplicity) for b in param if as_jaxpr(b)], default=0)
            elif (inner := as_jaxpr(param)) is not None:
                total += _static_work(inner, multiplicity * length)
    return total


@pytest.mark.parametrize("impl,layout", [("xla_grouped", "stacked"), ("cpu_grouped", "per_expert")])
def test_backward_work_and_memory_do_not_grow_with_the_number_of_experts(impl, layout):
    """No dot of the grad program runs for every expert whatever the routing (the dense reference's backward
    scans all E: its routing-independent work grows with E, the grouped backward's not at all; E = 16 and 256,
    64 for the per-expert layout, which compiles a loop per part),
    and its compiled temporary memory stays within 2·T·K·(H+3I)·4 bytes at both E (same T, K), plus the
    gradient outputs for the per-expert layout."""
    T, K, H, I = 64, 4, 32, 16
    act = ACTIVATIONS["silu"]
    x, probe = rows(T, H, 1), rows(T, H, 3)
    work, temp, dense_work = {}, {}, {}
    small, large = 16, 256 if layout == "stacked" else 64  # the per-expert layout compiles a loop per part
    for E in (small, large):
        experts = jax.eval_shape(lambda E=E: to_layout(dense(E, H, I), layout))
        slots = random_slots(T, K, E, 2)
        for name, backend in (("grouped", impl), ("reference", "reference")):
            loss = lambda e, x, s=slots, b=backend: jnp.sum(backends.run_routed(b, e, x, s, act) * probe)
            grad = jax.grad(loss, argnums=(0, 1))
            stacked = jax.eval_shape(lambda E=E: dense(E, H, I)) if backend == "reference" else experts
            amount = _static_work(jax.make_jaxpr(grad)(stacked, x).jaxpr)
            (work if name == "grouped" else dense_work)[E] = amount
        temp[E] = jax.jit(grad_of(impl, slots, act, probe)).lower(experts, x).compile().memory_analysis()
        temp[E] = temp[E].temp_size_in_bytes
    assert work[large] <= work[small], work
    assert dense_work[large] >= large // small * dense_work[small] > 0  # the measure tells a backward over all E
    budget = {E: 2 * T * K * (H + 3 * I) * 4 for E in temp}  # the routed pairs' rows and activations, twice
    if layout == "per_expert":  # each part's gradient is formed in its loop's buffer, then becomes an output
        budget = {E: budget[E] + 3 * E * H * I * 4 for E in temp}
    assert all(temp[E] <= budget[E] for E in temp), (temp, budget)


def grad_of(impl, slots, act, probe):
    return jax.grad(lambda e, x: jnp.sum(backends.run_routed(impl, e, x, slots, act) * probe), argnums=(0, 1))


@pytest.mark.parametrize(
    "mode,axis_type,capacity",
    [
        ("replicated", "explicit", 8.0),
        ("replicated", "auto", 8.0),
        ("all_to_all", "explicit", 8.0),
        ("all_to_all", "auto", 8.0),
        ("all_to_all", "auto", 0.1),  # several rounds and chunks
    ],
)
def test_expert_parallel_gradients_equal_one_devices(mode, axis_type, capacity):
    """Gradients w.r.t. x, the router and the experts under EP (psum and all_to_all) equal one device's."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=8, top_k=2, hidden_size=24, intermediate_size=12)
    params = moejax.init_params(cfg, jax.random.key(0), layout="stacked")
    kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}[axis_type]
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4], axis_types=(kind,))
    x, probe = rows(12, 24, 1), rows(12, 24, 3)

    def loss(params, x, ep):
        if ep:
            y = moejax.parallel.moe_forward_ep(params, x, cfg, mesh=mesh, mode=mode, capacity_factor=capacity)
        else:
            y = moejax.moe_forward(params, x, cfg, impl="xla")
        return jnp.sum(y * probe)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    sharded = moejax.sharding.shard_params(params, cfg, mesh)
    if axis_type == "explicit":
        with pytest.raises(NotImplementedError, match=r"jax\.set_mesh"):  # x typed without the mesh: no backward
            grad(sharded, x, True)
        x = jax.device_put(x, NamedSharding(mesh, P()))
    got = grad(sharded, x, True)
    want = grad(params, jax.device_get(x), False)
    assert_close(jax.device_get(got), jax.device_get(want), 1e-4, floor=1e-3)
    assert float(jnp.abs(want[0].router.kernel).max()) > 1e-3  # the router learns through the weights
