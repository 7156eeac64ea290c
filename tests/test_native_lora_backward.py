"""The native backward with LoRA adapters (csrc/backward_kernels.inc, `moejax.backends.native.routed_backward` on
`moejax.lora.LoRAExperts`): the gradients of each adapter's A, B and scale and the input gradient through the
deltas, against `jax.grad` of the dense reference, for a frozen base in every weight format the backward reads
(dense float32 / bfloat16 / float16 in both layouts, quantized bases: QLoRA-style) and a trained dense base; several
adapters in one batch, ids 0 (none) and outside the stack, ranks 1 and 16, awkward sizes; the same bits run to run,
with one thread or the pool, from saved or recomputed pre-activations, and on AVX2 and AVX-512."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from native_inputs import ACTIVATIONS, dense, rows
from test_backends import random_slots
from test_native_backward import QUANTIZED, _assert_close, _bits, _quantized

import moejax
from moejax import backends
from moejax.backends import native
from moejax.lora import ExpertLoRA, LoRAPair, adapt, clamp_ids
from moejax.slots import Slots
from moejax.weights import FusedExpertWeights, to_layout

pytestmark = pytest.mark.skipif(not native.available(), reason="moejax._native_cpu is not built")
LAYOUTS = ("stacked", "per_expert", "stacked_fused")


def _stack(E, H, I, ranks, *, targets=("gate", "up", "down"), seed=0, dtype="float32") -> ExpertLoRA:
    """A stack of len(ranks) adapters (ids 1..n; id 0 zeros), ranks zero-padded to the largest; adapter 2 has no
    down target (zeros). Scales differ per adapter, so a wrong id shows."""
    rng = np.random.default_rng(seed)
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    n, rp = len(ranks) + 1, max(ranks)
    pairs = {}
    for name in targets:
        n_in, n_out = shapes[name]
        a, b = np.zeros((n, E, rp, n_in), np.float32), np.zeros((n, E, n_out, rp), np.float32)
        for i, rank in enumerate(ranks, start=1):
            if i == 2 and name == "down":
                continue
            a[i, :, :rank] = rng.standard_normal((E, rank, n_in)) / np.sqrt(n_in)
            b[i, :, :, :rank] = rng.standard_normal((E, n_out, rank)) / np.sqrt(rank)
        scale = np.linspace(0.5, 2.0, n).astype(np.float32)
        pairs[name] = LoRAPair(jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(scale))
    return ExpertLoRA(**pairs)


def _ids(T, n_ids, seed) -> jnp.ndarray:
    """Adapter ids in [-1, n_ids + 1]: 0 (none), every adapter, and ids outside the stack (-> 0); row 0 adapter 1."""
    ids = np.random.default_rng(seed).integers(-1, n_ids + 2, T)
    ids[0] = 1
    return jnp.asarray(ids, jnp.int32)


def _base(E, H, I, layout, *, dtype="float32", bias=False, seed=0):
    experts = dense(E, H, I, dtype=dtype, bias=bias, seed=seed)
    return FusedExpertWeights.from_dense(experts) if layout == "stacked_fused" else to_layout(experts, layout)


def _dense_view(base):
    """The reference's experts: the `[in, out]` stacked view of `base`."""
    stacked = to_layout(base, "stacked")
    return stacked.as_dense() if isinstance(stacked, FusedExpertWeights) else stacked


def _grads(impl, base, lora, x, slots, act, probe, *, argnums=(0, 1, 2, 3)):
    """Gradients of `<routed, probe>` w.r.t. (the adapters, x, out_weight, in_scale) by `argnums`."""

    def loss(lora, x, out_weight, in_scale):
        s = Slots(slots.indices, out_weight, in_scale, slots.adapter)
        return jnp.sum(backends.run_routed(impl, adapt(base, lora), x, s, act) * probe)

    return jax.jit(jax.grad(loss, argnums=argnums))(lora, x, slots.out_weight, slots.in_scale)


def _num_ids(lora) -> int:
    return next(p for p in (lora.gate, lora.up, lora.down) if p is not None).scale.shape[0]


def _reference(base, lora, x, slots, act, probe, **kwargs):
    clamped = Slots(slots.indices, slots.out_weight, slots.in_scale, clamp_ids(slots.adapter, _num_ids(lora)))
    return _grads("reference", _dense_view(base), lora, x, clamped, act, probe, **kwargs)


def _case(T, K, E, H, I, ranks, seed, *, in_scale=False):
    lora = _stack(E, H, I, ranks, seed=seed)
    s = random_slots(T, K, E, seed + 1, in_scale=in_scale, zero_weight=True)
    slots = Slots(s.indices, s.out_weight, s.in_scale, _ids(T, len(ranks) + 1, seed + 2))
    return lora, rows(T, H, seed + 3), slots, rows(T, H, seed + 4)


