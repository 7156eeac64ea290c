"""The grouped backward kernels (pallas_kernels/gpu_backward.py, tpu_backward.py, grouped_backward.py) in interpret
mode on CPU: each kernel against its plain-jnp reference, the whole VJP against `jax.vjp` of the dense reference,
and moejax's `impl="pallas"` gradients (its own backward) against the reference backend's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from native_inputs import ACTIVATIONS, dense, rows
from oracles import assert_close
from test_backends import random_slots, reference_grads, routed_grads

import moejax
from moejax import backends
from pallas_kernels import gpu_backward, grouped_backward, tpu_backward
from pallas_kernels.gpu_grouped import block_aligned_layout

E = 5


def _tables(T: int, K: int, seed: int):
    """Tile tables of random ids in which experts 1 and 3 are empty, and ids outside [0, E) are skipped."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice([0, 2, 4, 7], size=K, replace=False) for _ in range(T)])
    _, row_pair, tile_expert, num_tiles = block_aligned_layout(jnp.asarray(idx), E)
    return row_pair.shape[0], tile_expert, num_tiles


def _normal(seed: int, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_tgmm_equals_a_per_expert_einsum(dtype, variant):
    """dW[e] = a_eᵀ b_e over the rows of expert e only, summed in float32 and stored in the operands' dtype, zero for
    the empty experts (numpy per group)."""
    R, tile_expert, num_tiles = _tables(7, 2, 0)
    a, b = _normal(1, (R, 128), dtype), _normal(2, (R, 64), dtype)
    if variant == "gpu":
        tgmm = functools.partial(gpu_backward.tgmm_tiles, interpret=True)
    else:
        tgmm = functools.partial(tpu_backward.tpu_tgmm_tiles, interpret=True)
    got = jax.jit(lambda *args: tgmm(*args, num_experts=E, out_dtype=dtype))(a, b, tile_expert, num_tiles)
    assert got.dtype == dtype
    got = np.asarray(got, np.float32)
    want = np.zeros((E, 128, 64), np.float32)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    for t in range(int(num_tiles[0])):
        rows_t = slice(64 * t, 64 * t + 64)
        want[int(tile_expert[t])] += a64[rows_t].T @ b64[rows_t]
    assert not want[1].any() and not want[3].any() and not got[1].any() and not got[3].any()
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: the float32 sum rounded once
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_grouped_matmul_equals_reference(transpose_rhs, variant):
    R, tile_expert, num_tiles = _tables(7, 2, 3)
    lhs, w, bias = (
        _normal(4, (R, 64), jnp.bfloat16),
        _normal(5, (E, 64, 128), jnp.bfloat16),
        _normal(6, (E, 128), jnp.float32),
    )
    if transpose_rhs:
        w = jnp.swapaxes(w, 1, 2)  # [E, N, K]
    if variant == "gpu":
        mm = functools.partial(gpu_backward.grouped_matmul, interpret=True)
    else:
        mm = functools.partial(tpu_backward.tpu_grouped_matmul, interpret=True)
    run = lambda *args: mm(*args, bias=bias, transpose_rhs=transpose_rhs)
    got = jax.jit(run)(lhs, w, tile_expert, num_tiles)
    want = gpu_backward.grouped_matmul_reference(lhs, w, tile_expert, num_tiles, bias=bias, transpose_rhs=transpose_rhs)
    live = (jnp.arange(R) < 64 * num_tiles[0])[:, None]  # tiles past those in use are unwritten
    np.testing.assert_allclose(jnp.where(live, got, 0), want, rtol=1e-5, atol=1e-4)


# (T, H, I, K, activation, biases, in_scale): T = 1 and 7, H and I not multiples of the 64-wide tiles.
VJP_CASES = [
    (1, 40, 24, 2, "gelu_tanh", False, False),
    (7, 40, 24, 2, "gpt_oss", True, True),
]


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("case", VJP_CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}-{c[4]}")
def test_grouped_vjp_equals_the_dense_references_vjp(case, variant):
    T, H, I, K, act, bias, in_scale = case
    rng = np.random.default_rng(T * 100 + H)
    experts = dense(E, H, I, bias=bias, seed=T)
    idx = jnp.asarray(np.stack([rng.choice([0, 2, 4, 7, -1], size=K, replace=False) for _ in range(T)]))
    weights = _normal(7, (T, K), jnp.float32)
    scale = _normal(8, (T, K), jnp.float32) if in_scale else None
    kw = dict(
        activation=ACTIVATIONS[act],
        gate_bias=experts.gate_bias,
        up_bias=experts.up_bias,
        down_bias=experts.down_bias,
        cotangent=rows(T, H, 9),
    )
    args = (rows(T, H, 10), experts.gate, experts.up, experts.down, idx, weights, scale)
    if variant == "gpu":
        op = functools.partial(grouped_backward.moe_grouped_vjp, interpret=None)  # the CPU program interprets it
    else:
        op = functools.partial(grouped_backward.moe_tpu_grouped_vjp, interpret=True)
    got = jax.jit(lambda *a: op(*a, **kw))(*args)
    want = grouped_backward.moe_grouped_vjp_reference(*args, **kw)
    assert got._fields == want._fields
    assert_close([g for g in got if g is not None], [w for w in want if w is not None], 1e-5, floor=1e-3)
    assert (got.gate_bias is None) == (not bias) and (got.in_scale is None) == (not in_scale)


# (T, K, activation, biases, in_scale, dtype, tolerance): decode (pallas_decode) and grouped calls; without input
# scales a row picks one expert in two slots (hash routing), each pair differentiated on its own. bf16: the products
# take bf16 operands (dy, dg, du rounded like the forward's h) and accumulate in float32.
BACKEND_CASES = [
    (7, 2, "gpt_oss", True, True, "float32", 1e-4),
    (1, 3, "silu_clamp_before", False, False, "float32", 1e-4),
    (12, 2, "silu", False, False, "bfloat16", 3e-2),
]


def test_grouped_vjp_of_no_rows_is_zero():
    experts = dense(E, 40, 24, bias=True)
    args = (jnp.zeros((0, 40)), experts.gate, experts.up, experts.down, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2)))
    biases = dict(gate_bias=experts.gate_bias, up_bias=experts.up_bias, down_bias=experts.down_bias)
    got = grouped_backward.moe_grouped_vjp(
        *args, **biases, activation=ACTIVATIONS["silu"], cotangent=jnp.zeros((0, 40))
    )
    assert got.x.shape == (0, 40) and got.gate.shape == experts.gate.shape and got.in_scale is None
    assert not any(bool(jnp.any(g)) for g in got if g is not None)


