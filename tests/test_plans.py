"""The plans (XLA on the stacked layout, CPU on the per-expert layout) against the dense float32 reference, on fresh
random inputs; the read-once property of each, counted at run time."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_backends import check_layer, layer_forward, layer_inputs, layout_of

import moejax
from moejax.backends.xla import union_of_experts
from moejax.slots import Slots, expert_activation, slots_from_routing
from moejax.weights import ExpertWeights, FusedExpertWeights

FAMILIES = moejax.FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["xla", "cpu"])
def test_every_family_grouped_plans(family, kind):
    """Every family through the grouped plans. Their decode plans: tests/test_families.py::test_family_matches_numpy
    (impl "xla" / "cpu" at T=5 run xla_decode / cpu_decode, every family, against the numpy model)."""
    check_layer(f"{kind}_grouped", moejax.MoEConfig.preset(family), 37, False, 4)


def test_grouped_plan_with_empty_experts_and_one_hot_expert():
    """256 experts, a handful of tokens: most experts get nothing; then every token on the same experts."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=256, top_k=8)
    check_layer("xla_grouped", cfg, 5, False, 7)
    check_layer("xla_grouped", cfg, 150, True, 8)


def test_union_of_experts_dedupes_in_first_seen_order():
    indices = jnp.array([[3, 1], [1, 7], [9, 3]], jnp.int32)  # 9 is a zero-computation expert when E = 8
    union_ids, n_union, slot_position = union_of_experts(indices, num_experts=8)
    assert int(n_union) == 3
    np.testing.assert_array_equal(union_ids[:3], [3, 1, 7])
    np.testing.assert_array_equal(slot_position, [[0, 1], [1, 2], [0, 0]])


@settings(max_examples=4)  # each example compiles a new shape (suite time: 12 CPU s at 6)
@given(family=st.sampled_from(FAMILIES), T=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_bfloat16_close_to_reference(family, T, seed):
    _check_bfloat16("xla", family, T, seed)


@settings(max_examples=3)
@given(family=st.sampled_from(FAMILIES), T=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_cpu_bfloat16_close_to_reference(family, T, seed):
    _check_bfloat16("cpu", family, T, seed)


def _check_bfloat16(impl, family, T, seed):
    """bf16 weights and activations: the plans round the activation to bf16 before the down projection, the
    reference does not; the difference stays at bf16 resolution of the output's scale."""
    cfg = moejax.MoEConfig.preset(family)
    params, x, tid = layer_inputs(cfg, T, seed, jnp.bfloat16, layout=layout_of(impl))
    ref = layer_forward(params, x, cfg, tid, "reference").astype(jnp.float32)
    got = layer_forward(params, x, cfg, tid, impl).astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-2 * scale)


def _count_expert_reads(monkeypatch, experts):
    """Record, at run time, which experts' gate/up weights are read, in either layout: every read passes through
    the format's `gate_up`, which the patch makes report the first weight of the expert it reads (random and
    distinct per expert, so it names the expert)."""
    stacked = moejax.weights.as_stacked(experts)
    expert_of = {float(v): e for e, v in enumerate(np.asarray(stacked.gate[:, 0, 0]))}
    assert len(expert_of) == stacked.num_experts
    reads = []
    # The per-expert layout keeps dense experts as FusedExpertWeights: gate_up_weight[0, 0] is gate[0, 0].
    for fmt, first in ((ExpertWeights, lambda w: w.gate[0, 0]), (FusedExpertWeights, lambda w: w.gate_up_weight[0, 0])):

        def counting_gate_up(self, x, original=fmt.gate_up, first=first):
            jax.debug.callback(lambda v: reads.append(expert_of[float(v)]), first(self))
            return original(self, x)

        monkeypatch.setattr(fmt, "gate_up", counting_gate_up)
    return reads


def _slots(params, x, cfg, indices=None):
    routing = moejax.route(params, x, cfg)
    if indices is not None:
        routing = moejax.Routing(indices=indices, weights=routing.weights, logits=routing.logits)
    return routing, slots_from_routing(routing, cfg)


def _run(impl, params, x, slots, cfg, **kwargs):
    """The plan jitted as users run it (eager runs op by op: 2-3x the CPU time), traced anew for each call: the
    counting patch of `gate_up` must be in the trace."""
    run = moejax.backends.BACKENDS[impl].run
    plan = jax.jit(lambda e, v, s: run(e, v, s, expert_activation(cfg), **kwargs))
    plan(params.experts, x, slots).block_until_ready()
    jax.effects_barrier()


@pytest.mark.parametrize("impl", ["xla_decode", "cpu_decode"])
@pytest.mark.parametrize("rows", ["random", "same", "distinct"])
def test_decode_plan_reads_each_union_expert_once(monkeypatch, impl, rows):
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=64, top_k=8)
    params, x, _ = layer_inputs(cfg, 8, 1, layout=layout_of(impl))
    if rows == "same":
        x = jnp.broadcast_to(x[0], x.shape)
    distinct = jnp.arange(64, dtype=jnp.int32).reshape(8, 8) if rows == "distinct" else None  # 64 experts
    routing, slots = _slots(params, x, cfg, distinct)
    reads = _count_expert_reads(monkeypatch, params.experts)
    _run(impl, params, x, slots, cfg)
    union = set(np.asarray(routing.indices).ravel().tolist())
    assert sorted(reads) == sorted(union)  # every union expert read exactly once, nothing else
    assert len(reads) == {"same": 8, "distinct": 64}.get(rows, len(union))


