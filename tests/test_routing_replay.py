"""Routing replay: `moe_forward(..., routing=)` skips the router and reproduces the forward bit for bit in every
dispatch mode; gradients reach x and the experts, never the router."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tables import FULL

import moejax
from moejax import dispatch as D
from moejax.lora import LoRAPair, _target_shapes, from_pairs, stack
from moejax.sharding import shard_params

T = 8
STATIC = ("cfg", "impl", "dispatch", "return_stats", "return_routing")
forward = jax.jit(moejax.moe_forward, static_argnames=STATIC)
# LongCat has zero-computation experts (zero_weight), Llama-4 scales the expert input by the routing weight.
FAMILIES = {
    "qwen3_next": {},
    "longcat_flash": {"num_experts": 16},
    "llama4": {},
}


def _setup(family):
    cfg = moejax.MoEConfig.preset(family, **FAMILIES[family])
    params = moejax.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size))
    return cfg, params, x


def _mode(name):
    """(dispatch, x placement) of one mode on the 8 CPU devices."""
    if name == "local":
        return D.Local(), None
    if name == "rows":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        return D.Rows(mesh), NamedSharding(mesh, P("data"))
    mesh = jax.make_mesh((8,), ("expert",))
    return D.expert_parallel("replicated" if name == "ep_psum" else "all_to_all", mesh), None


CASES = [
    ("local", "qwen3_next"),
    ("local", "longcat_flash"),
    ("local", "llama4"),
    ("rows", "longcat_flash"),
    ("ep_psum", "longcat_flash"),
    ("ep_psum", "llama4"),
    ("ep_all_to_all", "longcat_flash"),
    ("ep_all_to_all", "llama4"),
]


@pytest.mark.parametrize(("mode", "family"), CASES)
def test_replayed_routing_gives_the_forward_bit_for_bit(family, mode):
    cfg, params, x = _setup(family)
    dispatch, placed = _mode(mode)
    if placed is not None:
        x = jax.device_put(x, placed)
    if isinstance(dispatch, D.ExpertParallel):
        params = shard_params(params, cfg, dispatch.mesh)
    out = forward(params, x, cfg, impl="xla", dispatch=dispatch, return_stats=True, return_routing=True)
    y, stats, routing = out.y, out.stats, out.routing
    if mode == "local":
        expected = moejax.route(params, x, cfg)
        np.testing.assert_array_equal(routing.indices, expected.indices)
        np.testing.assert_array_equal(routing.weights, expected.weights)
        # Another routing gives another output: the given one is used.
        shifted = moejax.Routing(
            (routing.indices + 1) % cfg.num_experts, routing.weights, routing.logits, routing.zero_weight
        )
        other = forward(params, x, cfg, impl="xla", routing=shifted)
        assert not np.array_equal(other, y)
    assert (routing.zero_weight is None) == (cfg.num_zero_experts == 0)
    replayed = forward(params, x, cfg, impl="xla", dispatch=dispatch, routing=routing, return_stats=True)
    np.testing.assert_array_equal(replayed.y, y)
    np.testing.assert_array_equal(replayed.stats.expert_load, stats.expert_load)


def test_gradients_reach_x_and_experts_but_not_the_router():
    """A zero router kernel makes the routing weights constant in x (a uniform softmax, ties broken by index), so
    the full forward's x-gradient is the one with the routing weights held constant: the replay's must equal it.
    The router kernel still gets a gradient in the full forward (through the softmax), none in the replay."""
    cfg, params, x = _setup("qwen3_next")
    params = dataclasses.replace(
        params, router=dataclasses.replace(params.router, kernel=jnp.zeros_like(params.router.kernel))
    )
    routing = moejax.route(params, x, cfg)
    c = jax.random.normal(jax.random.key(2), x.shape)
    loss = lambda p, x, r=None: jnp.sum(moejax.moe_forward(p, x, cfg, impl="xla", routing=r) * c)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    g_replay, gx_replay = grad(params, x, routing)
    g_full, gx_full = grad(params, x)
    assert all(np.all(np.asarray(leaf) == 0) for leaf in jax.tree.leaves(g_replay.router))
    assert np.any(np.asarray(g_full.router.kernel) != 0)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, g_replay.experts, g_full.experts)  # same routing: the experts see the same pairs
    close(gx_replay, gx_full)
    assert np.any(np.asarray(gx_replay) != 0)


def test_a_routing_of_the_wrong_shape_or_dtype_names_the_field():
    cfg, params, x = _setup("longcat_flash")
    routing = moejax.route(params, x, cfg)
    bad = moejax.Routing(routing.indices[:3], routing.weights, routing.logits, routing.zero_weight)
    with pytest.raises(ValueError, match=r"routing.indices must have shape \(8, 4\).*got \(3, 4\)"):
        forward(params, x, cfg, routing=bad)
    bad = moejax.Routing(routing.indices, routing.weights, routing.logits, None)
    with pytest.raises(ValueError, match=r"routing.zero_weight must be an array of shape \(8,\)"):
        forward(params, x, cfg, routing=bad)
    bad = moejax.Routing(routing.indices.astype(jnp.float32), routing.weights, routing.logits, routing.zero_weight)
    with pytest.raises(ValueError, match=r"routing.indices must be integer"):
        forward(params, x, cfg, routing=bad)


def test_empty_batch_returns_an_empty_routing():
    cfg, params, _ = _setup("longcat_flash")
    out = forward(params, jnp.zeros((0, cfg.hidden_size)), cfg, return_routing=True)
    assert out.y.shape == (0, cfg.hidden_size) and out.routing.indices.shape == (0, cfg.top_k)
    assert out.routing.zero_weight.shape == (0,) and out.stats is None


def test_replay_with_lora_skips_the_router_adapters():
    cfg = moejax.MoEConfig.preset("qwen2_moe", num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    params = moejax.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, cfg.hidden_size))
    rng = np.random.default_rng(0)
    pairs = {
        name: LoRAPair(
            jnp.asarray(rng.standard_normal((*lead, 2, n_in), np.float32) / np.sqrt(n_in)),
            jnp.asarray(rng.standard_normal((*lead, n_out, 2), np.float32)),
            jnp.float32(0.5),
        )
        for name, (lead, n_in, n_out) in _target_shapes(cfg).items()
    }
    lora = stack([from_pairs(pairs)])
    ids = jnp.array([1, 0, 1, 1], jnp.int32)
    out = forward(params, x, cfg, impl="xla", lora=lora, adapter_ids=ids, return_routing=True)
    y, routing = out.y, out.routing

    replayed = forward(params, x, cfg, impl="xla", lora=lora, adapter_ids=ids, routing=routing)
    np.testing.assert_array_equal(replayed, y)
    loss = lambda lora: jnp.sum(
        moejax.moe_forward(params, x, cfg, impl="xla", lora=lora, adapter_ids=ids, routing=routing) ** 2
    )
    grads = jax.jit(jax.grad(loss))(lora)
    assert np.all(np.asarray(grads.router.a) == 0) and np.all(np.asarray(grads.router.b) == 0)
    assert np.any(np.asarray(grads.experts.gate.a) != 0)


# In the suite: gpt-oss (softmax after top-k, biases); with MOEJAX_TESTS_FULL=1 also Llama-4 (weights on the
# input), DeepSeek-V3 (group-limited top-k) and LongCat (zero experts).
@pytest.mark.parametrize("family", ["gpt_oss", *(["llama4", "deepseek_v3", "longcat_flash"] * FULL)])
def test_replaying_the_selection_keeps_the_router_learning(family):
    """`routing=Routing(indices, None, None)` replays the experts and recomputes their weights from the router:
    with the router's own selection, the output, the returned routing and every gradient (router included)
    equal the unreplayed forward's (top-k is locally constant, so its gradient is the fixed selection's)."""
    cfg = moejax.MoEConfig.preset(family, **FAMILIES.get(family, {}), hidden_size=32, intermediate_size=16)
    params = moejax.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size))
    own = moejax.route(params, x, cfg)
    selection = moejax.Routing(own.indices, None, None)
    c = jax.random.normal(jax.random.key(2), x.shape)
    loss = lambda p, x, r=None: jnp.sum(moejax.moe_forward(p, x, cfg, impl="xla", routing=r) * c)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for got, want in zip(jax.tree.leaves(grad(params, x, selection)), jax.tree.leaves(grad(params, x)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.any(np.asarray(grad(params, x, selection)[0].router.kernel) != 0)
    out = forward(params, x, cfg, impl="xla", routing=selection, return_routing=True)
    np.testing.assert_array_equal(out.y, forward(params, x, cfg, impl="xla"))
    np.testing.assert_array_equal(out.routing.weights, own.weights)
    other = moejax.Routing(jnp.roll(own.indices, 1, axis=0), None, None)  # another selection: its own weights
    assert not np.allclose(forward(params, x, cfg, impl="xla", routing=other), out.y)
