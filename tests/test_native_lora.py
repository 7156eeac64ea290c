"""LoRA adapters on the native CPU path (csrc/lora.h): the routed experts' deltas inside the kernel against
moejax's float32 reference with adapters, every activation, dense and quantized formats, awkward sizes (odd H
and I, ranks differing per adapter, targets missing), mixed and out-of-range ids; a row's bits alone equal its
bits inside batches of other adapters; id-0 rows equal the call without adapters; the whole layer (router and
shared expert) through `moe_forward` under "auto", which now runs native with adapters; gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from native_inputs import ACTIVATIONS, slots
from native_inputs import dense as _dense
from native_inputs import normal as _normal
from native_inputs import rows as _x
from oracles import assert_close

import moejax
from moejax import quantized as Q
from moejax.backends import native
from moejax.backends.reference import reference_routed
from moejax.lora import ExpertLoRA, LoRAPair, _target_shapes, adapt, clamp_ids, from_pairs, stack
from moejax.slots import Slots

pytestmark = pytest.mark.skipif(not native.available(), reason="moejax._native_cpu is not built")

N_IDS = 4  # ids 0..3 (0: none); 7 and -1 are out of range (-> 0)


def _expert_stack(E, H, I, *, targets=("gate", "up", "down"), seed=0) -> ExpertLoRA:
    """A stack (`moejax.lora.stack`'s layout, built in numpy) of 3 adapters of ranks 3, 8 and 5 on the routed
    experts' `targets`, ranks zero-padded to 8; the second has no down target (zeros); id 0 zeros. B is drawn
    large enough that every delta shows."""
    rng = np.random.default_rng(seed)
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    pairs = {}
    for name in targets:
        n_in, n_out = shapes[name]
        a, b = np.zeros((4, E, 8, n_in), np.float32), np.zeros((4, E, n_out, 8), np.float32)
        for i, rank in enumerate((3, 8, 5), start=1):
            if i == 2 and name == "down":
                continue
            a[i, :, :rank] = rng.standard_normal((E, rank, n_in)) / np.sqrt(n_in)
            b[i, :, :, :rank] = rng.standard_normal((E, n_out, rank))
        pairs[name] = LoRAPair(jnp.asarray(a), jnp.asarray(b), jnp.asarray([0, 0.5, 1.5, 2.5], jnp.float32))
    return ExpertLoRA(**pairs)


def _slots(T, K, E, seed, *, in_scale=False) -> Slots:
    """Random slots (`native_inputs.slots`: skipped ids up to E + 1, weight-0 slots); adapter ids cycle through
    0..3 and the out-of-range 7, -1."""
    s = slots(T, K, E, seed, in_scale=in_scale, beyond=2)
    ids = np.array([1, 2, 0, 3, 7, -1, 2, 1, 3][:T] + [1] * max(0, T - 9), np.int32)
    return Slots(s.indices, s.out_weight, s.in_scale, jnp.asarray(ids))


def _reference(experts, x, slots, act):
    """moejax's float32 reference with the adapters, on ids clamped as `moejax.lora.clamp_ids`."""
    clamped = Slots(slots.indices, slots.out_weight, slots.in_scale, clamp_ids(slots.adapter, N_IDS))
    run = jax.jit(reference_routed, static_argnames="act")
    return np.asarray(run(experts, x, clamped, act=act))


def _check_call(experts, lora, x, slots, act, what):
    """Native with adapters == the reference; id-0 rows (out-of-range ids too) == native without adapters."""
    got = np.asarray(native.routed_experts(adapt(experts, lora), x, slots, act))
    want = _reference(adapt(experts, lora), x, slots, act)
    assert_close(got, want, what=what)
    base = np.asarray(native.routed_experts(experts, x, slots, act))
    none = np.asarray(clamp_ids(slots.adapter, N_IDS)) == 0
    np.testing.assert_array_equal(got[none], base[none], err_msg=what)
    assert np.abs(got[~none] - base[~none]).max() > 1e-2, what  # the adapters did change the other rows
    return got


# -- the routed experts' kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("act_name", ACTIVATIONS)
def test_dense_experts_with_adapters_match_the_reference(act_name):
    """Odd H and I (vector tails), ranks 3/8/5 (rank tails), biases, Llama-4's input scale on one activation."""
    E, H, I, T, K = 5, 37, 23, 9, 3
    act = ACTIVATIONS[act_name]
    experts = _dense(E, H, I, bias=act_name == "gpt_oss")
    slots = _slots(T, K, E, 0, in_scale=act_name == "silu")
    _check_call(experts, _expert_stack(E, H, I), _x(T, H), slots, act, act_name)


@pytest.mark.parametrize(("fmt", "targets"), [("int4_asym", ("gate", "down")), ("mxfp4", ("up",))])
def test_quantized_formats_with_missing_targets(fmt, targets):
    E, H, I, T, K = 4, 64, 96, 7, 2
    scheme = {"int4_asym": ("int4", {"group_size": 32, "symmetric": False}), "mxfp4": ("mxfp4", {})}[fmt]
    experts = Q.quantize_experts(_dense(E, H, I, seed=2), Q.format_by_name(scheme[0], **scheme[1]))
    lora = _expert_stack(E, H, I, targets=targets, seed=3)
    _check_call(experts, lora, _x(T, H, 4), _slots(T, K, E, 5), ACTIVATIONS["gelu_tanh"], fmt)


def test_a_rows_bits_do_not_depend_on_the_batch_or_its_neighbours_adapters():
    """One row with adapter 2 alone, then at several positions of batches of 2..40 rows whose other rows carry
    every id (the same x under other adapters too: such rows must not share a pair); and the row on id 0 equals
    the call without adapters."""
    E, H, I, K = 6, 40, 24, 2
    experts, lora, act = _dense(E, H, I, seed=6), _expert_stack(E, H, I, seed=7), ACTIVATIONS["silu"]
    row = _x(1, H, 8)
    idx = jnp.asarray([[1, 4]], jnp.int32)
    w = jnp.asarray([[0.7, 0.3]], jnp.float32)
    run = lambda x, i, wt, ids: np.asarray(native.routed_experts(adapt(experts, lora), x, Slots(i, wt, None, ids), act))
    alone = run(row, idx, w, jnp.asarray([2], jnp.int32))[0]
    for T in (2, 5, 40):
        rng = np.random.default_rng(T)
        x = np.array(_x(T, H, T))
        i = rng.integers(0, E, (T, K)).astype(np.int32)
        wt = rng.uniform(0.1, 1, (T, K)).astype(np.float32)
        ids = rng.integers(0, N_IDS, T).astype(np.int32)
        x[:] = np.where(rng.random((T, 1)) < 0.5, np.asarray(row), x)  # copies of the row under any adapter
        for pos in sorted({0, T // 2, T - 1}):
            x[pos], i[pos], wt[pos], ids[pos] = row[0], idx[0], w[0], 2
        got = run(jnp.asarray(x), jnp.asarray(i), jnp.asarray(wt), jnp.asarray(ids))
        for pos in sorted({0, T // 2, T - 1}):
            np.testing.assert_array_equal(got[pos], alone, err_msg=f"T={T} position {pos}")
    base = np.asarray(native.routed_experts(experts, row, Slots(idx, w), act))[0]
    np.testing.assert_array_equal(run(row, idx, w, jnp.asarray([0], jnp.int32))[0], base)
    assert np.abs(alone - base).max() > 1e-2


def test_bad_lora_shapes_raise_in_python():
    E, H, I = 3, 16, 8
    experts, lora = _dense(E, H, I), _expert_stack(E, H, I)
    x, slots = _x(2, H), _slots(2, 2, E, 0)
    with pytest.raises(ValueError, match=r"lora\.gate"):
        bad = lora.gate.__class__(lora.gate.a[:, :, :, :-1], lora.gate.b, lora.gate.scale)
        native.routed_experts(adapt(experts, lora.__class__(bad, lora.up, lora.down)), x, slots, ACTIVATIONS["silu"])
    with pytest.raises(ValueError, match=r"slots\.adapter"):
        native.routed_experts(adapt(experts, lora), x, Slots(slots.indices, slots.out_weight), ACTIVATIONS["silu"])


# -- the whole layer --------------------------------------------------------------------------------------------

CFG = moejax.MoEConfig.preset(
    "qwen2_moe", num_experts=8, top_k=2, hidden_size=33, intermediate_size=19, shared_intermediate_size=21
)


@functools.cache
def _layer():
    """qwen2_moe (sigmoid-gated shared expert): params, x, a stack of two adapters on every target (ranks 4, 2)."""
    params = moejax.init_params(CFG, jax.random.key(0), jnp.float32, layout="per_expert")
    rng = np.random.default_rng(9)
    adapters = []
    for rank in (4, 2):
        pairs = {}
        for name, (lead, n_in, n_out) in _target_shapes(CFG).items():
            a, b = _normal(rng, (*lead, rank, n_in), n_in), _normal(rng, (*lead, n_out, rank), 1)
            pairs[name] = LoRAPair(a, b, jnp.float32(0.5))
        adapters.append(from_pairs(pairs))
    x = _x(6, CFG.hidden_size, 10)
    return params, x.at[1].set(x[0]), stack(adapters)


IDS = jnp.asarray([1, 2, 0, 5, 2, 1], jnp.int32)  # rows 0 and 1: one x, two adapters; 5 is out of range


def test_layer_runs_native_with_adapters_and_matches_the_reference():
    """qwen2_moe per-expert (the fused [out, in] format) with router, routed and shared (gate included) adapters:
    "auto" runs native, the routed and shared experts' adapters inside the kernel call, equal to the reference."""
    params, x, lora = _layer()
    assert moejax.chosen_impl(params, x, CFG, lora=lora) == "native"
    forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))
    hlo = forward.lower(params, x, CFG, None, "auto", lora=lora, adapter_ids=IDS).as_text()
    assert hlo.count("moejax_routed_experts_lora") == 2  # routed and shared experts with their adapters
    got = np.asarray(forward(params, x, CFG, None, "auto", lora=lora, adapter_ids=IDS))
    want = np.asarray(forward(params, x, CFG, None, "reference", lora=lora, adapter_ids=IDS))
    np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)
    assert np.abs(got[0] - got[1]).max() > 1e-3  # one x, two adapters


def test_layer_gradients_with_adapters_equal_the_references():
    params, x, lora = _layer()
    c = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(lora, x, impl):
        return jnp.sum(c * moejax.moe_forward(params, x, CFG, None, impl, lora=lora, adapter_ids=IDS))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    got, want = grad(lora, x, "auto"), grad(lora, x, "reference")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert np.abs(got[0].shared.down.b[1:]).max() > 1e-3 and np.abs(got[0].experts.down.b[1:]).max() > 1e-3


def test_router_and_shared_gate_deltas_native_match_pair_delta_and_its_gradients():
    """`native_ops.lora_delta` (the router's and the shared expert's sigmoid gate's adapters) against XLA's
    `pair_delta`: values at odd sizes (in=37, out=11, rank 5) with ids 0, in range and clamped, zeros on id-0 rows,
    a row's bits alone equal its bits inside 40 rows; gradients are `pair_delta`'s; bad shapes raise in Python."""
    from moejax.backends import native_ops
    from moejax.lora import pair_delta

    rng = np.random.default_rng(11)
    n, r, n_in, n_out, T = 4, 5, 37, 11, 40
    pair = LoRAPair(_normal(rng, (n, r, n_in), n_in), _normal(rng, (n, n_out, r), 1), jnp.asarray([0, 0.5, 2, -1.0]))
    x = _x(T, n_in, 12)
    ids = clamp_ids(jnp.asarray(rng.integers(-1, n + 2, T), jnp.int32), n)
    got = np.asarray(native_ops.native_lora_delta(pair, x, ids))
    np.testing.assert_allclose(got, pair_delta(pair, x, ids), rtol=1e-5, atol=1e-5)
    assert (got[np.asarray(ids) == 0] == 0).all() and np.abs(got).max() > 0.1
    for pos in (0, 17, T - 1):
        alone = native_ops.native_lora_delta(pair, x[pos : pos + 1], ids[pos : pos + 1])
        np.testing.assert_array_equal(got[pos], np.asarray(alone)[0], err_msg=f"position {pos}")
    c = jnp.cos(jnp.arange(T * n_out, dtype=jnp.float32)).reshape(T, n_out)
    grads = [
        jax.grad(lambda p, x, f=f: jnp.sum(c * f(p, x, ids)), argnums=(0, 1))(pair, x)
        for f in (native_ops.lora_delta, pair_delta)
    ]
    for g, w in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="b must be"):
        native_ops.native_lora_delta(LoRAPair(pair.a, pair.b[:, :, :2], pair.scale), x, ids)
    with pytest.raises(ValueError, match="adapter must be"):
        native_ops.native_lora_delta(pair, x, ids[:3])


def test_a_rows_layer_output_with_router_and_shared_gate_adapters_does_not_depend_on_the_batch():
    """qwen2_moe with adapters on every target (the router and the shared expert's sigmoid gate included): a row
    with adapter 1 alone equals the same row inside batches of 9 and 300 rows of mixed ids, bit for bit, under
    XLA's default pipeline. With XLA's `pair_delta` for the router (its form changes at 8 rows) this fails."""
    from xla_pipeline import DEFAULT_PIPELINE

    params, x0, lora = _layer()
    forward = jax.jit(
        lambda p, x, ids: moejax.moe_forward(p, x, CFG, lora=lora, adapter_ids=ids), compiler_options=DEFAULT_PIPELINE
    )
    row = x0[:1]
    alone = np.asarray(forward(params, row, jnp.asarray([1], jnp.int32)))[0]
    for T in (9, 300):
        rng = np.random.default_rng(T)
        x = np.array(_x(T, CFG.hidden_size, T))
        ids = rng.integers(0, 3, T).astype(np.int32)
        positions = sorted({0, T // 2, T - 1})
        x[positions], ids[positions] = np.asarray(row[0]), 1
        got = np.asarray(forward(params, jnp.asarray(x), jnp.asarray(ids)))
        for pos in positions:
            np.testing.assert_array_equal(got[pos], alone, err_msg=f"T={T} position {pos}")


def test_eight_four_and_one_chain_dots_give_the_same_bits():
    """The deltas' dots run 8 chains at once (AVX2: their lane trees across registers), then 4, then 1: each sum
    must be the one chain's bits whatever block computed it. Rank 13 and out 21 (8 + 4 + 1 blocks): u (B the
    identity, so delta = u exactly) and every output column equal the same sums computed alone (rank 1, out 1)."""
    from moejax.backends import native_ops

    rng = np.random.default_rng(5)
    n, r, n_in, n_out, T = 3, 13, 43, 21, 6
    a, b = _normal(rng, (n, r, n_in), n_in), _normal(rng, (n, n_out, r), 1)
    scale, x, ids = jnp.asarray([0, 0.5, 1.5]), _x(T, n_in, 6), jnp.asarray([1, 2, 1, 2, 0, 1], jnp.int32)
    eye = jnp.broadcast_to(jnp.eye(r), (n, r, r))
    u = np.asarray(native_ops.native_lora_delta(LoRAPair(a, eye, scale), x, ids))
    ones = jnp.ones((n, 1, 1))
    for j in range(r):
        alone = native_ops.native_lora_delta(LoRAPair(a[:, j : j + 1], ones, scale), x, ids)
        np.testing.assert_array_equal(u[:, j], np.asarray(alone)[:, 0], err_msg=f"u[{j}]")
    got = np.asarray(native_ops.native_lora_delta(LoRAPair(a, b, scale), x, ids))
    for c in range(n_out):
        alone = native_ops.native_lora_delta(LoRAPair(a, b[:, c : c + 1], scale), x, ids)
        np.testing.assert_array_equal(got[:, c], np.asarray(alone)[:, 0], err_msg=f"column {c}")