@pytest.mark.parametrize(("E", "T", "K", "block_rows"), [(64, 12, 2, 8), (16, 45, 4, None)])
def test_grouped_plan_reads_each_expert_once_per_block(monkeypatch, E, T, K, block_rows):
    """Experts without tokens are never read; the others once per block of their pairs."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=E, top_k=K)
    params, x, _ = layer_inputs(cfg, T, 2)
    routing, slots = _slots(params, x, cfg)
    reads = _count_expert_reads(monkeypatch, params.experts)
    _run("xla_grouped", params, x, slots, cfg, block_rows=block_rows)
    B = block_rows or moejax.backends.xla.grouped_block_rows(T * K, E)
    counts = np.bincount(np.asarray(routing.indices).ravel(), minlength=E)
    expected_blocks = {e: -(-int(c) // B) for e, c in enumerate(counts) if c}
    assert {e: reads.count(e) for e in set(reads)} == expected_blocks  # empty experts are never read


def test_cpu_grouped_plan_never_reads_empty_experts(monkeypatch):
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=64, top_k=2)
    params, x, _ = layer_inputs(cfg, 12, 2, layout="per_expert")
    routing, slots = _slots(params, x, cfg)
    reads = _count_expert_reads(monkeypatch, params.experts)
    _run("cpu_grouped", params, x, slots, cfg)
    assert set(reads) == set(np.asarray(routing.indices).ravel().tolist())


@functools.partial(jax.jit, static_argnums=(0, 4))  # eager runs op by op: 3x the CPU time
def _jit_run(impl, experts, x, slots, act):
    return moejax.backends.BACKENDS[impl].run(experts, x, slots, act)


def test_slots_skip_ids_past_the_experts():
    """Ids >= E (zero-computation experts, experts of other devices) are never computed by any plan."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=16, top_k=4)
    for impl in ("xla_decode", "cpu_decode", "xla_grouped", "cpu_grouped", "reference"):
        params, x, _ = layer_inputs(cfg, 3, 4, layout=layout_of(impl))
        indices = jnp.array([[0, 16, 3, 99], [16, 16, 16, 16], [5, 5, 1, 17]], jnp.int32)
        slots = Slots(indices, jnp.where(indices < 16, 0.5, 0.0))
        got = _jit_run(impl, params.experts, x, slots, expert_activation(cfg))
        want = _jit_run("reference", params.experts, x, slots, expert_activation(cfg))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(got[1], 0.0)
