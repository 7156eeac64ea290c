"""The whole MoE layer on the native CPU path: router logits, routed experts and shared expert (with its gate)
batch-invariant across batch sizes, inside the dispatch modes' `shard_map`, with gradients; the switch off."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from xla_pipeline import DEFAULT_PIPELINE

import moejax
from moejax import backends
from moejax.backends import native, native_ops
from moejax.dispatch import EPAllToAll, EPPsum, Rows
from moejax.routing import xla_scores

built = pytest.mark.skipif(not native.available(), reason="the native extension is not built")

# Families whose router / shared expert differ: softmax (Qwen3), gated shared expert (Qwen2), sigmoid + groups +
# correction bias + ungated shared expert (DeepSeek-V3), router bias + expert biases (gpt-oss), sigmoid after
# top-k + input scale + shared expert (Llama-4).
FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4")
H = 96


@functools.cache
def _layer(family: str, dtype=jnp.float32):
    """A small layer of `family` (cached: initialising is most of a test's time)."""
    cfg = moejax.MoEConfig.preset(family, hidden_size=H, intermediate_size=40)
    params = moejax.init_params(cfg, jax.random.key(0), dtype, layout="per_expert")
    return cfg, params


def _rows(T: int, seed: int, dtype=jnp.float32) -> np.ndarray:
    return np.array(jax.random.normal(jax.random.key(seed), (T, H), jnp.float32).astype(dtype))


@functools.cache
def _compiled_forward(cfg):
    return jax.jit(lambda params, x: moejax.moe_forward(params, x, cfg), compiler_options=DEFAULT_PIPELINE)


def _forward(params, x, cfg):
    return np.asarray(_compiled_forward(cfg)(params, jnp.asarray(x)))


def _assert_row_invariant(params, cfg, sizes, what: str, dtype=jnp.float32):
    """The row's output alone equals its output at several positions inside batches of `sizes` rows, bit for bit."""
    row = _rows(1, 7, dtype)
    alone = _forward(params, row, cfg)[0]
    for T in sizes:
        x = _rows(T, 100 + T, dtype)
        positions = sorted({0, T // 2, T - 1})
        x[positions] = row[0]
        got = _forward(params, x, cfg)
        for pos in positions:
            np.testing.assert_array_equal(got[pos], alone, err_msg=f"{what} T={T} position {pos}")


@built
@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_layer_output_does_not_depend_on_the_batch(family):
    """Bit-identical alone and inside a batch of 300 rows; the layer runs natively (the router, the shared
    expert and its gate too) and agrees with the XLA reference (router and shared expert by XLA's dot)."""
    cfg, params = _layer(family)
    _assert_row_invariant(params, cfg, (300,), family)
    x = jnp.asarray(_rows(300, 400))
    want = moejax.moe_forward(params, x, cfg, impl="reference")
    np.testing.assert_allclose(moejax.moe_forward(params, x, cfg), want, atol=2e-5, rtol=2e-5)
    text = _lowered(lambda p, x: moejax.moe_forward(p, x, cfg), params, x)
    calls = {"routed": text.count("@moejax_routed_experts"), "linear": text.count("@moejax_linear")}
    shared = cfg.shared_intermediate_size > 0 and cfg.shared_expert.value != "none"
    gated = cfg.shared_expert.value == "sigmoid_gated"
    assert calls == {"routed": 1 + shared, "linear": 1 + gated}, calls


@built
def test_every_batch_size_one_thread_or_the_pool_and_2048_rows(monkeypatch):
    """Qwen2-MoE (router, routed experts, shared expert and its gate): T = 1, 2, 7, 64, 300 and 2048 with the
    pool, then the same row alone and in 2048 rows with one thread for every native call."""
    cfg, params = _layer("qwen2_moe")
    _assert_row_invariant(params, cfg, (1, 2, 7, 64, 300, 2048), "pool")
    alone = _forward(params, _rows(1, 7), cfg)[0]
    one = dataclasses.replace(backends.BACKENDS["native"], run=_one_thread(native.routed_experts))
    monkeypatch.setitem(backends.BACKENDS, "native", one)
    monkeypatch.setattr(native_ops, "_MAX_THREADS", 1)
    forward = jax.jit(  # traced anew: one thread
        moejax.moe_forward.uncached, static_argnames=("cfg",), compiler_options=DEFAULT_PIPELINE
    )
    x = _rows(2048, 5)
    x[[0, 1000, 2047]] = _rows(1, 7)[0]
    got = np.asarray(forward(params, jnp.asarray(x), cfg))
    for pos in (0, 1000, 2047):
        np.testing.assert_array_equal(got[pos], alone, err_msg=f"one thread, T=2048 position {pos}")


def _one_thread(run):
    return lambda *args, **kwargs: run(*args, **kwargs, max_threads=1)


@built
def test_bfloat16_layer_is_batch_invariant():
    cfg, params = _layer("qwen2_moe", jnp.bfloat16)  # the router and the shared gate read bf16 weights
    _assert_row_invariant(params, cfg, (64,), "bfloat16", jnp.bfloat16)


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@built
def test_gradients_equal_the_xla_paths():
    """Qwen2-MoE: gradients w.r.t. every parameter (router, experts, shared expert and its gate) and x equal the
    reference's (every backend's backward is the reference's VJP; the router and shared expert by XLA's dot)."""
    cfg, params = _layer("qwen2_moe")
    x = jnp.asarray(_rows(5, 4))
    r = jax.random.normal(jax.random.key(9), x.shape)  # a fixed cotangent: the loss's gradient is r
    loss = lambda p, x, impl: jnp.sum(moejax.moe_forward(p, x, cfg, impl=impl) * r)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    native_grad = grad.lower(params, x, "auto")
    assert "@moejax_linear" in native_grad.as_text()
    got, want = native_grad.compile()(params, x), grad(params, x, "reference")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-4, err_msg=jax.tree_util.keystr(path))


@built
@pytest.mark.parametrize("mode", ["rows", "ep_psum", "ep_all_to_all"])
def test_dispatch_modes_run_the_native_layer_on_each_device(mode):
    cfg, params = _layer("qwen2_moe")
    x = jnp.asarray(_rows(16, 6))
    want = moejax.moe_forward(params, x, cfg)
    devices = np.array(jax.devices()[:8])
    if mode == "rows":
        mesh = jax.sharding.Mesh(devices, ("data",))
        dispatch, placed = Rows(mesh), params
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    else:
        mesh = jax.sharding.Mesh(devices, ("expert",))
        placed = moejax.sharding.shard_params(moejax.params.with_experts_layout(params, "stacked"), cfg, mesh)
        dispatch = (EPPsum if mode == "ep_psum" else EPAllToAll)(mesh)
    forward = lambda p, x: moejax.moe_forward(p, x, cfg, dispatch=dispatch)
    np.testing.assert_allclose(jax.jit(forward)(placed, x), want, atol=2e-6, rtol=2e-6)
    text = _lowered(forward, placed, x)
    assert "@moejax_routed_experts" in text and "@moejax_linear" in text


# -- the linear kernel -------------------------------------------------------------------------------------------


@built
@pytest.mark.parametrize("portable", [False, True])
def test_linear_matches_float64(portable):
    rng = np.random.default_rng(0)
    for T, K, N in ((1, 37, 1), (5, 37, 19), (9, 300, 40), (70, 16, 64)):
        x = rng.standard_normal((T, K)).astype(np.float32)
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            w = jnp.asarray(rng.standard_normal((K, N)), dtype)
            b = rng.standard_normal(N).astype(np.float32)
            got = native_ops.linear(jnp.asarray(x), w, jnp.asarray(b), portable=portable)
            want = x.astype(np.float64) @ np.asarray(w, np.float64) + b
            bound = 4 * K * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(np.asarray(w, np.float64)) + np.abs(b))
            assert np.all(np.abs(np.asarray(got) - want) <= bound + 1e-30), (T, K, N, dtype)


@built
def test_linear_rows_bits_do_not_depend_on_the_batch():
    """One and two rows (several tiles per pass over W) give the bits of the same rows in a batch of 9 (one tile
    per pass), for every weight dtype, in both variants; columns past the last 64 and a partial last tile."""
    rng = np.random.default_rng(1)
    K, N = 70, 100
    x = jnp.asarray(rng.standard_normal((9, K)).astype(np.float32))
    b = jnp.asarray(rng.standard_normal(N).astype(np.float32))
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        w = jnp.asarray(rng.standard_normal((K, N)), dtype)
        for portable in (False, True):
            batch = np.asarray(native_ops.linear(x, w, b, portable=portable))
            for rows in (slice(3, 4), slice(5, 7)):
                got = native_ops.linear(x[rows], w, b, portable=portable)
                np.testing.assert_array_equal(np.asarray(got), batch[rows], f"{dtype.__name__} {portable=} {rows}")


@built
def test_router_reads_a_bfloat16_kernel_as_stored():
    """float32 x with a bfloat16 router kernel (a quantized checkpoint's): the native router reads the kernel as
    stored, with the logits of the kernel widened first bit for bit, and no float32 copy of it in the program."""
    from moejax.routing import router_logits

    cfg, _ = _layer("qwen2_moe")
    H, N = cfg.hidden_size, cfg.num_experts
    kernel = jax.random.normal(jax.random.key(3), (H, N), jnp.bfloat16)
    x = jnp.asarray(_rows(9, 4))

    def logits(kernel, x):
        return router_logits(moejax.params.RouterParams(kernel), x, cfg, matmul=native_ops.matmul)

    got = jax.jit(logits)(kernel, x)
    np.testing.assert_array_equal(got, jax.jit(logits)(kernel.astype(jnp.float32), x))
    hlo = jax.jit(logits).lower(kernel, x).compile().as_text()
    assert f"f32[{H},{N}]" not in hlo, "the kernel was copied to float32"


@built
def test_linear_bad_inputs_raise_in_python():
    x, w = jnp.ones((3, 8)), jnp.ones((8, 4))
    with pytest.raises(ValueError, match="x must be"):
        native_ops.linear(x, w[:7])
    with pytest.raises(ValueError, match="w must be float32"):
        native_ops.linear(x, w.astype(jnp.int8))
    with pytest.raises(ValueError, match="bias must be"):
        native_ops.linear(x, w, jnp.ones(5))


# -- the switch ---------------------------------------------------------------------------------------------------


@built
def test_enable_false_runs_the_xla_path_and_enable_none_restores_the_default():
    cfg, params = _layer("qwen2_moe")
    x = jnp.asarray(_rows(3, 8))
    try:
        native.enable(False)
        assert not native.available() and native_ops.layer_ops("auto") is None
        assert moejax.chosen_impl(params, x, cfg) == "cpu_decode"
        assert "moejax_" not in _lowered(lambda p, x: moejax.moe_forward(p, x, cfg), params, x)
        with pytest.raises(NotImplementedError, match="not built or not enabled"):
            native_ops.linear(x, params.router.kernel)
    finally:
        native.enable(None)
    assert native.available() and moejax.chosen_impl(params, x, cfg) == "native"


@built
def test_enable_keeps_compiled_programs_while_new_traces_follow_it():
    """The switch is part of the key of JAX's caches, which it does not empty: a user's jitted function compiled
    before is not traced again after enable(False) and enable(True), while a jitted forward, called again or
    lowered, follows the setting and gets the native program back."""
    traces = []

    @jax.jit
    def user(x):
        traces.append(x.shape)
        return jnp.sin(x) * 2

    x = jnp.arange(5.0)
    user(x)
    cfg, params = _layer("qwen2_moe")
    rows = jnp.asarray(_rows(3, 8))
    forward = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg))
    on = forward(params, rows)
    try:
        native.enable(False)
        assert "moejax_" not in forward.lower(params, rows).as_text()
        assert moejax.forward.chosen_impl(params, rows, cfg) == "cpu_decode"
        off = forward(params, rows)
    finally:
        native.enable(True)
    user(x)
    assert traces == [x.shape]
    assert "moejax_" in forward.lower(params, rows).as_text()
    assert moejax.forward.chosen_impl(params, rows, cfg) == "native"
    np.testing.assert_allclose(off, on, atol=3e-5, rtol=1e-5)
    np.testing.assert_array_equal(forward(params, rows), on)


