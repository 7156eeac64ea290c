"""LoRA adapters through the router, every XLA/CPU plan, the shared expert, merge, and gradients.

One small config (qwen2_moe: softmax router, sigmoid-gated shared expert) and one stack of two adapters of
different ranks (the second without shared-expert targets), so that most tests share compiled programs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax.lora import LoRAPair, _target_shapes, adapt, from_pairs, merge, stack, unmerge
from moejax.slots import Slots, expert_activation
from moejax.weights import as_stacked

PLANS = ("xla_decode", "xla_grouped", "cpu_decode", "cpu_grouped")
CFG = moejax.MoEConfig.preset(
    "qwen2_moe", num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, shared_intermediate_size=24
)
T = 6
IDS = jnp.array([1, 2, 0, 1, 2, 2], jnp.int32)  # rows 0 and 1 share x (different adapters: never merged)

forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


def _adapter(cfg, seed, rank, names=None, b_scale=1.0):
    """A random single adapter: A ~ N(0, 1/in), B ~ N(0, b_scale²), s = 0.5 (not PEFT's zero-init B)."""
    pairs, rng = {}, np.random.default_rng(seed)
    for name, (lead, n_in, n_out) in _target_shapes(cfg).items():
        a = rng.standard_normal((*lead, rank, n_in), np.float32) / np.sqrt(n_in)
        b = b_scale * rng.standard_normal((*lead, n_out, rank), np.float32)
        if names is None or name in names:
            pairs[name] = LoRAPair(jnp.asarray(a), jnp.asarray(b), jnp.float32(0.5))
    return from_pairs(pairs)


ADAPTERS = [
    _adapter(CFG, 1, rank=4),
    _adapter(CFG, 2, rank=2, names=("router", "experts.gate", "experts.up", "experts.down"), b_scale=2.0),
]
LORA = stack(ADAPTERS)


@functools.cache
def _inputs(layout="stacked", dtype=jnp.float32):
    params = moejax.init_params(CFG, jax.random.key(0), dtype, layout=layout)
    x = jax.random.normal(jax.random.key(3), (T, CFG.hidden_size)).astype(dtype)
    return params, x.at[1].set(x[0])


@functools.cache
def _reference():
    """The reference output and the reference gradients (w.r.t. the adapters and x) of the mixed batch."""
    params, x = _inputs()
    y = forward(params, x, CFG, None, "reference", lora=LORA, adapter_ids=IDS)
    return y, _grad(LORA, x, params, "reference")


def _loss(lora, x, params, impl):
    c = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)  # a fixed cotangent
    return jnp.sum(c * moejax.moe_forward(params, x, CFG, None, impl, lora=lora, adapter_ids=IDS))


_grad = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=3)


def _layout(impl):
    return "per_expert" if impl.startswith("cpu") else "stacked"


@pytest.mark.parametrize(
    ("impl", "dtype"), [(p, "float32") for p in PLANS] + [("cpu_decode", "bfloat16")], ids=lambda v: str(v)
)
def test_mixed_batch_equals_each_row_with_its_adapter(impl, dtype):
    """Byte for byte per row against the same batch with every row on that row's adapter; close to the
    reference; id 0 rows equal the base output bit for bit."""
    params, x = _inputs(_layout(impl), jnp.dtype(dtype))
    mixed = forward(params, x, CFG, None, impl, lora=LORA, adapter_ids=IDS)
    for i in (1, 2, 0):  # the last: every row on id 0
        alone = forward(params, x, CFG, None, impl, lora=LORA, adapter_ids=jnp.full((T,), i, jnp.int32))
        rows = np.asarray(IDS) == i
        np.testing.assert_array_equal(np.asarray(mixed)[rows], np.asarray(alone)[rows])
    if dtype == "float32":
        np.testing.assert_allclose(mixed, _reference()[0], rtol=2e-5, atol=2e-5)
        assert not np.allclose(mixed[0], mixed[1], atol=1e-3)  # same x, different adapters
    base = forward(params, x, CFG, None, impl)
    np.testing.assert_array_equal(np.asarray(mixed)[np.asarray(IDS) == 0], np.asarray(base)[np.asarray(IDS) == 0])
    np.testing.assert_array_equal(alone, base)


