"""Expert placement: the EPLB balancing routine, and expert parallelism with replicas against the unplaced forward.

The EP programs compile once per mesh size (module-level cache), with both modes placed and unplaced in one
program; the 8-device compiles dominate the run time on a small CPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multihost_worker import numpy_params

import moejax
from moejax import analysis, parallel, sharding
from moejax.placement import Placement, balance, balanced_packing, replicate

TOL = {"rtol": 2e-5, "atol": 2e-5}
# Placed vs unplaced: the same float ops per (token, slot) pair; only the order in which a token's per-device
# partial sums are added changes, a few ulps.
ULPS = {"rtol": 2e-6, "atol": 1e-6}
SMALL = {"hidden_size": 32, "intermediate_size": 16}
T_DECODE, T_PREFILL = 8, 7
# Group-limited routing, shared expert, E=32; experts 0..3 made hot through the (selection-only) correction bias.
CFG = moejax.MoEConfig.preset("deepseek_v3", **SMALL)
# Zero-computation experts; E=12 does not divide by 8 devices, which a placement of 16 slots allows.
ZERO_CFG = moejax.MoEConfig.preset("longcat_flash", **SMALL)


# -- Placement ----------------------------------------------------------------------------------------------


def test_placement_validation_names_the_field():
    with pytest.raises(ValueError, match=r"Placement.slot_expert.*experts \[2\] have no slot"):
        Placement((0, 1, 1, 0), num_experts=3, num_devices=2)
    with pytest.raises(ValueError, match=r"Placement.slot_expert.*ids \[5\] outside"):
        Placement((0, 1, 5, 2), num_experts=3, num_devices=2)
    with pytest.raises(ValueError, match=r"Placement.slot_expert: 5 slots.*num_devices=2"):
        Placement((0, 1, 2, 0, 1), num_experts=3, num_devices=2)
    with pytest.raises(ValueError, match=r"Placement.num_devices"):
        Placement((0, 1), num_experts=2, num_devices=0)
    with pytest.raises(ValueError, match=r"Placement.num_experts"):
        Placement((0, 1), num_experts=True, num_devices=1)


def test_placement_tables_and_replica_split():
    placement = Placement((2, 0, 1, 0, 3, 0), num_experts=4, num_devices=3)
    assert (placement.num_slots, placement.slots_per_device) == (6, 2)
    np.testing.assert_array_equal(placement.replica_counts, [3, 1, 1, 1])
    np.testing.assert_array_equal(placement.replica_slots, [[1, 3, 5], [2, 2, 2], [0, 0, 0], [4, 4, 4]])
    np.testing.assert_array_equal(placement.device_of_slot, [0, 0, 1, 1, 2, 2])
    indices = jnp.array([[0, 3], [0, 1], [2, 0], [0, 9]])  # 9: a zero-computation expert
    slots = placement.physical_ids(indices, jnp.arange(4))
    # expert 0's replicas (slots 1, 3, 5) taken by row index mod 3; the zero expert maps to S = 6
    np.testing.assert_array_equal(slots, [[1, 4], [3, 2], [0, 5], [1, 6]])
    np.testing.assert_array_equal(analysis.slot_load(indices, placement), [1, 2, 1, 1, 1, 1])
    np.testing.assert_array_equal(analysis.device_load(indices, placement), [3, 2, 2])
    np.testing.assert_allclose(placement.expected_device_load([6, 1, 1, 1]), [3, 3, 3])
    assert hash(placement) == hash(Placement((2, 0, 1, 0, 3, 0), 4, 3))  # usable as a static argument


# -- EPLB ---------------------------------------------------------------------------------------------------


def test_replicate_gives_each_extra_replica_to_the_highest_load_per_replica():
    np.testing.assert_array_equal(replicate([10, 1, 1, 1], 6), [3, 1, 1, 1])  # 10 -> 5 -> 3.3 > 1
    np.testing.assert_array_equal(replicate([4, 3, 0, 1], 6), [2, 2, 1, 1])  # 4 -> 2, then 3 > 2
    np.testing.assert_array_equal(replicate([1, 1], 2), [1, 1])
    rng = np.random.default_rng(0)
    for _ in range(5):
        load = rng.pareto(1.0, 24)
        counts = replicate(load, 32)
        assert counts.sum() == 32 and counts.min() >= 1
        # Greedy optimality: taking a replica from any expert would push it above the current maximum.
        worst = np.max(load / counts)
        assert all(load[e] / (counts[e] - 1) >= worst for e in np.flatnonzero(counts > 1))
    with pytest.raises(ValueError, match="num_slots=3 must be >= the number of experts 4"):
        replicate([1, 1, 1, 1], 3)


def test_balanced_packing_heaviest_first_onto_the_lightest_pack_with_room():
    # 9 -> pack 0 (tie: lowest), 8 -> pack 1 (8 < 9), 7 -> pack 1 (8 < 9, now full), 3 -> pack 0
    np.testing.assert_array_equal(balanced_packing([9, 8, 7, 3], 2), [0, 1, 1, 0])
    pack = balanced_packing(np.arange(12.0), 3)
    assert np.all(np.bincount(pack) == 4)
    with pytest.raises(ValueError, match="num_packs=3 must be >= 1 and divide"):
        balanced_packing([1, 2, 3, 4], 3)


@pytest.mark.parametrize("num_nodes", [1, 2])
def test_balance_every_expert_placed_and_capacities_respected(num_nodes):
    rng = np.random.default_rng(num_nodes)
    E, n, groups = 64, 8, 8
    for num_slots in (64, 72, 96):
        load = rng.zipf(1.5, E).astype(float)
        placement = balance(load, num_devices=n, num_slots=num_slots, num_groups=groups, num_nodes=num_nodes)
        counts = placement.replica_counts
        assert placement.num_slots == num_slots and counts.min() >= 1 and counts.sum() == num_slots
        np.testing.assert_array_equal(np.bincount(placement.device_of_slot), [num_slots // n] * n)  # capacities
        expected = placement.expected_device_load(load)
        assert expected.max() <= Placement.contiguous(E, n).expected_device_load(load).max() + 1e-9


def test_hierarchical_packs_whole_groups_onto_nodes():
    E, n, groups, nodes = 64, 8, 8, 2
    load = np.random.default_rng(0).zipf(1.3, E).astype(float)
    placement = balance(load, num_devices=n, num_slots=72, num_groups=groups, num_nodes=nodes)
    node_of_slot = placement.device_of_slot // (n // nodes)
    group_of_slot = np.asarray(placement.slot_expert) // (E // groups)
    for g in range(groups):  # all replicas of a group's experts on one node
        assert len(set(node_of_slot[group_of_slot == g])) == 1
    nodes_of_groups = {g: node_of_slot[group_of_slot == g][0] for g in range(groups)}
    assert sorted(np.bincount(list(nodes_of_groups.values()))) == [groups // nodes] * nodes
    # Groups that do not divide over the nodes: EPLB's fallback to the global policy.
    fallback = balance(load, num_devices=n, num_slots=72, num_groups=1, num_nodes=nodes)
    assert fallback == balance(load, num_devices=n, num_slots=72)
    with pytest.raises(ValueError, match="num_nodes=3 must divide num_devices=8"):
        balance(np.ones(48), num_devices=8, num_slots=48, num_groups=6, num_nodes=3)
    with pytest.raises(ValueError, match="num_slots=70 must be divisible by num_devices=8"):
        balance(load, num_devices=8, num_slots=70)


@pytest.mark.parametrize("skew", [0.8, 1.2, 1.6])
def test_balancing_reduces_device_imbalance_on_skewed_traces(skew):
    """1/8 extra replicas on 8 devices (E=64 -> 72 slots), placed from one trace, measured on another trace of
    the same model (held out) with the replica split of the forward."""
    E, K, n = 64, 8, 8
    model = analysis.TraceModel(E, K, skew=skew, correlation=0.1)
    fit, held_out = model.sample(2048, seed=0), model.sample(2048, seed=1)
    load = np.asarray(analysis.expert_load(fit, E))
    before = float(analysis.load_imbalance(held_out, E, Placement.contiguous(E, n)))
    for nodes in (1, 2):
        placement = balance(load, num_devices=n, num_slots=72, num_groups=8, num_nodes=nodes)
        after = float(analysis.load_imbalance(held_out, E, placement))
        assert after < before
        assert after <= 1.15, (skew, nodes, before, after)
    assert before > 1.3


# -- expert parallelism with a placement ----------------------------------------------------------------------


def _skewed_params(cfg, hot: int = 4, boost: float = 0.3):
    params = numpy_params(cfg, 0)
    bias = params.router.correction_bias.at[:hot].add(boost)  # selection only: experts 0..hot-1 chosen more
    return dataclasses.replace(params, router=dataclasses.replace(params.router, correction_bias=bias))


@functools.cache
def _inputs(cfg):
    rng = np.random.default_rng(1)
    params = _skewed_params(cfg)
    xd = jnp.asarray(rng.standard_normal((T_DECODE, cfg.hidden_size), np.float32))
    xf = jnp.asarray(rng.standard_normal((T_PREFILL, cfg.hidden_size), np.float32))
    return params, xd, xf


def _placement_for(cfg, params, x, n: int, extra_per_device: int = 1) -> Placement:
    load = np.asarray(analysis.expert_load(moejax.route(params, x, cfg).indices, cfg))
    num_slots = -(-cfg.num_experts // n) * n + extra_per_device * n
    return balance(load + 1.0, num_devices=n, num_slots=num_slots)


def _mesh(n: int, axis_type=AxisType.Auto) -> Mesh:
    return jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n], axis_types=(axis_type,))


@functools.cache
def _program(cfg, mesh: Mesh, placement: Placement, with_unplaced: bool = True):
    """One jitted program: both modes placed (and unplaced) on the decode and the prefill input."""
    traces = []

    def run(params, placed, xd, xf):
        traces.append(1)
        ep = functools.partial(parallel.moe_forward_ep, cfg=cfg, mesh=mesh, return_stats=True)
        out = {
            "replicated_placed": ep(placed, xd, mode="replicated", placement=placement),
            "all_to_all_placed": ep(placed, xf, mode="all_to_all", placement=placement),
        }
        if with_unplaced:
            out["replicated"] = ep(params, xd, mode="replicated")
            out["all_to_all"] = ep(params, xf, mode="all_to_all")
        return out

    return jax.jit(run), traces


def _check_placed_stats(stats, indices, placement, cfg):
    expected_load = np.asarray(analysis.expert_load(indices, cfg))
    np.testing.assert_array_equal(stats.expert_load, expected_load)  # logical load, as without placement
    np.testing.assert_array_equal(stats.device_load, analysis.device_load(indices, placement))
    assert int(np.sum(stats.local_pairs) + np.sum(stats.remote_pairs)) == expected_load.sum()  # nothing dropped


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_placed_forward_equals_unplaced_in_both_modes(n):
    params, xd, xf = _inputs(CFG)
    placement = _placement_for(CFG, params, xd, n)
    assert placement.replica_counts.max() >= 2
    mesh = _mesh(n)
    fn, _ = _program(CFG, mesh, placement)
    sharded = sharding.shard_params(params, CFG, mesh)
    placed = sharding.shard_params(params, CFG, mesh, placement=placement)
    out = fn(sharded, placed, xd, xf)
    for mode, x in (("replicated", xd), ("all_to_all", xf)):
        (y, stats), (y_placed, stats_placed) = ((out[k].y, out[k].stats) for k in (mode, f"{mode}_placed"))
        if n == 1:  # one device: the same sums in the same order, bit for bit
            np.testing.assert_array_equal(y_placed, y)
        else:  # the same float ops per pair; a token's per-device partial sums are grouped differently
            np.testing.assert_allclose(y_placed, y, **ULPS)
        indices = moejax.route(params, x, CFG).indices
        _check_placed_stats(stats_placed, indices, placement, CFG)
        np.testing.assert_array_equal(stats_placed.expert_load, stats.expert_load)
        np.testing.assert_array_equal(stats.device_load, analysis.device_load(indices, Placement.contiguous(32, n)))
    # the replicas of a hot expert share its tokens
    slot_load = np.asarray(analysis.slot_load(moejax.route(params, xd, CFG).indices, placement))
    hot = int(np.argmax(placement.replica_counts))
    assert np.sum(slot_load[placement.replica_slots[hot, : placement.replica_counts[hot]]] > 0) >= 2


def test_placed_forward_with_zero_experts_and_experts_not_divisible_by_devices():
    """E=12 routed experts (+4 zero experts) on 8 devices: 16 slots, against the single-device forward; the
    mesh has Explicit axes (jax.make_mesh's default)."""
    cfg, n = ZERO_CFG, 8
    params, xd, xf = _inputs(cfg)
    placement = _placement_for(cfg, params, xd, n, extra_per_device=0)
    assert placement.num_slots == 16
    mesh = _mesh(n, AxisType.Explicit)
    fn, _ = _program(cfg, mesh, placement, with_unplaced=False)
    placed = sharding.shard_params(params, cfg, mesh, placement=placement)
    with pytest.raises(ValueError, match="E=12 is not divisible by the size 8"):
        sharding.shard_params(params, cfg, mesh)
    out = fn(None, placed, xd, xf)
    ref = jax.jit(moejax.moe_forward, static_argnums=2)
    for mode, x in (("replicated", xd), ("all_to_all", xf)):
        y, stats = out[f"{mode}_placed"].y, out[f"{mode}_placed"].stats
        np.testing.assert_allclose(y, ref(params, x, cfg), **TOL)
        _check_placed_stats(stats, moejax.route(params, x, cfg).indices, placement, cfg)


def test_shard_params_lays_the_experts_out_by_slot():
    n = 4
    params, xd, _ = _inputs(CFG)
    placement = _placement_for(CFG, params, xd, n)
    placed = sharding.shard_params(params, CFG, _mesh(n), placement=placement)
    gate = placed.experts.gate
    assert gate.shape == (placement.num_slots, *params.experts.gate.shape[1:])
    assert gate.sharding.spec == P("expert", None, None)
    for shard in gate.addressable_shards:
        first = shard.index[0].start
        d = first // placement.slots_per_device
        experts = placement.slot_expert[first : first + placement.slots_per_device]
        assert placement.device_of_slot[first] == d
        np.testing.assert_array_equal(shard.data, np.asarray(params.experts.gate)[list(experts)])


def test_placed_forward_has_no_host_transfers_and_does_not_recompile_across_routings():
    n = 8
    params, xd, xf = _inputs(CFG)
    placement = _placement_for(CFG, params, xd, n)
    mesh = _mesh(n)
    fn, traces = _program(CFG, mesh, placement)  # the program of test_placed_forward_equals_unplaced[8]
    sharded = sharding.shard_params(params, CFG, mesh)
    placed = sharding.shard_params(params, CFG, mesh, placement=placement)
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P()))
    fn(sharded, placed, put(xd), put(xf))
    compiled = len(traces)
    rng = np.random.default_rng(7)
    loads = []
    for _ in range(2):
        x2, x3 = put(rng.standard_normal(xd.shape, np.float32)), put(rng.standard_normal(xf.shape, np.float32))
        with jax.transfer_guard("disallow"):
            out = jax.block_until_ready(fn(sharded, placed, x2, x3))
        loads.append(np.asarray(out["replicated_placed"].stats.device_load))
        np.testing.assert_allclose(out["replicated_placed"].y, out["replicated"].y, **ULPS)
    assert len(traces) == compiled
    assert not np.array_equal(*loads)