@pytest.mark.parametrize(
    "layout, act, sizes, ranks, bias, in_scale",
    [
        ("stacked", "silu", (1, 13, 7, 3, 2), (16,), False, False),
        ("per_expert", "gpt_oss", (7, 37, 19, 5, 3), (3, 1, 5), True, True),
        ("stacked_fused", "gelu_tanh", (7, 24, 11, 4, 4), (1,), True, False),
        ("stacked", "silu_clamp_after", (70, 20, 9, 3, 2), (2, 16, 4), False, True),
        ("per_expert", "silu_clamp_before", (40, 17, 10, 6, 2), (16, 3), True, False),
    ],
)
def test_adapter_and_input_grads_equal_the_reference(layout, act, sizes, ranks, bias, in_scale):
    """T = 1, 7, 40, 70 (more than a block of 64 rows on an expert); H, I not multiples of 8; several adapters in
    one batch, ids 0 and outside the stack; ranks 1 and 16; the program calls the native backward."""
    T, H, I, E, K = sizes
    base = _base(E, H, I, layout, bias=bias, seed=T)
    lora, x, slots, probe = _case(T, K, E, H, I, ranks, T, in_scale=in_scale)
    act = ACTIVATIONS[act]
    got = _grads("native", base, lora, x, slots, act, probe)
    _assert_close(got, _reference(base, lora, x, slots, act, probe), 2e-4)
    assert T == 1 or float(jnp.abs(got[0].gate.b[1:]).max()) > 1e-3
    assert not np.any(np.asarray(got[0].down.a[0]))  # id 0: no adapter
    assert len(ranks) < 2 or not np.any(np.asarray(got[0].down.b[2]))  # adapter 2 has no down target
    loss = lambda lora: jnp.sum(backends.run_routed("native", adapt(base, lora), x, slots, act) * probe)
    assert native.BACKWARD_TARGET in str(jax.make_jaxpr(jax.grad(loss))(lora))


@pytest.mark.parametrize("targets", [("gate",), ("up", "down"), ("down",)])
def test_missing_targets(targets):
    E, H, I, T, K = 4, 20, 12, 9, 2
    base, act = _base(E, H, I, "stacked", seed=1), ACTIVATIONS["silu"]
    _, x, slots, probe = _case(T, K, E, H, I, (4, 2), 5)
    lora = _stack(E, H, I, (4, 2), targets=targets, seed=6)
    got = _grads("native", base, lora, x, slots, act, probe)
    _assert_close(got, _reference(base, lora, x, slots, act, probe), 2e-4)


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 1e-2), ("float16", 2e-3)])
def test_16bit_bases_and_adapters(dtype, tol):
    """16-bit base and adapters: gradients in the adapters' dtype, within its rounding of the reference's."""
    E, H, I, T, K = 4, 24, 17, 12, 2
    base = _base(E, H, I, "per_expert", dtype=dtype, bias=True)
    lora, x, slots, probe = _case(T, K, E, H, I, (8, 3), 2)
    lora = jax.tree.map(lambda a: a.astype(dtype) if a.ndim == 4 else a, lora)
    act = ACTIVATIONS["gpt_oss"]
    got = _grads("native", base, lora, x, slots, act, probe)
    assert all(leaf.dtype == jnp.dtype(dtype) for leaf in (got[0].gate.a, got[0].down.b))
    _assert_close(got, _reference(base, lora, x, slots, act, probe), tol)


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_quantized_bases_train_their_adapters(fmt):
    """QLoRA: the quantized base frozen, the adapters' and the input gradients through the weights decoded as the
    forward decodes them (those of the dequantized float32 experts)."""
    stacked, base = _quantized(fmt, "per_expert" if fmt.startswith("int8") else "stacked")
    E, H, I, T, K = 5, 160, 96, 11, 2
    lora, x, slots, probe = _case(T, K, E, H, I, (4, 1), 3, in_scale=True)
    act = ACTIVATIONS["silu"]
    got = _grads("native", base, lora, x, slots, act, probe)
    # the native backward of the decoded float32 weights (checked against the reference above): a short compile
    want = _grads("native", stacked.dequantize(), lora, x, slots, act, probe)
    _assert_close(got, want, 2e-4)
    loss = lambda lora: jnp.sum(backends.run_routed("auto", adapt(base, lora), x, slots, act) * probe)
    assert native.BACKWARD_TARGET in str(jax.make_jaxpr(jax.grad(loss))(lora))


