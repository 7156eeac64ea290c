"""Expert parallelism on 8 simulated CPU devices against the single-device `moe_forward`.

Every program is jitted once per (config, mesh) and cached at module level, so tests that only change values
(routing, inputs) reuse it; the 8-device compiles dominate the run time on a small CPU.
"""

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multihost_worker import numpy_params
from tables import table

import moejax
from moejax import dispatch, parallel, sharding
from moejax.forward import expert_input
from moejax.params import flatten, with_experts_layout
from moejax.placement import balance
from moejax.slots import shared_expert_ffn, slots_from_routing

TOL = {"rtol": 2e-5, "atol": 2e-5}
# The grid runs small plans in both modes (replicated: the decode plan on T=8; all_to_all: 7 tokens, one per device
# on 8 devices), which compile fastest; the tensor-axis and module tests run the grouped plan (T > 8).
T_DECODE = 8
T_PREFILL = 7
T_GROUPED = (12, 13)
SMALL = {"hidden_size": 32, "intermediate_size": 16}

CONFIGS = {
    # gated shared expert
    "qwen3_next": moejax.MoEConfig.preset("qwen3_next", **SMALL, shared_intermediate_size=16),
    # ungated shared expert, group-limited routing (4 groups, 2 kept), E=32
    "deepseek_v3": moejax.MoEConfig.preset("deepseek_v3", **SMALL),
    # zero-computation experts: E=16 real (divisible by 8) + 8 identity experts
    "longcat_flash": moejax.MoEConfig.preset("longcat_flash", **SMALL, num_experts=16, num_zero_experts=8),
    # hash routing by token id, clamped experts and shared expert
    "deepseek_v4": moejax.MoEConfig.preset("deepseek_v4", **SMALL, hash_routing=True, vocab_size=64),
}
TENSOR_CONFIGS = {
    "qwen3_next": CONFIGS["qwen3_next"],
    "gpt_oss": moejax.MoEConfig.preset("gpt_oss", **SMALL),  # expert biases: the down bias once per I split
    "step3p7": moejax.MoEConfig.preset("step3p7", **SMALL, shared_intermediate_size=16),  # output scaling
}
# Every term that must be added exactly once: zero experts, a sigmoid-gated shared expert.
ONCE_CFG = CONFIGS["longcat_flash"].replace(shared_expert="sigmoid_gated", shared_intermediate_size=16)


def _mesh(n: int) -> Mesh:
    return jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n])


def _tensor_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("expert", "tensor"))  # Auto axes (make_mesh: Explicit)


@functools.cache
def _case(cfg: moejax.MoEConfig, t_replicated: int = T_DECODE, t_all_to_all: int = T_PREFILL, seed: int = 0):
    """(params, x_replicated, x_all_to_all, tids_replicated, tids_all_to_all) and the single-device outputs."""
    rng = np.random.default_rng(seed + 1)
    xd = jnp.asarray(rng.standard_normal((t_replicated, cfg.hidden_size), np.float32))
    xf = jnp.asarray(rng.standard_normal((t_all_to_all, cfg.hidden_size), np.float32))
    td = tf = None
    if cfg.hash_routing:
        td, tf = (jnp.asarray(rng.integers(0, cfg.vocab_size, t, dtype=np.int32)) for t in (t_replicated, t_all_to_all))
    inputs = (numpy_params(cfg, seed), xd, xf, td, tf)
    return inputs, _reference(*inputs, cfg)


@functools.partial(jax.jit, static_argnums=5)
def _reference(params, xd, xf, td, tf, cfg):
    return moejax.moe_forward(params, xd, cfg, td), moejax.moe_forward(params, xf, cfg, tf)


@functools.cache
def _both_modes(cfg: moejax.MoEConfig, mesh: Mesh, tensor_axis: str | None = None):
    """A jitted program running "replicated" on the decode input and "all_to_all" on the prefill input."""
    traces = []

    def run(params, xd, xf, td, tf):
        traces.append(1)  # counts traces: a retrace would be a recompile
        ep = functools.partial(moe_forward_ep, cfg=cfg, mesh=mesh, tensor_axis=tensor_axis, return_stats=True)
        d, f = ep(params, xd, mode="replicated", token_ids=td), ep(params, xf, mode="all_to_all", token_ids=tf)
        return (d.y, d.stats), (f.y, f.stats)

    return jax.jit(run), traces


moe_forward_ep = parallel.moe_forward_ep