def test_per_adapter_equals_reference_on_merged_weights():
    params, x = _inputs()
    for i in (1, 2):
        ids = jnp.full((T,), i, jnp.int32)
        got = forward(params, x, CFG, None, "xla_decode", lora=LORA, adapter_ids=ids)
        want = forward(merge(params, LORA, i), x, CFG, None, "reference")
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        one = forward(merge(params, ADAPTERS[i - 1]), x, CFG, None, "reference")  # a single adapter merges too
        np.testing.assert_allclose(one, want, rtol=1e-6, atol=1e-6)
    per_expert = merge(_inputs("per_expert")[0], LORA, 2)  # the per-expert layout merges the same
    np.testing.assert_allclose(as_stacked(per_expert.experts).down, merge(params, LORA, 2).experts.down)
    back = unmerge(merge(params, LORA, 1), LORA, 1)
    for w, w0 in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(w, w0, rtol=1e-5, atol=1e-5)


def test_router_delta_is_applied_before_top_k():
    """Route with the adapter = top-k of the merged router's logits, and it changes the selection (a delta added
    after top-k would keep the base selection)."""
    params, x = _inputs()
    base = moejax.route(params, x, CFG)
    for i in (1, 2):
        ids = jnp.full((T,), i, jnp.int32)
        got = moejax.route(params, x, CFG, lora=LORA.router, adapter=ids)
        merged = moejax.route(merge(params, LORA, i), x, CFG)
        np.testing.assert_array_equal(got.indices, merged.indices)
        np.testing.assert_array_equal(got.indices, jax.lax.top_k(merged.logits, CFG.top_k)[1])
        np.testing.assert_allclose(got.weights, merged.weights, rtol=1e-5, atol=1e-6)
        assert (np.sort(got.indices, -1) != np.sort(base.indices, -1)).any()
    zero = moejax.route(params, x, CFG, lora=LORA.router, adapter=jnp.zeros((T,), jnp.int32))
    np.testing.assert_array_equal(zero.logits, base.logits)


