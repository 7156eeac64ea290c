"""The XLA plans against the dense float32 reference, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moejax
from moejax.plans import union_of_experts

FAMILIES = moejax.FAMILIES


def _inputs(cfg, T, seed, dtype=jnp.float32):
    kp, kx, kt = jax.random.split(jax.random.key(seed), 3)
    params = moejax.init_params(cfg, kp, dtype)
    x = jax.random.normal(kx, (T, cfg.hidden_size), jnp.float32).astype(dtype)
    token_ids = jax.random.randint(kt, (T,), 0, cfg.vocab_size) if cfg.hash_routing else None
    return params, x, token_ids


@given(
    family=st.sampled_from(FAMILIES),
    T=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_decode_plan_equals_reference(family, T, seed):
    cfg = moejax.MoEConfig.preset(family)
    params, x, tid = _inputs(cfg, T, seed)
    ref = moejax.moe_forward(params, x, cfg, tid, impl="reference")
    got = moejax.moe_forward(params, x, cfg, tid, impl="xla_decode")
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@given(family=st.sampled_from(FAMILIES), T=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_grouped_plan_equals_reference(family, T, seed):
    cfg = moejax.MoEConfig.preset(family)
    params, x, tid = _inputs(cfg, T, seed)
    ref = moejax.moe_forward(params, x, cfg, tid, impl="reference")
    got = moejax.moe_forward(params, x, cfg, tid, impl="xla_grouped")
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_union_of_experts_dedupes_in_first_seen_order():
    indices = jnp.array([[3, 1], [1, 7], [9, 3]], jnp.int32)  # 9 is a zero-computation expert when E = 8
    union_ids, n_union, slot_position = union_of_experts(indices, num_experts=8)
    assert int(n_union) == 3
    np.testing.assert_array_equal(union_ids[:3], [3, 1, 7])
    np.testing.assert_array_equal(slot_position, [[0, 1], [1, 2], [0, 0]])


@pytest.mark.parametrize("impl", ["xla_decode", "xla_grouped"])
def test_bfloat16_close_to_reference(impl):
    cfg = moejax.MoEConfig.preset("qwen3_moe")
    params, x, tid = _inputs(cfg, 6, 0, jnp.bfloat16)
    ref = moejax.moe_forward(params, x, cfg, tid, impl="reference").astype(jnp.float32)
    got = moejax.moe_forward(params, x, cfg, tid, impl=impl).astype(jnp.float32)
    np.testing.assert_allclose(got, ref, rtol=3e-2, atol=3e-2)
