"""Routing statistics on device (`moejax.MoEStats`) against the same counts taken on the host from `moejax.route`.

The host oracle below recomputes every field in numpy from the routed ids alone (and, for the per-device fields,
from the placement's replica table and the EP modes' documented token layout), never from `moejax.analysis`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multihost_worker import numpy_params
from xla_pipeline import DEFAULT_PIPELINE

import moejax
from moejax import parallel, sharding
from moejax.placement import Placement, balance

ULPS = {"rtol": 2e-6, "atol": 1e-6}
SMALL = {"hidden_size": 32, "intermediate_size": 16}
FAMILIES = {
    "mixtral": moejax.MoEConfig.preset("mixtral", **SMALL),
    "deepseek_v3": moejax.MoEConfig.preset("deepseek_v3", **SMALL),  # group-limited, E=32
    "longcat_flash": moejax.MoEConfig.preset("longcat_flash", **SMALL),  # E=12 + 4 zero-computation experts
    "gpt_oss": moejax.MoEConfig.preset("gpt_oss", **SMALL),  # top-k before scoring
    "deepseek_v4": moejax.MoEConfig.preset("deepseek_v4", **SMALL, hash_routing=True, vocab_size=64),
}
# EP: E=16 routed experts (divisible by 4 devices) + 8 zero-computation experts.
EP_CFG = moejax.MoEConfig.preset("longcat_flash", **SMALL, num_experts=16, num_zero_experts=8)
FIELDS = [f.name for f in dataclasses.fields(moejax.MoEStats)]


def host_stats(indices, cfg, *, n=1, mode="replicated", placement=None) -> dict[str, np.ndarray]:
    """Every `MoEStats` field from the routed ids `[T, K]`, in numpy.

    Pair (t, k) with routed expert e runs on the device holding replica `t mod count[e]` of e (contiguous
    layout: device e // (E/n)); token t lives on every device ("replicated") or on device t // ceil(T/n).
    """
    ids = np.asarray(indices)
    T, K = ids.shape
    E = cfg.num_experts
    routed = ids < E
    placement = placement or Placement.contiguous(E, n)
    count, table = placement.replica_counts, placement.replica_slots
    owner = np.full(ids.shape, -1)
    for t, k in zip(*np.nonzero(routed), strict=True):
        e = ids[t, k]
        owner[t, k] = table[e, t % count[e]] // placement.slots_per_device
    device_load = np.array([(owner == d).sum() for d in range(n)])
    load = np.array([(ids == e).sum() for e in range(E)])
    stats = {
        "expert_load": load,
        "union_size": np.count_nonzero(load),
        "zero_pairs": (~routed).sum(),
        "tokens": T,
        "calls": 1,
        "device_load": device_load,
    }
    if mode == "replicated":
        return stats | {"local_pairs": device_load, "remote_pairs": np.zeros(n), "remote_rows": np.zeros(n)}
    home = np.arange(T) // -(-T // n)  # [T] the device holding each token
    local = routed & (owner == home[:, None])
    remote = routed & ~local
    remote_rows = np.zeros(n, int)
    for t in range(T):
        remote_rows[home[t]] += len({int(owner[t, k]) for k in range(K) if remote[t, k]})
    return stats | {
        "local_pairs": np.bincount(home, weights=local.sum(1), minlength=n),
        "remote_pairs": np.bincount(home, weights=remote.sum(1), minlength=n),
        "remote_rows": remote_rows,
    }


def assert_stats_equal(stats: moejax.MoEStats, expected: dict) -> None:
    for name in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(stats, name)), expected[name], err_msg=name)


def total(expected: list[dict]) -> dict:
    return {name: sum(np.asarray(e[name]) for e in expected) for name in FIELDS}


@functools.cache
def _inputs(cfg: moejax.MoEConfig, steps: int = 1, T: int = 11, seed: int = 0):
    """params (numpy draws), x `[steps, T, H]`, token ids `[steps, T]` (hash routing) or None."""
    rng = np.random.default_rng(seed + 1)
    xs = jnp.asarray(rng.standard_normal((steps, T, cfg.hidden_size), np.float32))
    tids = jnp.asarray(rng.integers(0, cfg.vocab_size, (steps, T), dtype=np.int32)) if cfg.hash_routing else None
    return numpy_params(cfg, seed), xs, tids


def _routed(params, x, cfg, tids=None):
    return np.asarray(moejax.route(params, x, cfg, tids).indices)


# -- moe_forward --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forward_stats_equal_host_stats_and_leave_the_output_alone(family):
    cfg = FAMILIES[family]
    params, xs, tids = _inputs(cfg)
    x, t = xs[0], None if tids is None else tids[0]

    @jax.jit
    def run(params, x, t):
        return moejax.moe_forward(params, x, cfg, t), moejax.moe_forward(params, x, cfg, t, return_stats=True)

    params, x, t = jax.device_put((params, x, t))
    run(params, x, t)  # compile; the call below must not touch the host
    with jax.transfer_guard("disallow"):
        y_plain, out = run(params, x, t)
    y, stats = out.y, out.stats
    np.testing.assert_array_equal(y, y_plain)
    expected = host_stats(_routed(params, x, cfg, t), cfg)
    assert_stats_equal(stats, expected)
    assert stats.pairs() == x.shape[0] * cfg.top_k
    if cfg.num_zero_experts:  # the test is only meaningful if the router does pick identity experts
        assert 0 < expected["zero_pairs"] < x.shape[0] * cfg.top_k
        np.testing.assert_allclose(stats.zero_share(), expected["zero_pairs"] / (x.shape[0] * cfg.top_k))
    else:
        assert stats.zero_share() == 0


def test_stats_accumulate_over_steps_in_scan_and_fori_loop():
    cfg, steps = FAMILIES["longcat_flash"], 3
    params, xs, _ = _inputs(cfg, steps=steps, T=5)

    @jax.jit
    def run(params, xs):
        def step(acc, x):
            stats = moejax.moe_forward(params, x, cfg, return_stats=True).stats
            return acc + stats, stats

        start = moejax.MoEStats.zeros(cfg.num_experts)
        summed, per_step = jax.lax.scan(step, start, xs)
        looped = jax.lax.fori_loop(0, steps, lambda i, acc: step(acc, xs[i])[0], start)
        return summed, per_step, looped

    summed, per_step, looped = run(params, xs)
    expected = [host_stats(_routed(params, x, cfg), cfg) for x in xs]
    for i, e in enumerate(expected):
        assert_stats_equal(jax.tree.map(lambda a, i=i: a[i], per_step), e)
    assert_stats_equal(summed, total(expected))
    assert_stats_equal(looped, total(expected))
    assert int(summed.calls) == steps
    np.testing.assert_allclose(summed.mean_union(), np.mean([e["union_size"] for e in expected]))
    np.testing.assert_allclose(summed.zero_share(), sum(e["zero_pairs"] for e in expected) / (steps * 5 * cfg.top_k))
    load = total(expected)["expert_load"]
    np.testing.assert_allclose(summed.expert_imbalance(), load.max() / load.mean(), rtol=1e-6)


# -- expert parallelism -------------------------------------------------------------------------------------


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("expert",))


def test_ep_stats_equal_host_stats_in_both_modes_with_and_without_placement():
    cfg, n = EP_CFG, 4
    params, xs, _ = _inputs(cfg, steps=2, T=9)
    xd, xf = xs[0, :8], xs[1]  # 8 tokens on every device; 9 tokens split 3/3/3/0 (padded to 12)
    load = np.bincount(_routed(params, xf, cfg).reshape(-1), minlength=cfg.num_selectable)[: cfg.num_experts]
    placement = balance(load + 1.0, num_devices=n, num_slots=20)  # 4 redundant slots for the 2 hot experts
    assert placement.replica_counts.max() >= 2
    mesh = _mesh(n)

    @jax.jit
    def run(sharded, placed, xd, xf):
        ep = functools.partial(parallel.moe_forward_ep, cfg=cfg, mesh=mesh, return_stats=True)
        return {
            "replicated": ep(sharded, xd, mode="replicated"),
            "all_to_all": ep(sharded, xf, mode="all_to_all"),
            "replicated placed": ep(placed, xd, mode="replicated", placement=placement),
            "all_to_all placed": ep(placed, xf, mode="all_to_all", placement=placement),
            "single": moejax.moe_forward(sharded, xd, cfg, return_stats=True).stats,
        }

    out = run(
        sharding.shard_params(params, cfg, mesh),
        sharding.shard_params(params, cfg, mesh, placement=placement),
        *jax.device_put((xd, xf), NamedSharding(mesh, P())),
    )
    single = out.pop("single")
    for key, result in out.items():
        stats = result.stats
        mode = key.split()[0]
        x = xd if mode == "replicated" else xf
        expected = host_stats(_routed(params, x, cfg), cfg, n=n, mode=mode, placement=placement if " " in key else None)
        assert_stats_equal(stats, expected)
        assert expected["zero_pairs"] > 0
        if mode == "all_to_all":
            assert expected["remote_pairs"].sum() > 0 and expected["local_pairs"].sum() > 0
    # the per-expert fields do not depend on how the call is split
    replicated = out["replicated"].stats
    for name in ("expert_load", "union_size", "zero_pairs", "tokens", "calls"):
        np.testing.assert_array_equal(getattr(single, name), getattr(replicated, name), err_msg=name)
    assert single.device_load.shape == (1,) and replicated.device_load.shape == (n,)
    # balancing shows in the device imbalance of the statistics (the placement was fitted to xf's load)
    assert out["all_to_all placed"].stats.device_imbalance() < out["all_to_all"].stats.device_imbalance()


# -- the flax module ----------------------------------------------------------------------------------------


def _jit_module(layer, fn, compiler_options=None):
    """`fn(layer, *args)` jitted over the state of `layer` (a module or a tuple of modules), updating the modules'
    variables."""
    graphdef = nnx.graphdef(layer)

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def run(state, *args):
        module = nnx.merge(graphdef, state)
        out = fn(module, *args)
        return out, nnx.state(module)

    def call(*args):
        out, new_state = run(nnx.state(layer), *args)
        nnx.update(layer, new_state)
        return out

    return call


def test_module_collects_stats_over_steps_of_a_jitted_loop():
    cfg, steps = FAMILIES["longcat_flash"], 3
    params, xs, _ = _inputs(cfg, steps=steps, T=6)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), collect_stats=True, layout="stacked")
    layer.load_params(params)
    assert_stats_equal(layer.stats.get_value(), dict.fromkeys(FIELDS, 0))

    def loop(module, xs):
        def body(i, carry):
            module, ys = carry
            return module, ys.at[i].set(module(xs[i]))

        _, ys = nnx.fori_loop(0, xs.shape[0], body, (module, jnp.zeros_like(xs)))
        collected = module.stats.get_value()
        return ys, collected, module(xs[0], return_stats=True)  # one more call, with its own statistics

    # a call's bits equal the loop's: XLA's default pipeline, what users get (the suite's cheap one emits the loop
    # body's dots and reductions otherwise than the call's: ulps apart)
    ys, collected, last = _jit_module(layer, loop, DEFAULT_PIPELINE)(xs)
    y, stats = last.y, last.stats
    expected = [host_stats(_routed(params, x, cfg), cfg) for x in xs]
    assert_stats_equal(collected, total(expected))
    np.testing.assert_array_equal(y, ys[0])
    assert_stats_equal(stats, expected[0])
    assert_stats_equal(layer.stats.get_value(), total([*expected, expected[0]]))
    assert not hasattr(moejax.MoE(cfg, rngs=nnx.Rngs(0), layout="stacked"), "stats")


def test_module_with_placement_equals_unplaced():
    """The unplaced layer runs the "replicated" mode, the placed one "all_to_all" (each mode's placed path is
    checked against the unplaced one in test_placement.py); here: the layer's init, load and call with a placement."""
    cfg, n = EP_CFG, 4
    params, xs, _ = _inputs(cfg, steps=1, T=9)
    x = xs[0]
    load = np.bincount(_routed(params, x, cfg).reshape(-1), minlength=cfg.num_selectable)[: cfg.num_experts]
    placement = balance(load + 1.0, num_devices=n, num_slots=20)
    mesh = _mesh(n)
    unplaced = moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh, ep_mode="replicated")
    placed = moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh, ep_mode="all_to_all", placement=placement, collect_stats=True)
    # the same random weights, laid out by slot: replicas hold copies of their expert
    gate = placed.experts.gate[...]
    assert gate.shape == (20, *unplaced.experts.gate[...].shape[1:]) and gate.sharding.spec == P("expert", None, None)
    np.testing.assert_array_equal(gate, np.asarray(unplaced.experts.gate[...])[list(placement.slot_expert)])
    for layer in (unplaced, placed):
        layer.load_params(params)  # logical order in, slot order kept for the placed layer
    np.testing.assert_array_equal(
        placed.experts.down[...], np.asarray(params.experts.down)[list(placement.slot_expert)]
    )

    y_unplaced, y_placed = _jit_module((unplaced, placed), lambda layers, x: [layer(x) for layer in layers])(x)
    np.testing.assert_allclose(y_placed, y_unplaced, **ULPS)
    expected = host_stats(_routed(params, x, cfg), cfg, n=n, mode="all_to_all", placement=placement)
    assert_stats_equal(placed.stats.get_value(), expected)


