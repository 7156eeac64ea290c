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


forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


@st.composite
def cases(draw, max_rows):
    """A family at a random size: E up to 256, K up to 8, T rows, rows random or all the same token."""
    family = draw(st.sampled_from(FAMILIES))
    E = draw(st.sampled_from([8, 16, 64, 256]))
    K = draw(st.integers(1, min(8, E)))
    overrides = {"num_experts": E, "top_k": K}
    if family == "deepseek_v3":
        overrides |= {"n_group": 4, "topk_group": 2} if E >= 16 else {"n_group": 2, "topk_group": 1}
    cfg = moejax.MoEConfig.preset(family, **overrides)
    T = draw(st.integers(1, max_rows))
    if max_rows <= 8:
        T = min(T, 64 // K)
    same_rows = draw(st.booleans())
    return cfg, T, same_rows, draw(st.integers(0, 2**16))


def _check_plan(impl, cfg, T, same_rows, seed):
    params, x, tid = _inputs(cfg, T, seed)
    if same_rows:
        x = jnp.broadcast_to(x[0], x.shape)
        tid = None if tid is None else jnp.broadcast_to(tid[0], tid.shape)
    ref = forward(params, x, cfg, tid, "reference")
    got = forward(params, x, cfg, tid, impl)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@given(cases(max_rows=8))
def test_decode_plan_equals_reference(case):
    _check_plan("xla_decode", *case)


@given(cases(max_rows=300))
def test_grouped_plan_equals_reference(case):
    _check_plan("xla_grouped", *case)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_both_plans(family):
    cfg = moejax.MoEConfig.preset(family)
    _check_plan("xla_decode", cfg, 8 if cfg.top_k <= 8 else 4, False, 3)
    _check_plan("xla_grouped", cfg, 37, False, 4)


def test_grouped_plan_with_empty_experts_and_one_hot_expert():
    """256 experts, a handful of tokens: most experts get nothing; then every token on the same experts."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=256, top_k=8)
    _check_plan("xla_grouped", cfg, 5, False, 7)
    _check_plan("xla_grouped", cfg, 150, True, 8)


def test_union_of_experts_dedupes_in_first_seen_order():
    indices = jnp.array([[3, 1], [1, 7], [9, 3]], jnp.int32)  # 9 is a zero-computation expert when E = 8
    union_ids, n_union, slot_position = union_of_experts(indices, num_experts=8)
    assert int(n_union) == 3
    np.testing.assert_array_equal(union_ids[:3], [3, 1, 7])
    np.testing.assert_array_equal(slot_position, [[0, 1], [1, 2], [0, 0]])


@given(family=st.sampled_from(FAMILIES), T=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_bfloat16_xla_close_to_reference(family, T, seed):
    """bf16 weights and activations: the plans round the activation to bf16 before the down projection, the
    reference does not; the difference stays at bf16 resolution of the output's scale."""
    cfg = moejax.MoEConfig.preset(family)
    params, x, tid = _inputs(cfg, T, seed, jnp.bfloat16)
    ref = forward(params, x, cfg, tid, "reference").astype(jnp.float32)
    got = forward(params, x, cfg, tid, "xla").astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-2 * scale)


def _count_expert_reads(monkeypatch):
    """Patch the single weight-read point to record, at run time, which experts are read."""
    reads = []
    original = moejax.ExpertWeights.expert

    def counting_expert(self, e):
        jax.debug.callback(lambda e: reads.append(int(e)), e)
        return original(self, e)

    monkeypatch.setattr(moejax.ExpertWeights, "expert", counting_expert)
    return reads


@pytest.mark.parametrize("rows", ["random", "same", "distinct"])
def test_decode_plan_reads_each_union_expert_once(monkeypatch, rows):
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=64, top_k=8)
    params, x, _ = _inputs(cfg, 8, 1)
    if rows == "same":
        x = jnp.broadcast_to(x[0], x.shape)
    routing = moejax.route(params, x, cfg)
    if rows == "distinct":  # force 8 rows onto 64 different experts
        routing = moejax.Routing(
            indices=jnp.arange(64, dtype=jnp.int32).reshape(8, 8), weights=routing.weights, logits=routing.logits
        )
    reads = _count_expert_reads(monkeypatch)
    moejax.plans.decode_plan(params.experts, x, routing, cfg).block_until_ready()
    jax.effects_barrier()
    union = set(np.asarray(routing.indices).ravel().tolist())
    assert sorted(reads) == sorted(union)  # every union expert read exactly once, nothing else
    assert len(reads) == {"same": 8, "distinct": 64}.get(rows, len(union))


@pytest.mark.parametrize(("E", "T", "K", "block_rows"), [(64, 12, 2, 8), (16, 45, 4, None)])
def test_grouped_plan_reads_each_expert_once_per_block(monkeypatch, E, T, K, block_rows):
    """Experts without tokens are never read; the others once per block of their pairs."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=E, top_k=K)
    params, x, _ = _inputs(cfg, T, 2)
    routing = moejax.route(params, x, cfg)
    reads = _count_expert_reads(monkeypatch)
    moejax.plans.grouped_plan(params.experts, x, routing, cfg, block_rows=block_rows).block_until_ready()
    jax.effects_barrier()
    B = block_rows or moejax.plans.grouped_block_rows(T * K, E)
    counts = np.bincount(np.asarray(routing.indices).ravel(), minlength=E)
    expected_blocks = {e: -(-int(c) // B) for e, c in enumerate(counts) if c}
    assert {e: reads.count(e) for e in set(reads)} == expected_blocks  # empty experts are never read
