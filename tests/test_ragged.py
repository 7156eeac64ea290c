"""The `ragged` backend (`moejax.backends.ragged`: grouped matmuls on `jax.lax.ragged_dot`) against the dense
reference on CPU, and where "auto" takes it: in programs lowered for TPU/GPU only, never on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import backends
from moejax.backends import native
from moejax.backends.ragged import ragged_grouped
from moejax.backends.reference import reference_routed
from moejax.slots import Slots
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation


def _case(seed, *, T, K, E, H, I, dtype, bias=False, scale=False):
    rng = np.random.default_rng(seed)
    arr = lambda shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dtype)
    biases = dict(gate_bias=arr((E, I), 0.1), up_bias=arr((E, I), 0.1), down_bias=arr((E, H), 0.1)) if bias else {}
    experts = ExpertWeights(arr((E, H, I), H**-0.5), arr((E, H, I), H**-0.5), arr((E, I, H), I**-0.5), **biases)
    # Ids in [0, E + 2): ids >= E are skipped (zero-computation experts). Repeats within a row only without input
    # scales (with them the models scale the row once by the summed scales, a pair at a time here).
    ids = [rng.permutation(E + 2)[:K] for _ in range(T)] if scale else rng.integers(0, E + 2, (T, K))
    indices = jnp.asarray(np.stack(ids), jnp.int32)
    out_weight = jnp.asarray(np.where(np.asarray(indices) < E, rng.uniform(0.1, 1.0, (T, K)), 0.0), jnp.float32)
    in_scale = jnp.asarray(rng.uniform(0.5, 1.5, (T, K)), jnp.float32) if scale else None
    return experts, arr((T, H)), Slots(indices, out_weight, in_scale)


@pytest.mark.parametrize(
    "T,K,E,H,I,dtype,act,bias,scale",
    [
        # Awkward sizes, input scales (Llama-4) and biases (gpt-oss) together; then bf16 with repeated ids.
        (13, 3, 5, 24, 40, jnp.float32, GatedActivation("gpt_oss", limit=7.0), True, True),
        (37, 2, 9, 32, 24, jnp.bfloat16, GatedActivation("gelu_tanh", limit=3.0), False, False),
    ],
)
def test_ragged_matches_the_reference(T, K, E, H, I, dtype, act, bias, scale):
    experts, x, slots = _case(T + E, T=T, K=K, E=E, H=H, I=I, dtype=dtype, bias=bias, scale=scale)
    got, want = jax.jit(lambda e, x, s: (ragged_grouped(e, x, s, act), reference_routed(e, x, s, act)))(
        experts, x, slots
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: h rounded to bf16 between the products
    scale_ = float(np.max(np.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol * scale_, rtol=tol)


def test_ragged_raises_for_what_it_does_not_read():
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=32, num_experts=4, top_k=2, intermediate_size=16)
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, layout="per_expert"), jax.random.key(0))
    x = jax.ShapeDtypeStruct((20, 32), jnp.float32)
    with pytest.raises(NotImplementedError, match="ExpertWeights"):
        jax.eval_shape(lambda p, x: moejax.moe_forward(p, x, cfg, impl="ragged"), params, x)


def _lowered_text(impl, platform, T=20, batch=None):
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=32, num_experts=4, top_k=2, intermediate_size=16)
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, layout="stacked"), jax.random.key(0))
    x = jax.ShapeDtypeStruct((T, 32) if batch is None else (batch, T, 32), jnp.float32)
    f = lambda p, x: moejax.moe_forward(p, x, cfg, impl=impl)
    f = jax.jit(f if batch is None else jax.vmap(f, in_axes=(None, 0)))
    return f.trace(params, x).lower(lowering_platforms=(platform,)).as_text()


def test_auto_takes_ragged_dot_only_where_lowered_for_an_accelerator():
    """Decided by the platform the program is lowered for, not the host (a CPU here): prefill lowered for TPU or
    CUDA holds XLA's ragged_dot; lowered for CPU it holds the XLA plan's loop and no ragged_dot."""
    assert "ragged" in backends.candidates("auto", 20, 2)
    assert "ragged" not in backends.candidates("auto", 2, 2)  # decode-sized calls keep the decode plans
    for platform in ("tpu", "cuda"):
        text = _lowered_text("auto", platform)
        assert "ragged_dot" in text and native.TARGET not in text  # the native kernels are CPU-only
    cpu = _lowered_text("auto", "cpu")
    assert "ragged_dot" not in cpu
    assert (native.TARGET in cpu) if native.available() else ("stablehlo.while" in cpu)
    decode_tpu = _lowered_text("auto", "tpu", T=2)
    assert "ragged_dot" not in decode_tpu and native.TARGET not in decode_tpu
    assert "ragged_dot" in _lowered_text("auto", "tpu", batch=3)  # under vmap the choice is still made lowering
