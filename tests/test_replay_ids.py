"""Replayed routings with ids outside [0, num_selectable): one rule on every backend and dispatch mode. Such a
slot contributes nothing, as if its weight were 0, whatever the ids' integer type (an id is compared in its own
type: a uint32 id >= 2**31 or a host int64 id >= 2**32 is large, never wrapped into a valid id); the checked
forward raises for them.

The traps this guards: a plan that gathers an expert by a negative id wraps it to a valid expert, and a host
int64 id of 2**32 + 1 cast to int32 becomes expert 1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax import backends
from moejax import dispatch as D
from moejax.backends import native
from moejax.sharding import shard_params
from moejax.slots import Slots, expert_activation

E, K = 8, 2
CFG = moejax.MoEConfig.preset("qwen3_moe", hidden_size=16, intermediate_size=8, num_experts=E, top_k=K)
STATIC = ("cfg", "impl", "dispatch")
forward = jax.jit(moejax.moe_forward, static_argnames=STATIC)
# Slots given an invalid id: a whole row (3), single slots of others.
BAD = np.zeros((8, K), bool)
BAD[0, 0] = BAD[3, :] = BAD[5, 1] = BAD[6, 0] = True

# name -> (ids of the bad slots, cycled; how the routing carries them). Device arrays of every integer type jax
# holds without x64, and host numpy int64 (past int32 both ways).
INVALID = {
    "int32": ([-1, E, -(2**31), 2**31 - 1], lambda ids: jnp.asarray(ids, jnp.int32)),
    "uint32": ([2**31, 2**32 - 1, E, 2**31 + 1], lambda ids: jnp.asarray(np.asarray(ids, np.uint32))),
    "int8": ([-1, -128, 127, E], lambda ids: jnp.asarray(np.asarray(ids, np.int8))),
    "host int64": ([2**32 + 1, -(2**40), 2**31, 2**32 + 3], lambda ids: np.asarray(ids, np.int64)),
}


@functools.cache
def _setup(T=6, layout="stacked"):
    params = moejax.init_params(CFG, jax.random.key(0), layout=layout)
    x = jax.random.normal(jax.random.key(1), (T, CFG.hidden_size))
    return params, x, moejax.route(params, x, CFG)


def _with_invalid(routing, case):
    """(the routing with BAD's slots given invalid ids in the case's type, the routing that zeroes their weights)."""
    values, carry = INVALID[case]
    T = routing.indices.shape[0]
    bad = BAD[:T]
    ids = np.asarray(routing.indices).astype(np.int64)
    ids[bad] = np.resize(values, bad.sum())
    invalid = moejax.Routing(carry(ids), routing.weights, routing.logits, routing.zero_weight)
    zeroed = moejax.Routing(routing.indices, jnp.where(bad, 0.0, routing.weights), routing.logits, routing.zero_weight)
    return invalid, zeroed


BACKENDS = ["reference", "native", "cpu_decode", "cpu_grouped", "xla_decode", "xla_grouped", "ragged", "pallas_decode"]
# The grouped kernel's interpretation costs seconds per call: one case.
CASES = [(impl, case) for impl in BACKENDS for case in INVALID] + [("pallas_grouped", "host int64")]


@pytest.mark.parametrize(("impl", "case"), CASES)
def test_invalid_replayed_ids_contribute_nothing_on_every_backend(impl, case):
    if impl == "native" and not native.available():
        pytest.skip("the native extension is not built")
    params, x, routing = _setup(layout="per_expert" if impl.startswith("cpu") else "stacked")
    invalid, zeroed = _with_invalid(routing, case)
    want = forward(params, x, CFG, impl=impl, routing=zeroed)
    got = moejax.moe_forward(params, x, CFG, impl=impl, routing=invalid)  # eager: host int64 stays on the host
    np.testing.assert_array_equal(got, want)
    assert np.all(np.isfinite(got)) and not np.array_equal(got, forward(params, x, CFG, impl=impl, routing=routing))


def _dispatch(name):
    """(dispatch, params placed for it, x placed for it) of one mode on the 8 CPU devices."""
    params, x, _ = _setup(8)
    if name == "rows":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        return D.Rows(mesh), params, jax.device_put(x, NamedSharding(mesh, P("data")))
    mesh = jax.make_mesh((8,), ("expert",))
    mode = D.expert_parallel("replicated" if name == "ep_psum" else "all_to_all", mesh)
    return mode, shard_params(params, CFG, mesh), x


@pytest.mark.parametrize("mode", ["rows", "ep_psum", "ep_all_to_all"])
def test_invalid_replayed_ids_contribute_nothing_in_every_dispatch_mode(mode):
    """Row and expert parallelism on 8 devices (one expert each), the grouped plan. Ids reach a dispatch mode as
    int32 with the invalid ones replaced (`replayed_indices`, each id type checked on every backend above): a
    device and a host id type here (each type's eager call compiles the 8-device program anew)."""
    dispatch, params, x = _dispatch(mode)
    _, _, routing = _setup(8)
    want = None
    for case in ("int32", "host int64"):
        invalid, zeroed = _with_invalid(routing, case)
        if want is None:
            want = forward(params, x, CFG, impl="xla_grouped", dispatch=dispatch, routing=zeroed)
        got = moejax.moe_forward(params, x, CFG, impl="xla_grouped", dispatch=dispatch, routing=invalid)
        np.testing.assert_array_equal(got, want, err_msg=case)


@pytest.mark.parametrize("case", list(INVALID))
def test_checked_forward_raises_for_invalid_replayed_ids(case):
    params, x, routing = _setup()
    invalid, _ = _with_invalid(routing, case)
    with pytest.raises(checkify.JaxRuntimeError, match=r"routing.indices outside \[0, num_selectable=8\)"):
        moejax.checked_moe_forward(params, x, CFG, routing=invalid)
    checked = moejax.checked_moe_forward(params, x, CFG, routing=routing)
    np.testing.assert_array_equal(checked, forward(params, x, CFG, impl="auto", routing=routing))


def test_forward_with_checks_takes_routing_inside_jit():
    params, x, routing = _setup()
    invalid, _ = _with_invalid(routing, "uint32")
    step = jax.jit(lambda p, v, r: moejax.forward.moe_forward_with_checks(p, v, CFG, routing=r))
    err, _ = checkify.checkify(step)(params, x, invalid)
    assert "routing.indices outside" in str(err.get())
    err, y = checkify.checkify(step)(params, x, routing)
    assert err.get() is None
    np.testing.assert_array_equal(y, forward(params, x, CFG, impl="auto", routing=routing))


PLANS = ["reference", "cpu_decode", "cpu_grouped", "xla_decode", "xla_grouped", "ragged", "pallas_decode"]


@pytest.mark.parametrize("impl", PLANS)
def test_plans_skip_ids_outside_their_experts_in_hand_made_slots(impl):
    """`Slots` built by hand (not through `moe_forward`) with negative ids and ids >= E, weights left non-zero:
    each plan skips them itself, as if their weights were 0."""
    params, x, routing = _setup(layout="per_expert" if impl.startswith("cpu") else "stacked")
    bad = BAD[: x.shape[0]]
    indices = jnp.where(bad, jnp.asarray(np.resize([-1, E, -7, 2**30], bad.shape)), routing.indices)
    act = expert_activation(CFG)
    run = jax.jit(lambda experts, x, slots: backends.BACKENDS[impl].run(experts, x, slots, act))
    got = run(params.experts, x, Slots(indices, routing.weights))
    want = run(params.experts, x, Slots(routing.indices, jnp.where(bad, 0.0, routing.weights)))
    np.testing.assert_array_equal(got, want)