def test_placement_validation_in_parallel():
    params, xd, _ = _inputs(CFG)
    mesh = _mesh(2)
    placement = _placement_for(CFG, params, xd, 2)
    with pytest.raises(ValueError, match=r"placement.num_devices=2 != the size 4"):
        sharding.shard_params(params, CFG, _mesh(4), placement=placement)
    other = Placement.contiguous(16, 2)
    with pytest.raises(ValueError, match=r"placement.num_experts=16 != num_experts E=32"):
        parallel.moe_forward_ep(params, xd, CFG, mesh=mesh, placement=other)
    with pytest.raises(ValueError, match=r"params.experts has 32 experts, but placement has num_slots=34"):
        parallel.moe_forward_ep(params, xd, CFG, mesh=mesh, placement=placement)
    placed = sharding.shard_params(params, CFG, mesh, placement=placement)
    with pytest.raises(ValueError, match=r"params.experts has 34 experts; shard_params\(..., placement=\) takes"):
        sharding.shard_params(placed, CFG, mesh, placement=placement)
    with pytest.raises(TypeError, match=r"placement must be a moejax.placement.Placement"):
        parallel.moe_forward_ep(placed, xd, CFG, mesh=mesh, placement=(0, 1))
    with pytest.raises(ValueError, match="expert_axis=None"):
        sharding.shard_params(params, CFG, mesh, expert_axis=None, placement=placement)