@built
@pytest.mark.parametrize("kind", ["softmax", "sigmoid", "softplus"])
def test_scores_match_xla_and_a_rows_bits_do_not_depend_on_the_batch(kind):
    """The native router scores equal XLA's to float32 rounding (-inf, an all -inf row, NaN included), with XLA's
    gradients; a row's scores alone equal its scores at three positions of 9, 300 and 2048 rows bit for bit."""
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((40, 13)) * 5).astype(np.float32)
    z[3, 2], z[4, :], z[5, 1] = -np.inf, -np.inf, np.nan
    fn = jax.jit(functools.partial(native_ops.scores, kind), compiler_options=DEFAULT_PIPELINE)
    want = np.asarray(xla_scores(kind, jnp.asarray(z)))
    np.testing.assert_allclose(np.asarray(fn(z)), want, rtol=3e-6, atol=0, equal_nan=True)
    weights = jnp.arange(13.0)
    grad = jax.grad(lambda z: (native_ops.scores(kind, z) * weights).sum())(jnp.asarray(z[6:9]))
    np.testing.assert_array_equal(grad, jax.grad(lambda z: (xla_scores(kind, z) * weights).sum())(z[6:9]))
    rows = (rng.standard_normal((4, 13)) * 5).astype(np.float32)
    for T in (9, 300, 2048):
        x = (rng.standard_normal((T, 13)) * 5).astype(np.float32)
        positions = (1, T // 2 + 1, T - 2)
        for row in rows:
            x[list(positions)] = row
            at = np.asarray(fn(x))
            alone = np.asarray(fn(row[None]))[0]
            for p in positions:
                np.testing.assert_array_equal(at[p], alone, err_msg=f"{kind} T={T} position {p}")


@built
def test_a_rows_routing_weights_do_not_depend_on_the_batch():
    """Qwen3-MoE (softmax scores, normalised top-k): 6 rows, each alone and inside batches of 2, 9, 40, 300 and
    2048 rows, compiled with XLA's default pipeline: the same routing weights and layer output bit for bit. With
    XLA's softmax (its exp, its reduce) 2 of these 30 differed (jax 0.10.2)."""
    cfg, params = _layer("qwen3_moe")
    forward = jax.jit(
        lambda p, x: moejax.moe_forward(p, x, cfg, return_routing=True), compiler_options=DEFAULT_PIPELINE
    )
    rng = np.random.default_rng(0)
    for trial in range(6):
        row = rng.standard_normal((1, H)).astype(np.float32)
        alone = forward(params, jnp.asarray(row))
        for T in (2, 9, 40, 300, 2048):
            x = rng.standard_normal((T, H)).astype(np.float32)
            p = T // 2
            x[p] = row[0]
            batch = forward(params, jnp.asarray(x))
            where = f"row {trial} at position {p} of {T}"
            np.testing.assert_array_equal(batch.routing.weights[p], alone.routing.weights[0], err_msg=where)
            np.testing.assert_array_equal(batch.y[p], alone.y[0], err_msg=where)