def test_module_placement_with_experts_not_divisible_by_devices_and_validation():
    cfg, n = FAMILIES["longcat_flash"], 8  # E=12 routed experts over 8 devices: 16 slots
    placement = balance(np.arange(cfg.num_experts) + 1.0, num_devices=n, num_slots=16)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=_mesh(n), placement=placement)
    gate = layer.experts.gate[...]
    assert gate.shape == (16, cfg.hidden_size, cfg.intermediate_size) and gate.sharding.spec == P("expert", None, None)
    logical = moejax.init_params(cfg, nnx.Rngs(0).params(), layout="stacked").experts.gate  # the same draw, eager
    np.testing.assert_allclose(gate, np.asarray(logical)[list(placement.slot_expert)], **ULPS)

    cfg = EP_CFG
    placement = Placement.contiguous(cfg.num_experts, 4)
    with pytest.raises(ValueError, match="placement needs a mesh with the expert axis"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), placement=placement)
    with pytest.raises(ValueError, match=r"placement.num_devices=4 != the size 2"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=_mesh(2), placement=placement)


def test_adding_statistics_of_other_shapes_raises():
    """8 devices + 1 device broadcast the 1-device counts over the 8 (every pair counted 8 times)."""
    ep, one = moejax.MoEStats.zeros(16, 8), moejax.MoEStats.zeros(16, 1)
    ones = dataclasses.replace(one, device_load=jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"MoEStats.device_load: cannot add shapes \(8,\) and \(1,\).*n=8 vs E=16 n=1"):
        ep + ones
    with pytest.raises(ValueError, match=r"MoEStats.device_load: cannot add shapes \(1,\) and \(8,\)"):
        jax.jit(lambda a, b: a + b)(ones, ep)  # shapes are known while tracing
    with pytest.raises(ValueError, match=r"MoEStats.expert_load: cannot add shapes \(16,\) and \(12,\)"):
        one + moejax.MoEStats.zeros(12, 1)
    total = ones + ones
    np.testing.assert_array_equal(total.device_load, [2])