def test_params_carry_their_placement_and_another_one_raises():
    """Params laid out by placement A and run with B of the same slot count would meet other experts' weights
    silently: `shard_params` records A in `params.placement` (static pytree metadata: it survives jit, tree
    flattening and the nnx layer) and every entry point checks it at trace time, naming both."""
    from flax import nnx

    params, xd, _ = _inputs(CFG)
    mesh = _mesh(2)
    a = balance(np.arange(32) + 1.0, num_devices=2, num_slots=34)
    b = Placement(a.slot_expert[17:] + a.slot_expert[:17], a.num_experts, a.num_devices)  # same slots, other order
    placed = sharding.shard_params(params, CFG, mesh, placement=a)
    assert placed.placement == a and params.placement is None
    leaves, treedef = jax.tree.flatten(placed)
    assert jax.tree.unflatten(treedef, leaves).placement == a
    both = r"laid out by Placement\(E=32, n=2, S=34, slot_expert sha1 \w+\) but run with placement=Placement\(E=32"
    ep = functools.partial(parallel.moe_forward_ep, x=xd, cfg=CFG, mesh=mesh)
    with pytest.raises(ValueError, match=both + r".*slot 0 holds expert \d+, not \d+"):
        ep(placed, placement=b)
    with pytest.raises(ValueError, match=both):  # traced: the placement is part of the params' pytree structure
        jax.jit(lambda p: ep(p, placement=b))(placed)
    with pytest.raises(ValueError, match=r"laid out by Placement\(E=32.*run with placement=no placement"):
        ep(placed)
    with pytest.raises(ValueError, match=r"params hold their experts in the slot order of Placement\(E=32"):
        moejax.moe_forward(placed, xd, CFG)
    with pytest.raises(ValueError, match=r"params are already laid out by Placement\(E=32"):
        sharding.shard_params(placed, CFG, mesh)

    # S = E: a permutation of the experts has the shapes of the logical order (the silent case of the issue)
    perm = Placement(tuple(range(16, 32)) + tuple(range(16)), num_experts=32, num_devices=2)
    permuted = sharding.shard_params(params, CFG, mesh, placement=perm)
    with pytest.raises(ValueError, match=r"S=32, slot_expert sha1 \w+\) but run with placement=no placement"):
        ep(permuted)
    with pytest.raises(ValueError, match=r"placement=Placement\(E=32, n=2, S=32.*slot 0 holds expert 16, not 0"):
        ep(permuted, placement=Placement.contiguous(32, 2))
    with pytest.raises(ValueError, match=r"already laid out by Placement\(E=32, n=2, S=32"):
        sharding.shard_params(permuted, CFG, mesh, placement=Placement.contiguous(32, 2))

    def layer_run():  # traced only (eval_shape): the layer's init and call compile nothing
        layer = moejax.MoE(CFG, rngs=nnx.Rngs(0), mesh=mesh, placement=a)
        assert layer.params.placement == a
        return parallel.moe_forward_ep(layer.params, xd, CFG, mesh=mesh, placement=b)

    with pytest.raises(ValueError, match=both):
        jax.eval_shape(layer_run)
