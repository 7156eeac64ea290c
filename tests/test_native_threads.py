"""How many threads the native layer's calls ask for: small calls run on the calling thread alone (handing items to
XLA's pool cost more than it saved inside a tiny model's decode loop), larger ones on the whole pool, whose threads
linger between calls; the bits do not depend on either."""

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.backends import native, native_ops

built = pytest.mark.skipif(not native.available(), reason="the native extension is not built")


def _threads_of_calls(cfg: moejax.MoEConfig, T: int, dtype=jnp.float32) -> dict[str, set[int]]:
    """{FFI target: the max_threads attributes of its calls} in the CPU program of a forward of T rows (lowered
    from shapes alone: full-size layers cost no memory)."""
    params = jax.eval_shape(lambda: moejax.init_params(cfg, jax.random.key(0), dtype, layout="stacked"))
    x = jax.ShapeDtypeStruct((T, cfg.hidden_size), dtype)
    text = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg)).trace(params, x).lower().as_text()
    calls: dict[str, set[int]] = {}
    for target, attrs in re.findall(r"custom_call @(\w+)\(.*?backend_config = \{(.*?)\}", text):
        calls.setdefault(target, set()).update(int(n) for n in re.findall(r"max_threads = (\d+)", attrs))
    return calls


@built
def test_a_tiny_layer_runs_every_native_call_on_one_thread():
    """H=64, 16 experts, top-4 (the whole-model example's layers) at decode and at T=8 (768 KiB of experts)."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=64, num_experts=16, top_k=4, intermediate_size=32)
    for T in (1, 8):
        calls = _threads_of_calls(cfg, T)
        assert calls == {"moejax_linear": {1}, "moejax_scores": set(), "moejax_routed_experts": {1}}, (T, calls)


@built
def test_a_full_size_layer_keeps_the_pool():
    """Qwen3-30B-A3B's layer at decode (8 experts of 2048 x 768: 38 MB of float32 weights per token) uses the pool
    for its experts and for its router (1 MB)."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=2048, num_experts=128, top_k=8, intermediate_size=768)
    calls = _threads_of_calls(cfg, 1)
    assert calls["moejax_routed_experts"] == {0} and calls["moejax_linear"] == {0}, calls


@built
def test_the_threshold_is_on_the_bytes_streamed():
    below = native_ops.SINGLE_THREAD_BYTES - 1
    assert native_ops.threads_for(below) == 1 and native_ops.threads_for(below + 1) == 0


@built
def test_a_row_has_the_same_bits_on_one_thread_and_on_the_pool():
    """The same row alone (one thread: small) and in a batch large enough for the pool (T=512 x 4 slots x 24 kB
    per expert = 48 MB streamed), bit for bit, with awkward sizes."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=72, num_experts=12, top_k=4, intermediate_size=28)
    params = moejax.init_params(cfg, jax.random.key(1), layout="stacked")
    rows = np.array(jax.random.normal(jax.random.key(2), (512, 72)))
    assert _threads_of_calls(cfg, 1)["moejax_routed_experts"] == {1}
    assert _threads_of_calls(cfg, 512)["moejax_routed_experts"] == {0}
    forward = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg))
    alone = np.asarray(forward(params, jnp.asarray(rows[300:301])))
    np.testing.assert_array_equal(np.asarray(forward(params, jnp.asarray(rows)))[300:301], alone)


@built
@pytest.mark.parametrize("T", [1, 8])
def test_auto_keeps_the_native_kernels_for_a_tiny_layer(T):
    """Measured in a whole model's decode loop (benchmarks/model_decode.py), the native kernels on one thread are
    never slower than the XLA:CPU plans, so "auto" keeps them (and batch invariance at any T) at every size."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=16, num_experts=4, top_k=2, intermediate_size=8)
    params = jax.eval_shape(lambda: moejax.init_params(cfg, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((T, 1, 16), jnp.float32)
    assert moejax.chosen_impl(params, x, cfg, platform="cpu") == "native"


def _pool_sized_layer():
    """An awkward-sized layer whose forward of 512 rows streams enough weights for the pool (48 MB), its inputs,
    and the forward."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=72, num_experts=12, top_k=4, intermediate_size=28)
    params = moejax.init_params(cfg, jax.random.key(1), layout="stacked")
    xs = [jax.random.normal(jax.random.key(10 + i), (512, 72)) for i in range(4)]
    return params, xs, jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="native"))


def _steps(forward, params, x, n: int = 16):
    """n forwards back to back in one program (a decode loop's calls, microseconds apart)."""
    step = lambda c, _: (forward(params, c), None)
    return jax.jit(lambda x: jax.lax.scan(step, x, None, n)[0])(x)


@built
def test_calls_made_at_once_from_several_threads_keep_their_bits():
    """Four Python threads call pool-sized forwards at once, many times: each call offers its items to the pool
    threads lingering after earlier calls (csrc/parallel.h), several calls race for them, and every result keeps
    the bits it has when made alone."""
    params, xs, forward = _pool_sized_layer()
    alone = [np.asarray(forward(params, x)) for x in xs]
    with ThreadPoolExecutor(4) as threads:
        for _ in range(6):
            for got, want in zip(threads.map(lambda x: np.asarray(forward(params, x)), xs), alone, strict=True):
                np.testing.assert_array_equal(got, want)


def _steps_in_a_process(linger_us: int) -> tuple[np.ndarray, int]:
    """`_steps` of the pool-sized layer in a fresh process with MOEJAX_NATIVE_LINGER_US=linger_us: its result and
    how many calls a lingering pool thread helped there."""
    script = (
        "import sys, numpy as np\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from moejax.backends import native\n"
        "from test_native_threads import _pool_sized_layer, _steps\n"
        "params, xs, forward = _pool_sized_layer()\n"
        "np.save(sys.argv[1], np.asarray(_steps(forward, params, xs[0])))\n"
        "print(native._module().lingering_helped())\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "y.npy")
        env = dict(os.environ, MOEJAX_NATIVE_LINGER_US=str(linger_us), JAX_PLATFORMS="cpu")
        run = subprocess.run(
            [sys.executable, "-c", script, out, os.path.dirname(__file__)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        return np.load(out), int(run.stdout.split()[-1])


@built
def test_a_pool_thread_lingers_for_the_next_call():
    """Back-to-back pool-sized calls: a pool thread that helped one takes the next one's items (counted by the
    extension) instead of the call waking a parked thread. A 100 ms budget, so that a lingering thread descheduled
    on a busy machine is still waiting when the next call comes."""
    params, xs, forward = _pool_sized_layer()
    y, helped = _steps_in_a_process(100_000)
    assert helped > 0
    np.testing.assert_array_equal(y, np.asarray(_steps(forward, params, xs[0])))


@built
def test_no_lingering_keeps_the_bits():
    """MOEJAX_NATIVE_LINGER_US=0: no pool thread lingers (none helps a call) and the bits are the same."""
    params, xs, forward = _pool_sized_layer()
    y, helped = _steps_in_a_process(0)
    assert helped == 0
    np.testing.assert_array_equal(y, np.asarray(_steps(forward, params, xs[0])))
