"""moe_forward as a jit-compiled function: jit equals eager, no host transfers, batch invariance, bad input,
the documented in-jit behaviour of bad values and the checked variant that raises."""

import dataclasses
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify
from xla_pipeline import DEFAULT_PIPELINE

import moejax

forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


def _setup(family="qwen3_next", T=5, seed=0, dtype=jnp.float32, **overrides):
    cfg = moejax.MoEConfig.preset(family, **overrides)
    kp, kx, kt = jax.random.split(jax.random.key(seed), 3)
    params = moejax.init_params(cfg, kp, dtype)
    x = jax.random.normal(kx, (T, cfg.hidden_size)).astype(dtype)
    tid = jax.random.randint(kt, (T,), 0, cfg.vocab_size) if cfg.hash_routing else None
    return cfg, params, x, tid


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v4", "longcat_flash", "llama4"])
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_jit_equals_eager(family, impl):
    cfg, params, x, tid = _setup(family)
    np.testing.assert_allclose(
        forward(params, x, cfg, tid, impl), moejax.moe_forward(params, x, cfg, tid, impl), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("T", [4, 40])
def test_jitted_forward_makes_no_host_transfers(T):
    cfg, params, x, tid = _setup("deepseek_v4", T=T)
    forward(params, x, cfg, tid).block_until_ready()  # compile outside the guard
    with jax.transfer_guard("disallow"):
        forward(params, x, cfg, tid).block_until_ready()


def test_leading_dims_and_dtype_preserved():
    cfg, params, _, _ = _setup()
    x = jax.random.normal(jax.random.key(3), (2, 3, cfg.hidden_size)).astype(jnp.bfloat16)
    y = forward(params, x, cfg, None, "auto")
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    flat = forward(params, x.reshape(6, -1), cfg, None, "auto")
    np.testing.assert_array_equal(y.reshape(6, -1), flat)


@pytest.mark.parametrize("impl", ["xla_decode", "xla_grouped"])
def test_batch_invariance(impl):
    """A row's output is byte-identical whatever the other rows of its batch are."""
    T = 8 if impl == "xla_decode" else 40
    cfg, params, x, _ = _setup("qwen3_moe", T=T, num_experts=32, top_k=8)
    other = jax.random.normal(jax.random.key(9), x.shape)
    mixed = other.at[3].set(x[3])
    same_row_everywhere = jnp.broadcast_to(x[3], x.shape)
    exact = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"), compiler_options=DEFAULT_PIPELINE)
    base = exact(params, x, cfg, None, impl)[3]
    for batch in (mixed, same_row_everywhere):
        np.testing.assert_array_equal(exact(params, batch, cfg, None, impl)[3], base)


def test_no_recompile_across_routings():
    cfg, params, x, _ = _setup("qwen3_moe", T=4)
    f = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg))
    for seed in range(4):
        f(params, jax.random.normal(jax.random.key(seed), x.shape))
    assert f._cache_size() == 1


# -- bad input -------------------------------------------------------------------------------------------
def test_wrong_hidden_size_names_both_shapes():
    cfg, params, x, _ = _setup()
    with pytest.raises(ValueError, match=r"H=64.*\(5, 63\)"):
        forward(params, x[:, :63], cfg, None, "auto")


def test_wrong_dtype_and_rank():
    cfg, params, x, _ = _setup()
    with pytest.raises(TypeError, match="int32"):
        forward(params, x.astype(jnp.int32), cfg, None, "auto")
    with pytest.raises(ValueError, match=r"\(\)"):
        moejax.moe_forward(params, jnp.float32(1.0), cfg)


def test_params_for_another_config():
    cfg, params, x, _ = _setup()
    other = cfg.replace(num_experts=8)
    with pytest.raises(ValueError, match=r"router.kernel: expected shape \(64, 8\), got \(64, 16\)"):
        moejax.moe_forward(params, x, other)


def test_hash_routing_without_token_ids():
    cfg, params, x, _ = _setup("deepseek_v4", hash_routing=True, vocab_size=100)
    with pytest.raises(ValueError, match="token_ids"):
        forward(params, x, cfg, None, "auto")
    with pytest.raises(ValueError, match=r"token_ids must have shape"):
        forward(params, x, cfg, jnp.zeros((4,), jnp.int32), "auto")