def _placed(mesh: Mesh, *arrays):
    """Inputs committed to the mesh, replicated, as the EP program's callers hold them (no transfer at call time)."""
    return [None if a is None else jax.device_put(a, NamedSharding(mesh, P())) for a in arrays]


def _expected_load(params, x, tids, cfg):
    routing = moejax.route(params, x, cfg, tids)
    ids = np.asarray(routing.indices).reshape(-1)
    return np.bincount(ids[ids < cfg.num_experts], minlength=cfg.num_experts)


def _check_stats(stats, load, mode, n):
    assert stats.local_pairs.shape == (n,)
    np.testing.assert_array_equal(stats.expert_load, load)
    moved = np.asarray(stats.local_pairs) + np.asarray(stats.remote_pairs)
    assert moved.sum() == load.sum()  # every pair computed exactly once: nothing dropped
    if mode == "replicated":
        np.testing.assert_array_equal(stats.local_pairs, load.reshape(n, -1).sum(1))
        assert not np.any(stats.remote_rows)


# -- equality with the single-device forward -------------------------------------------------------------


# Every family on 8 devices (one or two local experts each) and on one of 1 (no exchange), 2, 4 (several local
# experts; DeepSeek-V3's expert groups over 2 devices). The full grid: MOEJAX_TESTS_FULL=1 (tests/tables.py).
GRID = table(
    {"family": list(CONFIGS), "n": [1, 2, 4, 8]},
    [(family, 8) for family in CONFIGS]
    + [("qwen3_next", 1), ("deepseek_v3", 2), ("longcat_flash", 4), ("deepseek_v4", 2)],
)


@pytest.mark.parametrize(("family", "n"), GRID)
def test_both_modes_equal_single_device(family, n):
    cfg = CONFIGS[family]
    (params, xd, xf, td, tf), (ref_d, ref_f) = _case(cfg)
    mesh = _mesh(n)
    fn, _ = _both_modes(cfg, mesh)
    (yd, sd), (yf, sf) = fn(sharding.shard_params(params, cfg, mesh), *_placed(mesh, xd, xf, td, tf))
    np.testing.assert_allclose(yd, ref_d, **TOL)
    np.testing.assert_allclose(yf, ref_f, **TOL)
    _check_stats(sd, _expected_load(params, xd, td, cfg), "replicated", n)
    _check_stats(sf, _expected_load(params, xf, tf, cfg), "all_to_all", n)


@pytest.mark.parametrize("family", list(TENSOR_CONFIGS))
def test_expert_and_tensor_axes_2x4(family):
    cfg = TENSOR_CONFIGS[family]
    (params, xd, xf, td, tf), (ref_d, ref_f) = _case(cfg, *T_GROUPED)
    mesh = _tensor_mesh()
    sharded = sharding.shard_params(params, cfg, mesh, tensor_axis="tensor")
    assert sharded.experts.gate.sharding.spec == P("expert", None, "tensor")
    assert sharded.experts.down.sharding.shard_shape(sharded.experts.down.shape) == (
        cfg.num_experts // 2,
        cfg.intermediate_size // 4,
        cfg.hidden_size,
    )
    fn, _ = _both_modes(cfg, mesh, "tensor")
    (yd, _), (yf, _) = fn(sharded, xd, xf, td, tf)
    np.testing.assert_allclose(yd, ref_d, **TOL)
    np.testing.assert_allclose(yf, ref_f, **TOL)


# -- the classic EP bugs ------------------------------------------------------------------------------------


