"""Routing statistics against host computations, and the synthetic trace generator and its calibration."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multihost_worker import numpy_params

import moejax
from moejax import analysis
from moejax.placement import Placement

# The seed engine's measured union over K = 1..4 consecutive decode tokens, 256 experts, top-8.
SEED_CURVE = (8.00, 13.74, 18.76, 23.35)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _union_curve_stacked(indices, cfg, max_window):
    """The previous implementation of `union_curve` (w shifted copies, one bincount per window): the oracle."""

    def mean_union(w):
        T = indices.shape[0] - w + 1
        windows = jnp.stack([indices[i : i + T] for i in range(w)], axis=1).reshape(T, -1)
        return jnp.mean(jax.vmap(lambda ids: analysis.union_size(ids[None], cfg))(windows).astype(jnp.float32))

    return jnp.stack([mean_union(w) for w in range(1, max_window + 1)])


def _random_indices(rng, T, K, N):
    return np.stack([rng.choice(N, K, replace=False) for _ in range(T)]).astype(np.int32)


def test_union_curve_keeps_its_behaviour_and_takes_any_window():
    cfg = moejax.MoEConfig.preset("longcat_flash")  # E=12 routed + 4 zero experts (ids 12..15, left out)
    rng = np.random.default_rng(0)
    indices = _random_indices(rng, 40, cfg.top_k, cfg.num_selectable)
    np.testing.assert_allclose(analysis.union_curve(indices, cfg), _union_curve_stacked(indices, cfg, 4), rtol=1e-6)
    np.testing.assert_allclose(analysis.union_curve(indices, cfg, 7), _union_curve_stacked(indices, cfg, 7), rtol=1e-6)
    for w in (1, 3, 16):
        host = np.mean([len({int(e) for e in indices[t : t + w].ravel() if e < 12}) for t in range(40 - w + 1)])
        np.testing.assert_allclose(analysis.mean_union(indices, cfg, w), host, rtol=1e-6)
    np.testing.assert_allclose(
        analysis.union_curve(indices, 12, windows=(2, 16)),
        [analysis.mean_union(indices, cfg, 2), analysis.mean_union(indices, cfg, 16)],
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="longer than the T=3 tokens"):
        analysis.mean_union(indices[:3], cfg, 4)
    with pytest.raises(ValueError, match="windows must be non-empty ints >= 1"):
        analysis.union_curve(indices, cfg, windows=(0,))


def test_union_curve_of_independent_sequences_does_not_cross_them():
    rng = np.random.default_rng(1)
    batch = _random_indices(rng, 3 * 20, 4, 32).reshape(3, 20, 4)
    curves = [np.asarray(analysis.union_curve(seq, 32, 5)) for seq in batch]
    np.testing.assert_allclose(analysis.union_curve(batch, 32, 5), np.mean(curves, axis=0), rtol=1e-6)


def test_statistics_on_device_equal_host_computations_from_route():
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=32, intermediate_size=16)
    params = numpy_params(cfg, 0)
    x = np.random.default_rng(1).standard_normal((64, cfg.hidden_size), np.float32)
    indices = np.asarray(moejax.route(params, x, cfg).indices)
    E = cfg.num_experts

    @jax.jit
    def stats(indices):
        return {
            "load": analysis.expert_load(indices, cfg),
            "co": analysis.co_selection(indices, cfg),
            "entropy": analysis.routing_entropy(indices, cfg),
            "imbalance": analysis.load_imbalance(indices, cfg),
            "device_imbalance": analysis.load_imbalance(indices, cfg, Placement.contiguous(E, 4)),
            "curve": analysis.union_curve(indices, cfg, 4),
        }

    with jax.transfer_guard_device_to_host("disallow"):
        out = jax.block_until_ready(stats(jnp.asarray(indices)))
    load = np.bincount(indices.ravel(), minlength=E)
    np.testing.assert_array_equal(out["load"], load)
    co = np.zeros((E, E), int)
    for row in indices:
        for i, j in itertools.product(set(row), repeat=2):
            co[i, j] += 1
    np.testing.assert_array_equal(out["co"], co)
    p = load[load > 0] / load.sum()
    np.testing.assert_allclose(out["entropy"], -np.sum(p * np.log2(p)), rtol=1e-5)
    np.testing.assert_allclose(out["imbalance"], load.max() / load.mean(), rtol=1e-6)
    per_device = load.reshape(4, -1).sum(1)
    np.testing.assert_allclose(out["device_imbalance"], per_device.max() / per_device.mean(), rtol=1e-6)
    assert out["curve"][0] == cfg.top_k


def test_entropy_and_imbalance_by_hand():
    assert float(analysis.routing_entropy(np.array([[0, 1], [2, 3]]), 4)) == pytest.approx(2.0)  # log2(E)
    assert float(analysis.routing_entropy(np.array([[1], [1], [5]]), 4)) == pytest.approx(0.0)  # 5: zero expert
    assert float(analysis.imbalance(np.array([1, 2, 3]))) == pytest.approx(1.5)
    placement = Placement((0, 1, 0, 2), num_experts=3, num_devices=2)  # expert 0 on both devices
    indices = np.array([[0], [0], [0], [1]])  # rows 0, 2 -> slot 0; row 1 -> slot 2; row 3 -> slot 1
    np.testing.assert_array_equal(analysis.device_load(indices, placement), [3, 1])
    assert float(analysis.load_imbalance(indices, 3, placement)) == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"placement.num_experts=3 != E=4"):
        analysis.load_imbalance(indices, 4, placement)


# -- synthetic traces ---------------------------------------------------------------------------------------


def test_trace_model_is_reproducible_distinct_and_tunable():
    model = analysis.TraceModel(num_experts=32, top_k=4, skew=1.2, correlation=0.3, expert_seed=5)
    trace = model.sample(1500, seed=3)
    assert trace.shape == (1500, 4) and trace.dtype == np.int32
    np.testing.assert_array_equal(trace, model.sample(1500, seed=3))
    assert not np.array_equal(trace, model.sample(1500, seed=4))
    assert all(len(set(row)) == 4 for row in trace) and trace.min() >= 0 and trace.max() < 32
    # The hot experts follow the weights (the same for every seed of the model), and the skew shows in the load.
    load = np.bincount(trace.ravel(), minlength=32)
    hottest = np.argsort(-model.weights)[:3]
    assert set(np.argsort(-load)[:3]) & set(hottest)
    uniform = analysis.TraceModel(32, 4, skew=0.0).sample(1500)
    assert analysis.imbalance(load) > 1.5 * analysis.imbalance(np.bincount(uniform.ravel(), minlength=32))

    def overlap(trace):  # experts shared with the previous token
        return np.mean([len(set(a) & set(b)) for a, b in itertools.pairwise(trace)])

    independent = analysis.TraceModel(32, 4, skew=1.2, correlation=0.0, expert_seed=5).sample(1500)
    assert overlap(trace) > overlap(independent) + 0.5  # about 4·0.3 more than chance
    assert all(set(row) == set(range(8)) for row in analysis.TraceModel(8, 8, correlation=0.5).sample(3))  # K = E


def test_trace_model_validation_names_the_field():
    with pytest.raises(ValueError, match=r"TraceModel.top_k=9"):
        analysis.TraceModel(8, 9)
    with pytest.raises(ValueError, match=r"TraceModel.skew"):
        analysis.TraceModel(8, 2, skew=-1.0)
    with pytest.raises(ValueError, match=r"TraceModel.correlation"):
        analysis.TraceModel(8, 2, correlation=1.5)
    with pytest.raises(ValueError, match="num_tokens=0"):
        analysis.TraceModel(8, 2).sample(0)
    with pytest.raises(ValueError, match="target must be"):
        analysis.calibrate([], num_experts=8, top_k=2)


def test_calibrated_trace_reproduces_the_seed_union_curve_within_2_percent():
    model = analysis.calibrate(SEED_CURVE, num_experts=256, top_k=8)
    assert 0.0 < model.skew < 3.0 and 0.0 < model.correlation < 1.0
    for seed in (0, 1):
        curve = np.asarray(analysis.union_curve(model.sample(4096, seed=seed), 256, 4))
        np.testing.assert_allclose(curve, SEED_CURVE, rtol=0.02)