def test_unknown_impl():
    cfg, params, x, _ = _setup()
    with pytest.raises(ValueError, match="impl='fast'"):
        moejax.moe_forward(params, x, cfg, impl="fast")


# -- bad values inside jit -------------------------------------------------------------------------------
def test_out_of_range_token_ids_are_clamped_inside_jit():
    cfg, params, x, _ = _setup("deepseek_v4", T=3, hash_routing=True, vocab_size=50)
    bad = jnp.array([-7, 10, 500], jnp.int32)
    clamped = jnp.array([0, 10, 49], jnp.int32)
    np.testing.assert_array_equal(forward(params, x, cfg, bad, "xla"), forward(params, x, cfg, clamped, "xla"))
    with pytest.raises(checkify.JaxRuntimeError, match="token_ids outside"):
        moejax.checked_moe_forward(params, x, cfg, bad)
    np.testing.assert_allclose(
        moejax.checked_moe_forward(params, x, cfg, clamped), forward(params, x, cfg, clamped, "auto")
    )


@pytest.mark.parametrize("impl", ["xla_decode", "xla_grouped", "reference"])
def test_non_finite_logits_give_nan_row_and_valid_indices(impl):
    cfg, params, x, _ = _setup("deepseek_v3", T=4)
    x = x.at[1, 0].set(jnp.inf)
    routing = moejax.route(params, x, cfg)
    assert bool(jnp.all((routing.indices >= 0) & (routing.indices < cfg.num_selectable)))
    y = forward(params, x, cfg, None, impl)
    assert bool(jnp.all(jnp.isnan(y[1])))
    clean = forward(params, x.at[1].set(0.5), cfg, None, impl)
    np.testing.assert_array_equal(np.asarray(y)[[0, 2, 3]], np.asarray(clean)[[0, 2, 3]])
    with pytest.raises(checkify.JaxRuntimeError, match="non-finite router logits"):
        moejax.checked_moe_forward(params, x, cfg)


# -- the nnx module --------------------------------------------------------------------------------------
def test_nnx_module_matches_functional_and_jits():
    cfg = moejax.MoEConfig.preset("deepseek_v4", hash_routing=True, vocab_size=100)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, cfg.hidden_size))
    tid = jnp.array([1, 2, 99])
    eager = layer(x, tid)
    np.testing.assert_allclose(eager, moejax.moe_forward(layer.params, x, cfg, tid), rtol=1e-6)
    np.testing.assert_allclose(nnx.jit(lambda m, x, t: m(x, t))(layer, x, tid), eager, rtol=1e-6, atol=1e-6)
    params = nnx.state(layer, nnx.Param)
    assert "tid2eid" not in str(jax.tree_util.tree_structure(params))  # buffers are not trainable
    assert layer.layout == "per_expert"  # the CPU default: each expert's weights their own buffers
    assert layer.experts[3].gate_up_weight.get_metadata()["out_sharding"] == ("mlp", "embed")  # [out, in] on CPU
    stacked = moejax.MoE(cfg, rngs=nnx.Rngs(0), layout="stacked")
    assert stacked.experts.gate.get_metadata()["out_sharding"] == ("expert", "embed", "mlp")
    # Same weights in either layout; the per-expert [out, in] products sum in another order.
    np.testing.assert_allclose(stacked(x, tid), eager, rtol=1e-5, atol=1e-6)


def _entry_points(cfg, params):
    """Every public entry point that takes `return_stats`/`return_routing`, as `call(x, **extras)`."""
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    sharded = moejax.sharding.shard_params(params, cfg, mesh)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), layout="stacked")
    layer.load_params(params)
    ep = moejax.parallel.moe_forward_ep
    return {
        "moe_forward": lambda x, **kw: moejax.moe_forward(params, x, cfg, impl="xla", **kw),
        "moe_forward under jit": lambda x, **kw: jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="xla", **kw))(
            params, x
        ),
        "moe_forward_ep": lambda x, **kw: jax.jit(lambda p, x: ep(p, x, cfg, mesh=mesh, impl="xla", **kw))(sharded, x),
        "MoE": lambda x, **kw: layer(x, **kw),
    }