def test_once_terms_added_after_the_reduction_and_buggy_orders_differ():
    """The shared expert and the zero-expert term added once per device, or the shared gate dropped: each bug
    built from the same per-device pieces gives an answer the equality check rejects."""
    cfg = ONCE_CFG
    n = 4
    mesh = _mesh(n)
    (params, xd, _, _, _), (ref, _) = _case(cfg)

    def body(params, x):
        num_local = params.experts.num_experts
        routing = moejax.route(params, x, cfg)
        x_e = expert_input(params, x, cfg)
        local = dispatch.localize(slots_from_routing(routing, cfg), jax.lax.axis_index("expert") * num_local, num_local)
        partial = parallel.partial_routed_sum(params.experts, x_e, local, cfg, impl="xla", num_pairs=x.size)
        reduced = jax.lax.psum(partial, "expert")
        shared = shared_expert_ffn(x_e, params.shared, cfg)
        zero_term = routing.zero_weight[:, None] * x_e
        no_zero = dataclasses.replace(routing, zero_weight=None)
        return {
            "correct": parallel.add_once(reduced, x_e, routing, params.shared, cfg),
            "shared_per_device": parallel.add_once(jax.lax.psum(partial + shared, "expert"), x_e, routing, None, cfg),
            "zero_per_device": parallel.add_once(
                jax.lax.psum(partial + zero_term, "expert"), x_e, no_zero, params.shared, cfg
            ),
            "gate_dropped": parallel.add_once(
                reduced, x_e, routing, dataclasses.replace(params.shared, gate_kernel=None), cfg
            ),
        }

    specs = sharding.partition_specs(cfg)
    run = jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
    sharded = sharding.shard_params(params, cfg, mesh)
    variants = jax.jit(run)(sharded, xd)
    np.testing.assert_allclose(variants.pop("correct"), ref, **TOL)
    for bug, y in variants.items():
        assert float(jnp.max(jnp.abs(y - ref))) > 100 * TOL["atol"], f"{bug} is indistinguishable from correct"
    (yd, _), _ = _both_modes(cfg, mesh)[0](sharded, xd, xd, None, None)
    np.testing.assert_allclose(yd, ref, **TOL)


# -- load, transfers, recompiles --------------------------------------------------------------------------


def test_uneven_load_all_tokens_to_one_device_nothing_dropped():
    cfg = CONFIGS["deepseek_v3"]  # E=32 on 8 devices: device 0 owns experts 0..3, all of group 0
    n, num_local = 8, 4
    (params, xd, xf, td, tf), _ = _case(cfg)
    bias = params.router.correction_bias.at[:num_local].add(10.0)  # selection only: every token picks 0..3
    params = dataclasses.replace(params, router=dataclasses.replace(params.router, correction_bias=bias))
    ref_d, ref_f = _reference(params, xd, xf, td, tf, cfg)
    mesh = _mesh(n)
    fn, _ = _both_modes(cfg, mesh)
    (yd, sd), (yf, sf) = fn(sharding.shard_params(params, cfg, mesh), *_placed(mesh, xd, xf, td, tf))
    np.testing.assert_allclose(yd, ref_d, **TOL)
    np.testing.assert_allclose(yf, ref_f, **TOL)
    K = cfg.top_k
    np.testing.assert_array_equal(sf.expert_load, [T_PREFILL] * num_local + [0] * (cfg.num_experts - num_local))
    tokens_per_device = np.bincount(np.arange(T_PREFILL), minlength=n)  # 7 tokens padded to 8: one each
    np.testing.assert_array_equal(sf.local_pairs, [K * tokens_per_device[0]] + [0] * (n - 1))
    np.testing.assert_array_equal(sf.remote_pairs, [0, *(K * tokens_per_device[1:])])
    np.testing.assert_array_equal(sf.remote_rows, [0, *tokens_per_device[1:]])  # one row per token, to device 0
    np.testing.assert_array_equal(sd.local_pairs, [K * T_DECODE] + [0] * (n - 1))


def test_jitted_ep_forward_has_no_host_transfers_and_does_not_recompile_across_routings():
    cfg = CONFIGS["qwen3_next"]
    n = 8
    mesh = _mesh(n)
    (params, xd, xf, td, tf), _ = _case(cfg)
    fn, traces = _both_modes(cfg, mesh)  # the program of test_both_modes_equal_single_device[qwen3_next-8]
    sharded = sharding.shard_params(params, cfg, mesh)
    fn(sharded, *_placed(mesh, xd, xf, td, tf))  # compiled here unless that test ran first
    compiled_traces = len(traces)
    cache_size = fn._cache_size() if hasattr(fn, "_cache_size") else None
    loads = []
    rng = np.random.default_rng(100)
    for _ in range(3):
        xd2, xf2 = _placed(mesh, rng.standard_normal(xd.shape, np.float32), rng.standard_normal(xf.shape, np.float32))
        with jax.transfer_guard("disallow"):
            (yd, sd), (yf, _) = fn(sharded, xd2, xf2, td, tf)
            jax.block_until_ready((yd, yf))
        loads.append(np.asarray(sd.expert_load))
    assert len(traces) == compiled_traces
    if cache_size is not None:
        assert fn._cache_size() == cache_size
    assert not all(np.array_equal(loads[0], load) for load in loads[1:])  # the routing did change


# -- inside a model --------------------------------------------------------------------------------------------


