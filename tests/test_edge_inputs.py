"""Edge inputs of the forward: empty batches, checks inside the caller's
jit, token ids >= 2**31, and clear errors for bad arguments (route, config, layer, CLI). Data-parallel meshes and
batch invariance: tests/test_data_parallel.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from benchmark_scripts import load
from flax import nnx
from jax.experimental import checkify
from multihost_worker import numpy_params

import moejax
from moejax import analysis, dispatch, parallel, sharding
from moejax.__main__ import main
from moejax.forward import moe_forward_with_checks

SMALL = {"hidden_size": 32, "intermediate_size": 16}


def _params(cfg, seed=0):
    """float32 params drawn with numpy: no random-number programs to compile for each config (CPU time)."""
    return numpy_params(cfg, seed)


# -- 2. empty batches ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 32), (0, 3, 32)])
def test_empty_batch(shape):
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL)
    params = _params(cfg)
    x = jnp.zeros(shape, jnp.float32)
    for impl in moejax.IMPLS:
        assert moejax.moe_forward(params, x, cfg, impl=impl).shape == shape, impl
    assert jax.jit(lambda p, v: moejax.moe_forward(p, v, cfg))(params, x).shape == shape
    assert moejax.checked_moe_forward(params, x, cfg).shape == shape
    mesh = jax.make_mesh((8,), ("expert",))
    sharded = sharding.shard_params(params, cfg, mesh)
    for mode in dispatch.EP_MODES:
        out = parallel.moe_forward_ep(sharded, x, cfg, mesh=mesh, mode=mode, return_stats=True)
        assert out.y.shape == shape and int(out.stats.expert_load.sum()) == 0, mode


# -- 4. checks inside the caller's jit -----------------------------------------------------------------------
def test_checks_compose_with_the_callers_checkify():
    cfg = moejax.MoEConfig.preset("deepseek_v4", **SMALL, hash_routing=True, vocab_size=50)
    params = _params(cfg)
    x = jax.random.normal(jax.random.key(1), (4, cfg.hidden_size))
    tid = jnp.array([1, 2, 3, 4], jnp.int32)

    def step(p, v, t):
        return 2.0 * moe_forward_with_checks(p, v, cfg, t)

    checked = checkify.checkify(jax.jit(step))
    err, y = checked(params, x, tid)
    err.throw()
    np.testing.assert_allclose(y, 2.0 * moejax.moe_forward(params, x, cfg, tid), rtol=1e-6)
    err, _ = checked(params, x.at[0, 0].set(jnp.nan), tid)
    with pytest.raises(checkify.JaxRuntimeError, match="non-finite router logits"):
        err.throw()
    err, _ = checked(params, x, tid.at[2].set(50))
    with pytest.raises(checkify.JaxRuntimeError, match="token_ids outside"):
        err.throw()
    with pytest.raises(TypeError, match="moe_forward_with_checks"):
        jax.jit(lambda p, v, t: moejax.checked_moe_forward(p, v, cfg, t))(params, x, tid)


# -- 7. token ids >= 2**31 -----------------------------------------------------------------------------------
def test_large_token_ids_clamp_to_the_last_row():
    cfg = moejax.MoEConfig.preset("deepseek_v4", **SMALL, hash_routing=True, vocab_size=50)
    params = _params(cfg)
    x = jax.random.normal(jax.random.key(1), (3, cfg.hidden_size))
    last = moejax.route(params, x, cfg, jnp.full((3,), 49, jnp.int32)).indices
    big = np.array([2**31, 2**32 - 1, 2**31 + 7], np.uint32)
    for tid in (jnp.asarray(big), big, big.astype(np.int64)):
        np.testing.assert_array_equal(moejax.route(params, x, cfg, tid).indices, last)
        y = moejax.moe_forward(params, x, cfg, tid)
        np.testing.assert_array_equal(y, moejax.moe_forward(params, x, cfg, jnp.full((3,), 49, jnp.int32)))
    with pytest.raises(checkify.JaxRuntimeError, match="token_ids outside"):
        moejax.checked_moe_forward(params, x, cfg, big.astype(np.int64))


# -- 8. weights_on_input with hash routing -------------------------------------------------------------------
def test_weights_on_input_with_hash_routing_is_rejected():
    with pytest.raises(ValueError, match=r"weights_on_input.*hash_routing"):
        moejax.MoEConfig.preset("deepseek_v4", hash_routing=True, vocab_size=10, weights_on_input=True)


# -- 9. clear errors -----------------------------------------------------------------------------------------
def test_route_checks_its_inputs_and_takes_a_list():
    cfg = moejax.MoEConfig.preset("deepseek_v4", **SMALL, hash_routing=True, vocab_size=50)
    params = _params(cfg)
    x = jax.random.normal(jax.random.key(1), (3, cfg.hidden_size))
    with pytest.raises(ValueError, match=r"H=32.*\(3, 31\)"):
        moejax.route(params, x[:, :31], cfg, jnp.arange(3))
    with pytest.raises(TypeError, match="int32"):
        moejax.route(params, x.astype(jnp.int32), cfg, jnp.arange(3))
    with pytest.raises(ValueError, match="token_ids must have shape"):
        moejax.route(params, x, cfg, jnp.arange(4))
    with pytest.raises(ValueError, match="token_ids"):
        moejax.route(params, x, cfg)
    with pytest.raises(TypeError, match="token_ids must be integers"):
        moejax.route(params, x, cfg, [0.5, 1.0, 2.0])
    tid = jnp.array([3, 7, 11], jnp.int32)
    np.testing.assert_array_equal(
        moejax.route(params, x, cfg, [3, 7, 11]).indices, moejax.route(params, x, cfg, tid).indices
    )
    np.testing.assert_array_equal(
        moejax.moe_forward(params, x, cfg, [3, 7, 11]), moejax.moe_forward(params, x, cfg, tid)
    )


def test_union_curve_with_fewer_tokens_than_the_window():
    indices = jnp.zeros((3, 2), jnp.int32)
    with pytest.raises(ValueError, match="longer than the T=3 tokens"):
        analysis.union_curve(indices, 8, 4)
    with pytest.raises(ValueError, match="longer than the T=3 tokens"):
        analysis.mean_union(indices[None], 8, 5)


def test_config_rejects_nan_and_accepts_numpy_integers():
    for family, field in (("gemma4", "rms_norm_eps"), ("qwen3_moe", "swiglu_alpha")):
        with pytest.raises(ValueError, match=field):
            moejax.MoEConfig.preset(family, **{field: float("nan")})
    with pytest.raises(ValueError, match=r"rms_norm_eps=1e-05: only router_prenorm / expert_prenorm read it"):
        moejax.MoEConfig.preset("qwen3_moe", rms_norm_eps=1e-5)
    with pytest.raises(ValueError, match=r"rms_norm_eps=None: router_prenorm / expert_prenorm need"):
        moejax.MoEConfig.preset("gemma4", rms_norm_eps=None)
    with pytest.raises(ValueError, match="swiglu_limit"):
        moejax.MoEConfig.preset("qwen3_moe", swiglu_limit=float("nan"))
    cfg = moejax.MoEConfig.preset(
        "gemma4", hidden_size=np.int64(32), num_experts=np.int32(8), top_k=np.int64(2), rms_norm_eps=np.float32(1e-5)
    )
    assert cfg == moejax.MoEConfig.preset(
        "gemma4", hidden_size=32, num_experts=8, top_k=2, rms_norm_eps=float(np.float32(1e-5))
    )
    assert type(cfg.hidden_size) is int and hash(cfg) == hash(dataclasses.replace(cfg))


def test_layer_validates_impl_and_ep_mode_at_construction():
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL)
    with pytest.raises(ValueError, match="impl='fast'"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), impl="fast")
    with pytest.raises(ValueError, match="ep_mode='ring'"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), ep_mode="ring")
    mesh = jax.make_mesh((8,), ("expert",))
    with pytest.raises(ValueError, match="impl='fast'"):
        moejax.MoE(cfg, rngs=nnx.Rngs(0), impl="fast", mesh=mesh)


def test_load_params_rejects_another_config():
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    other = _params(cfg.replace(num_experts=8))
    with pytest.raises(ValueError, match="expected shape"):
        layer.load_params(other)
    with pytest.raises(ValueError, match="expected shape"):
        layer.load_params(_params(cfg.replace(hidden_size=16)))


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--decode-rows", "0"],
        ["demo", "--prefill-rows", "-3"],
        ["bench", "--repeats", "0"],
        ["bench", "--decode", "4", "0"],
        ["bench", "--prefill", "-1"],
    ],
)
def test_cli_rejects_non_positive_counts(argv, capsys):
    """`python -m moejax demo` and benchmarks/plans_bench.py."""
    command, *args = argv
    with pytest.raises(SystemExit) as exit_info:
        main(argv) if command == "demo" else load("plans_bench").main(args)
    assert exit_info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err