@pytest.mark.parametrize("return_routing", [False, True])
@pytest.mark.parametrize("return_stats", [False, True])
def test_every_entry_point_returns_y_or_one_moe_output(return_stats, return_routing):
    """One rule everywhere: `y` without extras, else a `moejax.MoEOutput` with the extras asked for (the others
    None), the same y in both shapes; a returned routing replays to the same output."""
    cfg, params, x, _ = _setup("qwen3_moe", T=6, hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
    plain = moejax.moe_forward(params, x, cfg, impl="xla")
    for name, call in _entry_points(cfg, params).items():
        out = call(x, return_stats=return_stats, return_routing=return_routing)
        if not (return_stats or return_routing):
            assert isinstance(out, jax.Array), name
            np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-6, err_msg=name)
            continue
        assert isinstance(out, moejax.MoEOutput), (name, type(out))
        np.testing.assert_allclose(out.y, plain, rtol=1e-5, atol=1e-6, err_msg=name)
        assert (out.stats is not None) == return_stats and (out.routing is not None) == return_routing, name
        if return_stats:
            assert isinstance(out.stats, moejax.MoEStats) and int(out.stats.pairs()) == 6 * cfg.top_k, name
        if return_routing:
            assert out.routing.indices.shape == (6, cfg.top_k), name
            np.testing.assert_array_equal(call(x, routing=out.routing), out.y, err_msg=name)


def test_moe_output_is_a_pytree_and_the_entry_points_share_their_keywords():
    out = moejax.MoEOutput(jnp.ones(2), None, None)
    assert jax.tree.map(lambda a: a * 2, out).y.tolist() == [2.0, 2.0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.y = jnp.zeros(2)
    shared = {"token_ids", "impl", "lora", "adapter_ids", "return_stats", "routing", "return_routing"}
    for fn in (moejax.moe_forward, moejax.parallel.moe_forward_ep):
        assert shared <= set(inspect.signature(fn).parameters), fn.__name__
    assert {"token_ids", "adapter_ids", "return_stats", "routing", "return_routing"} <= set(
        inspect.signature(moejax.MoE.__call__).parameters
    )


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("T", [1, 64])  # the decode and grouped plans
def test_chosen_impl_names_what_auto_runs_for_each_platform(layout, T):
    """On CPU: the native kernels when built, else the CPU plans (per-expert layout) or the XLA plans (stacked);
    `ragged_dot` only where lowered for TPU/GPU (a grouped call on stacked experts). The CPU answer runs the same
    program as "auto", bit for bit."""
    from moejax.backends import native

    cfg, _, x, _ = _setup("qwen3_moe", T=T, hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
    params = moejax.init_params(cfg, jax.random.key(0), layout=layout)
    kind = "decode" if T == 1 else "grouped"
    plans = f"cpu_{kind}" if layout == "per_expert" else f"xla_{kind}"
    assert moejax.chosen_impl(params, x, cfg, platform="cpu") == ("native" if native.available() else plans)
    accelerator = "ragged" if (layout, kind) == ("stacked", "grouped") else plans
    assert moejax.chosen_impl(params, x, cfg, platform="tpu") == accelerator
    assert moejax.chosen_impl(params, x, cfg, impl="xla", platform="tpu") == f"xla_{kind}"
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
    assert moejax.chosen_impl(*abstract, cfg, platform="cpu") == moejax.chosen_impl(params, x, cfg, platform="cpu")
    chosen = moejax.chosen_impl(params, x, cfg, platform="cpu")
    np.testing.assert_array_equal(forward(params, x, cfg, None, chosen), forward(params, x, cfg, None, "auto"))


def test_nnx_load_params_roundtrip():
    cfg = moejax.MoEConfig.preset("gemma4")
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    params = moejax.init_params(cfg, jax.random.key(5))
    layer.load_params(params)
    chex.assert_trees_all_equal(layer.params, params)