def _typed_axes(a) -> tuple[str, ...]:
    """The Explicit mesh axes in a's type: what a sharding type check compares."""
    mesh = jax.typeof(a).sharding.mesh
    return tuple(
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == jax.sharding.AxisType.Explicit
    )


@pytest.mark.parametrize(("mode", "B"), [("replicated", 2), ("all_to_all", 12)])  # the decode and grouped plans
def test_ep_inside_a_jitted_decode_step_with_a_kv_cache_made_in_jit(mode, B):
    """A model's decode loop as users write it: `jax.make_mesh` (Explicit axes), no mesh context, the activations
    and the KV cache made inside the jitted step. The EP output carries x's sharding type (none), so the cache
    update traces (it raised a ShardingTypeError naming the EP mesh), and equals the single-device forward. Under
    `jax.set_mesh(mesh)` the step's arrays carry the mesh, and so does y."""
    cfg, (params, *_), _ = CONFIGS["qwen3_next"], *_case(CONFIGS["qwen3_next"])
    mesh = jax.make_mesh((8,), ("expert",))
    steps = 3

    def decode(params, x0, typed_axes):
        cache = jnp.zeros((steps, B, cfg.hidden_size), x0.dtype)

        def step(t, carry):
            x, cache = carry
            y = moe_forward_ep(params, x, cfg, mesh=mesh, mode=mode)
            assert _typed_axes(y) == _typed_axes(cache) == typed_axes, jax.typeof(y).sharding
            return jnp.tanh(y), jax.lax.dynamic_update_slice(cache, y[None], (t, 0, 0))

        return jax.lax.fori_loop(0, steps, step, (x0 * 1.0, cache))[1]

    x = jnp.asarray(np.random.default_rng(7).standard_normal((B, cfg.hidden_size), np.float32))
    sharded = sharding.shard_params(params, cfg, mesh)
    no_context = jax.jit(functools.partial(decode, typed_axes=()))(sharded, x)
    with jax.set_mesh(mesh):
        in_context = jax.jit(functools.partial(decode, typed_axes=("expert",)))(sharded, x)
    expected = []
    for _ in range(steps):
        expected.append(moejax.moe_forward(params, x, cfg))
        x = jnp.tanh(expected[-1])
    np.testing.assert_allclose(no_context, jnp.stack(expected), **TOL)
    np.testing.assert_allclose(in_context, jnp.stack(expected), **TOL)


def test_traced_tells_whether_a_program_asks_for_its_devices():
    """An EP call on an Explicit mesh with a meshless x runs on the mesh's Auto view only when nothing in it asks for
    the program's devices while lowering (JAX then requires one mesh, axis types included): a choice by device
    kind does, a choice by platform does not."""
    from pallas_kernels.platform import choose_at_lowering

    def program(by_platform):
        branches = (lambda x: x + 1, lambda x: x)
        return lambda x: choose_at_lowering(lambda platform, kinds: 0, branches, x, by_platform=by_platform)

    run, needs_devices = sharding.traced(program(False), jnp.ones(3))
    assert needs_devices and run().tolist() == [2.0, 2.0, 2.0]
    run, needs_devices = sharding.traced(program(True), jnp.ones(3))
    assert not needs_devices and jax.jit(lambda: run())().tolist() == [2.0, 2.0, 2.0]


# -- validation ------------------------------------------------------------------------------------------


def test_validation_errors():
    cfg = CONFIGS["qwen3_next"]  # E=16
    (params, xd, *_), _ = _case(cfg)
    mesh3 = _mesh(3)
    with pytest.raises(ValueError, match=r"E=16.*size 3"):
        sharding.shard_params(params, cfg, mesh3)
    with pytest.raises(ValueError, match=r"E=16.*size 3"):
        parallel.moe_forward_ep(params, xd, cfg, mesh=mesh3)
    with pytest.raises(ValueError, match="mode='ring'"):
        parallel.moe_forward_ep(params, xd, cfg, mesh=_mesh(2), mode="ring")
    with pytest.raises(ValueError, match="expert_axis='experts'"):
        parallel.moe_forward_ep(params, xd, cfg, mesh=_mesh(2), expert_axis="experts")
    odd = cfg.replace(intermediate_size=10)
    with pytest.raises(ValueError, match=r"intermediate_size=10.*size 4"):
        sharding.shard_params(numpy_params(odd, 0), odd, _tensor_mesh(), tensor_axis="tensor")
    with pytest.raises(ValueError, match="ep_mode"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=_mesh(2), ep_mode="ring")
    data_mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match="tensor_axis='data' needs expert_axis"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=data_mesh, tensor_axis="data")