@pytest.mark.parametrize("case", BACKEND_CASES, ids=lambda c: f"T{c[0]}-{c[2]}-{c[5]}")
def test_pallas_backend_gradients_run_its_own_backward(case):
    """`jax.grad` through `impl="pallas"` equals the reference's and its program holds the backward kernels."""
    T, K, act, bias, in_scale, dtype, tol = case
    H, I = 40, 24
    experts = dense(E, H, I, dtype=dtype, bias=bias, seed=3)
    x, slots, act = rows(T, H, 4), random_slots(T, K, E, 5, in_scale=in_scale), ACTIVATIONS[act]
    probe = rows(T, H, 6)
    got = routed_grads("pallas", experts, x, slots, act, probe)
    assert_close(got, reference_grads(experts, x, slots, act, probe), tol, floor=1e-3)
    assert all(leaf.dtype == jnp.dtype(dtype) for leaf in jax.tree.leaves(got[0]))

    def loss(experts, x):  # the routing weights held: no output-weight gradient, no recomputed outputs
        return jnp.sum(backends.run_routed("pallas", experts, x, slots, act) * probe)

    grad = jax.grad(loss, argnums=(0, 1))
    assert "moe_grouped_vjp" in str(jax.make_jaxpr(grad)(experts, x))
    assert_close(jax.jit(grad)(experts, x), got[:2], 1e-6, floor=1e-3)


def test_pallas_backend_hands_quantized_bases_to_the_routed_backward():
    """Quantized bases have no backward kernel: their input gradient comes from `routed_vjp`."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=E, top_k=2, hidden_size=128, intermediate_size=128)
    q = moejax.quantize(moejax.init_params(cfg, jax.random.key(0), layout="stacked"), cfg, "int8", group_size=64)
    x, slots, act = rows(3, 128, 8), random_slots(3, 2, E, 9), ACTIVATIONS["silu"]
    loss = lambda impl: lambda x: jnp.sum(backends.run_routed(impl, q.experts, x, slots, act))
    assert "moe_grouped_vjp" not in str(jax.make_jaxpr(jax.grad(loss("pallas")))(x))
    np.testing.assert_allclose(jax.grad(loss("pallas"))(x), jax.grad(loss("reference"))(x), rtol=2e-2, atol=2e-2)


def test_auto_differentiates_like_its_forward_chooses(monkeypatch):
    """Under "auto" with a kernel candidate, the backward is chosen while lowering as the forward is: the kernels'
    where they are validated for the devices, `routed_vjp` elsewhere (here: a CPU program)."""
    monkeypatch.setattr(backends, "kernel_validated", lambda name: True)
    T, H, I, K = 12, 40, 24, 2
    experts = dense(E, H, I, bias=True, seed=11)
    x, slots, act, probe = rows(T, H, 12), random_slots(T, K, E, 13), ACTIVATIONS["silu"], rows(T, H, 14)
    assert backends.candidates("auto", T, K)[0] == "pallas_grouped"
    assert_close(
        routed_grads("auto", experts, x, slots, act, probe),
        reference_grads(experts, x, slots, act, probe),
        2e-4,
        floor=1e-3,
    )
    loss = lambda e, x: jnp.sum(backends.run_routed("auto", e, x, slots, act) * probe)
    assert "pallas_vjp|routed_vjp" in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(experts, x))


def test_kernels_and_references_share_signatures():
    import inspect

    pairs = [
        (gpu_backward.grouped_matmul, gpu_backward.grouped_matmul_reference),
        (gpu_backward.tgmm_tiles, gpu_backward.tgmm_tiles_reference),
        (grouped_backward.moe_grouped_vjp, grouped_backward.moe_grouped_vjp_reference),
    ]
    for kernel, reference in pairs:
        assert inspect.signature(kernel) == inspect.signature(reference), kernel.__name__