def test_a_trained_base_with_adapters():
    """Base weights, biases and adapters differentiated together (dense float32)."""
    E, H, I, T, K = 4, 21, 10, 15, 3
    base, act = _base(E, H, I, "stacked", bias=True, seed=2), ACTIVATIONS["gelu_tanh"]
    lora, x, slots, probe = _case(T, K, E, H, I, (5, 2), 7, in_scale=True)

    def grads(impl, slots):
        loss = lambda experts, x: jnp.sum(backends.run_routed(impl, experts, x, slots, act) * probe)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(adapt(base, lora), x)

    clamped = Slots(slots.indices, slots.out_weight, slots.in_scale, clamp_ids(slots.adapter, 3))
    _assert_close(grads("native", slots), grads("reference", clamped), 2e-4)


def test_frozen_adapters_give_input_gradients_through_the_deltas():
    E, H, I, T, K = 5, 19, 13, 8, 2
    base, act = _base(E, H, I, "stacked_fused"), ACTIVATIONS["silu"]
    lora, x, slots, probe = _case(T, K, E, H, I, (3, 6), 8)
    grad = functools.partial(_grads, argnums=(1, 2))
    got = grad("native", base, lora, x, slots, act, probe)
    _assert_close(got, _reference(base, lora, x, slots, act, probe, argnums=(1, 2)), 2e-4)


def test_int8_activations_fall_back_to_the_grouped_backward():
    """What the native backward does not read (int8 activations) runs the grouped JAX backward, with adapters."""
    E, H, I, T, K = 4, 64, 32, 6, 2
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    params = moejax.init_params(cfg, jax.random.key(0), layout="stacked")
    base = moejax.quantize(params, cfg, "int4", group_size=32, activations="int8").experts
    lora, x, slots, probe = _case(T, K, E, H, I, (2,), 4)
    act = ACTIVATIONS["silu"]
    loss = lambda lora: jnp.sum(backends.run_routed("native", adapt(base, lora), x, slots, act) * probe)
    assert native.BACKWARD_TARGET not in str(jax.make_jaxpr(jax.grad(loss))(lora))
    clamped = Slots(slots.indices, slots.out_weight, slots.in_scale, clamp_ids(slots.adapter, 2))
    got = _grads("native", base, lora, x, slots, act, probe)
    _assert_close(got, _grads("reference", base, lora, x, clamped, act, probe), 2e-4)


def _perturbed(experts, slots):
    return (jax.tree.map(lambda _: True, experts), True, Slots(False, True, slots.in_scale is not None, None))


def _run(experts, x, slots, act, g, threads, saved):
    """The backward's cotangents (reading the training forward's residual, or recomputing) and the training
    forward's output and residual, with at most `threads` threads (0: the pool)."""
    perturbed = _perturbed(experts, slots)

    def run(experts, x, slots, g):
        out, residual = native.routed_train_forward(experts, x, slots, act, perturbed, max_threads=threads)
        kwargs = {"residual": residual if saved else None, "max_threads": threads}
        return native.routed_backward(experts, x, slots, act, g, perturbed, **kwargs), out, residual

    return jax.jit(run)(experts, x, slots, g)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bits_are_the_same_run_to_run_at_any_thread_count_and_saved_or_recomputed(layout):
    E, H, I, T, K = 4, 40, 24, 90, 3  # 90 rows: experts with more than one block of 64 rows
    base = _base(E, H, I, layout, bias=True)
    lora, x, slots, g = _case(T, K, E, H, I, (16, 1, 5), 9, in_scale=True)
    experts, act = adapt(base, lora), ACTIVATIONS["gpt_oss"]
    first = _bits(_run(experts, x, slots, act, g, 0, True))
    for threads in (0, 1, 2):
        for saved in (True, False):
            again = _bits(_run(experts, x, slots, act, g, threads, saved))
            assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True)), (threads, saved)


def test_the_isa_variants_agree(monkeypatch):
    """AVX-512 and AVX2 give the same bits (the adapters' products are the backward's gemm chains)."""
    E, H, I, T, K = 4, 40, 24, 30, 3
    lora, x, slots, g = _case(T, K, E, H, I, (16, 3), 10, in_scale=True)
    experts, act = adapt(_base(E, H, I, "stacked", bias=True), lora), ACTIVATIONS["silu"]
    results = {}
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("MOEJAX_NATIVE_ISA", isa)
        results[isa] = _bits(_run(experts, x, slots, act, g, 0, False))
    assert all(np.array_equal(a, b) for a, b in zip(results["avx512"], results["avx2"], strict=True))