# -- the flax module under a mesh --------------------------------------------------------------------------


def test_module_parameters_created_sharded_and_call_dispatches_to_ep():
    cfg = TENSOR_CONFIGS["qwen3_next"]
    mesh = _tensor_mesh()
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh, tensor_axis="tensor", ep_mode="all_to_all")
    expected = flatten(sharding.partition_specs(cfg, tensor_axis="tensor"))
    with nnx.logical_axis_rules(sharding.logical_axis_rules("expert", "tensor")):
        metadata = nnx.to_flat_state(nnx.get_partition_spec(nnx.state(layer)))
    metadata_specs = {".".join(map(str, path)): v.get_value() for path, v in metadata}
    for name, value in flatten(layer.params).items():
        assert value.sharding.spec == expected[name], name
        if not sharding.runs_replicated(name):  # the placement follows the Params' sharding metadata
            assert metadata_specs[name] == expected[name], name
    assert layer.experts.gate[...].addressable_shards[0].data.shape == (8, cfg.hidden_size, 4)

    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size))  # leading dims; T=10, 12 rows after padding
    forward = nnx.jit(lambda m, x: m(x))
    ref = jax.jit(moejax.moe_forward, static_argnums=2)(jax.device_get(layer.params), x, cfg)
    np.testing.assert_allclose(forward(layer, x), ref, **TOL)

    params = numpy_params(cfg, 3)  # loading placed arrays keeps the layout (and the same program)
    layer.load_params(params)
    assert layer.experts.down[...].sharding.spec == P("expert", "tensor", None)
    ref = jax.jit(moejax.moe_forward, static_argnums=2)(params, x, cfg)
    np.testing.assert_allclose(forward(layer, x), ref, **TOL)