def test_different_ranks_padded_exactly():
    assert LORA.router.rank == 4 and LORA.num_ids == 3
    np.testing.assert_array_equal(LORA.router.a[2, 2:], 0.0)  # adapter 2 has rank 2, padded with zeros
    np.testing.assert_array_equal(LORA.shared.gate.a[2], 0.0)  # and no shared targets
    _, x = _inputs()
    one = stack([ADAPTERS[1]]).router  # rank 2 alone, unpadded
    got = moejax.lora.pair_delta(LORA.router, x, jnp.full((T,), 2, jnp.int32))
    want = moejax.lora.pair_delta(one, x, jnp.ones((T,), jnp.int32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got).max() > 0.1


def test_both_forms_of_the_row_delta_equal_the_per_row_formula():
    """Up to GATHER_MAX_ROWS rows each row gathers its own adapter; more rows read every adapter and each row
    selects its own: both give each row `s[id]·(x·A[id]ᵀ)·B[id]ᵀ`."""
    pair = LORA.router
    for R in (moejax.lora.GATHER_MAX_ROWS, moejax.lora.GATHER_MAX_ROWS + 5):
        x = jax.random.normal(jax.random.key(R), (R, CFG.hidden_size))
        ids = jnp.arange(R, dtype=jnp.int32) % LORA.num_ids
        want = np.stack([pair.scale[i] * (x[t] @ pair.a[i].T) @ pair.b[i].T for t, i in enumerate(ids.tolist())])
        np.testing.assert_allclose(moejax.lora.pair_delta(pair, x, ids), want, rtol=1e-5, atol=1e-5, err_msg=f"{R}")
        assert np.abs(want).max() > 0.1


def test_quantized_base_with_adapters():
    params, x = _inputs()
    q = moejax.quantize(params, CFG, "int8", group_size=None)
    got = forward(q, x, CFG, None, "xla_decode", lora=LORA, adapter_ids=IDS)
    want = forward(moejax.dequantize(q), x, CFG, None, "reference", lora=LORA, adapter_ids=IDS)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    merged = merge(q, LORA, 1)  # dequantized to float32 dense, then merged
    assert isinstance(merged.experts, moejax.ExpertWeights) and merged.experts.gate.dtype == jnp.float32


@pytest.mark.parametrize("impl", PLANS)
def test_grads_equal_the_reference(impl):
    """jax.jit(jax.grad) w.r.t. the adapters and x through each plan (custom_vjp) equals the reference path's,
    the router adapter included (through the slot weights)."""
    params, x = _inputs(_layout(impl))
    got, want = _grad(LORA, x, params, impl), _reference()[1]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert np.abs(got[0].router.b[1:]).max() > 1e-3  # router gradients flow
    np.testing.assert_array_equal(got[0].router.b[0], 0.0)  # id 0 is no adapter: no gradient


def test_grads_without_lora_through_a_plan():
    params, x = _inputs()
    loss = lambda x, impl: jnp.sum(moejax.moe_forward(params, x, CFG, None, impl) ** 2)
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    np.testing.assert_allclose(grad(x, "xla_grouped"), grad(x, "reference"), rtol=1e-4, atol=1e-4)


def test_kernels_refuse_adapters():
    params, x = _inputs()
    slots = Slots(jnp.zeros((T, 2), jnp.int32), jnp.ones((T, 2)), None, IDS)
    with pytest.raises(NotImplementedError, match="LoRA"):
        moejax.backends.pallas.pallas_decode(adapt(params.experts, LORA.experts), x, slots, expert_activation(CFG))
    want = "native" if moejax.backends.native.available() else "xla_decode"  # native applies adapters (CPU)
    assert moejax.chosen_impl(params, x, CFG, impl="auto", lora=LORA) == want


def test_errors_name_what_is_wrong():
    params, x = _inputs()
    with pytest.raises(ValueError, match=r"moejax\.lora\.stack"):
        moejax.moe_forward(params, x, CFG, lora=ADAPTERS[0], adapter_ids=IDS)
    with pytest.raises(ValueError, match=r"\(6,\).*\(5,\)"):
        moejax.moe_forward(params, x, CFG, lora=LORA, adapter_ids=IDS[:5])
    with pytest.raises(ValueError, match="without adapter_ids"):
        moejax.moe_forward(params, x, CFG, lora=LORA)
    with pytest.raises(ValueError, match="without lora"):
        moejax.moe_forward(params, x, CFG, adapter_ids=IDS)
    with pytest.raises(TypeError, match="integers"):
        moejax.moe_forward(params, x, CFG, lora=LORA, adapter_ids=IDS.astype(jnp.float32))
    other = moejax.MoEConfig.preset(
        "qwen2_moe", num_experts=8, top_k=2, hidden_size=32, intermediate_size=8, shared_intermediate_size=24
    )
    wrong = stack([_adapter(other, 1, rank=4)])
    with pytest.raises(ValueError, match=r"experts\.gate: B expected shape \(2, 8, 16, 4\).*\(2, 8, 8, 4\)"):
        moejax.moe_forward(params, x, CFG, lora=wrong, adapter_ids=IDS)
    no_shared = moejax.MoEConfig.preset("qwen3_moe", num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    with pytest.raises(ValueError, match=r"shared\.gate"):
        moejax.lora.check_lora(LORA, no_shared)


def test_out_of_range_ids_clamped_to_zero_and_raised_by_checked_forward():
    params, x = _inputs()
    bad = jnp.array([5, -1, 0, 3, 0, 0], jnp.int32)
    got = forward(params, x, CFG, None, "xla_decode", lora=LORA, adapter_ids=bad)
    base = forward(params, x, CFG, None, "xla_decode")
    np.testing.assert_array_equal(got, base)
    with pytest.raises(checkify.JaxRuntimeError, match="adapter_ids outside"):
        moejax.checked_moe_forward(params, x, CFG, impl="xla_decode", lora=LORA, adapter_ids=bad)


def test_adapter_ids_split_with_the_rows_on_a_data_parallel_mesh():
    params, x = _inputs()
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    split = NamedSharding(mesh, P("data"))
    xs, ids = jax.device_put(x, split), jax.device_put(IDS, split)
    got = forward(params, xs, CFG, None, "xla_grouped", lora=LORA, adapter_ids=ids)
    want = forward(params, x, CFG, None, "xla_grouped", lora=LORA, adapter_ids=IDS)
    assert got.sharding.spec[0] == "data"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