def test_communication_bytes_from_the_shapes():
    cfg = CONFIGS["qwen3_next"]  # H=32, K=4
    replicated = parallel.communication_bytes(cfg, 8, mode="replicated", expert_size=8)
    assert replicated == {"dispatch": 0, "combine": 0, "reduce": 2 * 7 * 8 * 32 * 4 // 8, "total": 1792}
    a2a = parallel.communication_bytes(cfg, 8, mode="all_to_all", expert_size=8, dtype=jnp.bfloat16)
    # 1 token per device; 7 rows out: a bf16 row + 4 ids + 4 weights, then a float32 row back
    assert a2a == {"dispatch": 7 * (32 * 2 + 32), "combine": 7 * 32 * 4, "reduce": 0, "total": 672 + 896}


# -- all_to_all that scales with the expert axis -----------------------------------------------------------


def _temp_bytes(cfg: moejax.MoEConfig, num_tokens: int, n: int) -> int:
    """Per-device temporary bytes of the compiled all_to_all forward on an n-device expert axis (compiled only)."""
    mesh = _mesh(n)
    params = jax.eval_shape(lambda key: with_experts_layout(moejax.init_params(cfg, key), "stacked"), jax.random.key(0))
    params = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, s)),
        params,
        sharding.partition_specs(cfg),
    )
    x = jax.ShapeDtypeStruct((num_tokens, cfg.hidden_size), jnp.float32, sharding=NamedSharding(mesh, P("expert")))
    fn = jax.jit(functools.partial(moe_forward_ep, cfg=cfg, mesh=mesh, mode="all_to_all"))
    return fn.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_all_to_all_memory_per_device_falls_with_the_expert_axis():
    """Each device computes its own experts' pairs (about T·K/n), not all T·K: at n=8 the compiled temporaries are
    a fraction of one device's (benchmarks/ep_memory.py measures the issue's shape: 0.23x)."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=32, intermediate_size=16, num_experts=64, top_k=8)
    one, eight = (_temp_bytes(cfg, 512, n) for n in (1, 8))
    assert eight < 0.4 * one, f"temp bytes per device: {one} on 1 device, {eight} on 8"


def test_all_to_all_beyond_capacity_takes_more_rounds_and_drops_nothing():
    """Every token on the experts of device 0 and buffers for a tenth of uniform routing: device 0 receives 8x its
    row capacity and computes its pairs in many chunks; with a placement of replicas of the hot experts too."""
    cfg = CONFIGS["deepseek_v3"]  # E=32, groups of 4 experts: device d of 4 owns groups 2d and 2d+1
    n, T = 4, 13  # 4 tokens per device (the last device 1 and 3 padding rows)
    (params, _, _, _, _), _ = _case(cfg)
    bias = params.router.correction_bias.at[:8].add(10.0)  # selection only: every token picks experts 0..7
    params = dataclasses.replace(params, router=dataclasses.replace(params.router, correction_bias=bias))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((T, cfg.hidden_size), np.float32))
    ref = jax.jit(moejax.moe_forward, static_argnums=2)(params, x, cfg)
    rows, pairs = dispatch.all_to_all_capacity(cfg, T, n, 0.1)
    assert (rows, pairs) == (1, 3)  # 4 tokens, 16 pairs per device: 4 rounds, device 0 in 24 chunks
    mesh = _mesh(n)
    load = np.r_[np.full(8, 10.0), np.ones(cfg.num_experts - 8)]
    placement = balance(load, num_devices=n, num_slots=cfg.num_experts + 2 * n)
    ep = functools.partial(moe_forward_ep, cfg=cfg, mesh=mesh, mode="all_to_all", capacity_factor=0.1)

    def run(sharded, placed, x):
        return ep(sharded, x, return_stats=True), ep(placed, x, placement=placement)

    sharded = sharding.shard_params(params, cfg, mesh)
    placed = sharding.shard_params(params, cfg, mesh, placement=placement)
    out, y_placed = jax.jit(run)(sharded, placed, x)
    y, stats = out.y, out.stats
    np.testing.assert_allclose(y, ref, **TOL)
    np.testing.assert_allclose(y_placed, ref, **TOL)
    np.testing.assert_array_equal(stats.device_load, [T * cfg.top_k, 0, 0, 0])


def test_communication_bytes_follow_the_capacity():
    """At the issue's shape (K=8 of E=64 on 8 devices a token visits about 5.4 devices) a device sends fewer rows
    than the T/n-row blocks a dropless-per-block layout needs, and never more at any size of the expert axis."""
    cfg = moejax.MoEConfig.preset("deepseek_v3", hidden_size=256, num_experts=64, top_k=8)
    T, H, K = 4096, 256, 8
    for n in (2, 4, 8):
        rows, _ = dispatch.all_to_all_capacity(cfg, T, n, dispatch.CAPACITY_FACTOR)
        sent = parallel.communication_bytes(cfg, T, mode="all_to_all", expert_size=n)
        full_blocks = (n - 1) * (T // n)
        assert rows <= T // n
        assert sent["dispatch"] == (n - 1) * rows * (H * 4 + 2 * K * 4) <= full_blocks * (H * 4 + 2 * K * 4)
    assert dispatch.all_to_all_capacity(cfg, T, 8, dispatch.CAPACITY_FACTOR) == (475, 5360)


def test_capacity_factor_validated():
    cfg = CONFIGS["qwen3_next"]
    (params, xd, *_), _ = _case(cfg)
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="capacity_factor"):
            moe_forward_ep(params, xd, cfg, mesh=_mesh(2), mode="all_to_all", capacity_factor=bad)


# -- Pallas kernels on a CPU mesh --------------------------------------------------------------------------

_PALLAS_ON_TWO_CPU_DEVICES = """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    import moejax
    from moejax import dispatch, parallel, sharding
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=32, intermediate_size=16)
    mesh = jax.make_mesh((2,), ("expert",))
    params = sharding.shard_params(moejax.init_params(cfg, jax.random.key(0)), cfg, mesh)
    for mode in dispatch.EP_MODES:
        try:
            parallel.moe_forward_ep(params, jnp.ones((4, 32)), cfg, mesh=mesh, impl="pallas", mode=mode)
        except NotImplementedError as err:
            print("raised:", err)
        else:
            print("ran")
"""


def test_pallas_on_a_multi_device_cpu_mesh_raises_instead_of_hanging():
    """The Mosaic GPU interpreter serves one device at a time: two CPU devices running the kernels deadlocked.
    Run in a subprocess with a time limit, so a regression fails instead of hanging the suite."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_PALLAS_ON_TWO_CPU_DEVICES)],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("moe_forward_ep(impl='pallas') on 2 CPU devices hangs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = [line for line in proc.stdout.splitlines() if line.startswith("raised:")]
    assert len(raised) == len(dispatch.EP_MODES), proc.stdout
    for line in raised:
        assert "impl='pallas'" in line and "Mosaic GPU interpreter" in line and "impl='xla'" in line, line
