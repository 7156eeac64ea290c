"""The native backward (csrc/backward_cpu.cc, `moejax.backends.native.routed_backward`): gradients against
`jax.grad` of the dense reference for dense float32 / bfloat16 / float16 experts in both layouts, every activation,
biases and input scales at awkward sizes; the same bits run to run, with one thread or the pool, and for a row
whatever its neighbours; the formats it does not read fall back to the grouped JAX backward."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_inputs import ACTIVATIONS, dense, rows
from test_backends import random_slots, reference_grads, routed_grads

import moejax
from moejax import backends
from moejax.backends import native
from moejax.slots import Slots
from moejax.weights import FusedExpertWeights, to_layout

pytestmark = pytest.mark.skipif(not native.available(), reason="moejax._native_cpu is not built")
_slots = functools.partial(random_slots, zero_weight=True)  # a chosen expert of weight 0: a weight gradient
_grads, _reference_grads = routed_grads, reference_grads

LAYOUTS = ("stacked", "per_expert", "stacked_fused")


def _experts(E, H, I, *, dtype="float32", bias=False, seed=0, layout="stacked"):
    """Random dense experts in `layout` ("stacked_fused": the `[out, in]` format stacked)."""
    experts = dense(E, H, I, dtype=dtype, bias=bias, seed=seed)
    if layout == "stacked_fused":
        return FusedExpertWeights.from_dense(experts)
    return to_layout(experts, layout)


def _assert_close(got, want, tol):
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = max(float(np.abs(w).max()), 1e-3)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def _jaxpr(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


@settings(max_examples=12, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    act=st.sampled_from(sorted(ACTIVATIONS)),
    sizes=st.sampled_from([(1, 13, 7, 1, 1), (7, 24, 11, 5, 5), (300, 20, 9, 6, 2), (5, 37, 19, 3, 2)]),
    bias=st.booleans(),
    in_scale=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_float32_grads_equal_the_reference(layout, act, sizes, bias, in_scale, seed):
    """T = 1, 7, 300; H, I not multiples of 8; E = 1; top-k = E; skipped ids; a repeated expert; a zero weight."""
    T, H, I, E, K = sizes
    experts = _experts(E, H, I, bias=bias, seed=seed, layout=layout)
    x, slots, act = rows(T, H, seed + 1), _slots(T, K, E, seed + 2, in_scale=in_scale), ACTIVATIONS[act]
    probe = rows(T, H, seed + 3)
    got = _grads("native", experts, x, slots, act, probe)
    want = _reference_grads(experts, x, slots, act, probe)
    _assert_close(got, want, 2e-4)
    assert float(jnp.abs(got[1]).max()) > 1e-3 or not bool(jnp.any(slots.out_weight > 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_with_more_rows_than_a_chunk(layout):
    """1500 rows on 2 experts (about 300 each): each expert's weight gradients are products over several chunks of
    its rows (and blocks within them), the chains continued in row order."""
    T, H, I, E, K = 1500, 20, 9, 2, 1
    experts = _experts(E, H, I, bias=True, layout=layout)
    x, slots, act, probe = rows(T, H, 1), _slots(T, K, E, 2, in_scale=True), ACTIVATIONS["gelu_tanh"], rows(T, H, 3)
    _assert_close(
        _grads("native", experts, x, slots, act, probe), _reference_grads(experts, x, slots, act, probe), 2e-4
    )


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("layout", ["stacked", "stacked_fused"])
def test_products_whose_columns_end_inside_a_vector(layout, isa, monkeypatch):
    """About 37 rows an expert (the transposed products' columns: 2 vectors and 5 lanes of 16, 4 and 5 of 8), H
    and I not multiples of 8: the partial last vector runs in its panel's tile, loading (the stacked layout's
    summed input gradient) and storing only its lanes; the reference's gradients with either variant."""
    monkeypatch.setenv("MOEJAX_NATIVE_ISA", isa)
    T, H, I, E, K = 111, 37, 19, 3, 1
    experts = _experts(E, H, I, bias=True, layout=layout)
    x, slots, act, probe = rows(T, H, 1), _slots(T, K, E, 2), ACTIVATIONS["silu"], rows(T, H, 3)
    _assert_close(
        _grads("native", experts, x, slots, act, probe), _reference_grads(experts, x, slots, act, probe), 2e-4
    )


def test_the_native_backward_runs_under_native_and_auto():
    """The grad program calls the C++ backward where the native forward runs (under "auto" beside the other
    candidates' program for other platforms, chosen while lowering; under "native" alone: no grouped JAX loop)."""
    E, H, I, T, K = 4, 16, 8, 6, 2
    experts, x, slots, act = _experts(E, H, I), rows(T, H), _slots(T, K, E, 1), ACTIVATIONS["silu"]
    for impl in ("native", "auto"):
        loss = lambda e, x, impl=impl: jnp.sum(backends.run_routed(impl, e, x, slots, act))
        text = _jaxpr(jax.grad(loss, argnums=(0, 1)), experts, x)
        assert native.BACKWARD_TARGET in text, impl
        assert impl == "auto" or "while" not in text


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 1e-2), ("float16", 2e-3)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_16bit_weights_accumulate_in_float32(dtype, tol, layout):
    """16-bit parameters: the reference's gradients (float32 math on the widened weights), in the weights' dtype."""
    E, H, I, T, K = 4, 24, 17, 12, 2
    experts = _experts(E, H, I, dtype=dtype, bias=True, layout=layout)
    x, slots, act, probe = rows(T, H, 1), _slots(T, K, E, 2), ACTIVATIONS["gpt_oss"], rows(T, H, 3)
    got = _grads("native", experts, x, slots, act, probe)
    want = _reference_grads(experts, x, slots, act, probe)
    assert all(leaf.dtype == jnp.dtype(dtype) for leaf in jax.tree.leaves(got[0]))
    _assert_close(got, want, tol)


def test_frozen_base_gives_input_gradients_only():
    """Gradients w.r.t. x and the weights of the slots alone: no weight gradient is formed (none is returned)."""
    E, H, I, T, K = 5, 24, 12, 9, 3
    experts, x, slots, probe = _experts(E, H, I), rows(T, H, 1), _slots(T, K, E, 2), rows(T, H, 3)
    act = ACTIVATIONS["silu"]

    def loss(x, out_weight, impl):
        return jnp.sum(backends.run_routed(impl, experts, x, Slots(slots.indices, out_weight), act) * probe)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    _assert_close(grad(x, slots.out_weight, "native"), grad(x, slots.out_weight, "reference"), 2e-4)
    text = _jaxpr(jax.grad(lambda x, w: loss(x, w, "native"), argnums=(0, 1)), x, slots.out_weight)
    call = next(line for line in text.splitlines() if native.BACKWARD_TARGET in line)
    assert f"f32[{E},{H},{I}]" not in call  # no weight gradient among the call's results


def _perturbed(experts, slots):
    return (jax.tree.map(lambda _: True, experts), True, Slots(False, True, slots.in_scale is not None, None))


def _train_forward(experts, x, slots, act, threads=0):
    """The training forward's (out, residual)."""
    perturbed = _perturbed(experts, slots)
    run = lambda experts, x, slots: native.routed_train_forward(experts, x, slots, act, perturbed, max_threads=threads)
    return jax.jit(run)(experts, x, slots)


def _backward(experts, x, slots, act, g, threads, *, saved=False):
    """The backward's cotangents; saved: reading the training forward's residual (same threads) instead of
    recomputing the pre-activations."""
    perturbed = _perturbed(experts, slots)
    residual = _train_forward(experts, x, slots, act, threads)[1] if saved else None

    def run(experts, x, slots, g, residual):
        return native.routed_backward(experts, x, slots, act, g, perturbed, residual=residual, max_threads=threads)

    return jax.jit(run)(experts, x, slots, g, residual)


def _bits(tree) -> list[np.ndarray]:
    return [np.asarray(leaf).view(np.uint8) for leaf in jax.tree.leaves(tree) if leaf.dtype != jax.dtypes.float0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bits_are_the_same_run_to_run_and_at_any_thread_count(layout):
    """The backward, recomputing or reading the saved pre-activations (the same bits), and the training forward."""
    E, H, I, T, K = 6, 40, 24, 70, 3  # 70 rows: experts with more than one block of 64 rows
    experts = _experts(E, H, I, bias=True, layout=layout)
    x, slots, act, g = rows(T, H, 1), _slots(T, K, E, 2, in_scale=True), ACTIVATIONS["gpt_oss"], rows(T, H, 3)
    first = _bits(_backward(experts, x, slots, act, g, 0))
    forward = _bits(_train_forward(experts, x, slots, act, 0))
    for threads in (0, 1, 2, 3):
        for saved in (False, True):
            again = _bits(_backward(experts, x, slots, act, g, threads, saved=saved))
            assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True)), (threads, saved)
        again = _bits(_train_forward(experts, x, slots, act, threads))
        assert all(np.array_equal(a, b) for a, b in zip(forward, again, strict=True)), threads


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wide_layers_take_the_streaming_products(layout, monkeypatch):
    """H = 1024 (an [out, in] expert's rows 4 KiB apart, read in place in shallower blocks) and 2I = 320 (more than
    256 weight rows: the transposed products stream whole rows of the weights, prefetched): the reference's
    gradients, and the same bits with AVX2 as with AVX-512 and on one thread as on the pool."""
    E, H, I, T, K = 2, 1024, 160, 200, 1  # about 100 rows an expert: B read in place beyond 64 rows
    experts = _experts(E, H, I, layout=layout)
    x, slots, act, g = rows(T, H, 1), _slots(T, K, E, 2), ACTIVATIONS["silu"], rows(T, H, 3)
    _assert_close(_grads("native", experts, x, slots, act, g), _reference_grads(experts, x, slots, act, g), 2e-4)
    results = {}
    for isa, threads in (("avx512", 0), ("avx512", 1), ("avx2", 0)):
        monkeypatch.setenv("MOEJAX_NATIVE_ISA", isa)
        results[isa, threads] = _bits(
            (_backward(experts, x, slots, act, g, threads, saved=True), _train_forward(experts, x, slots, act, threads))
        )
    first = results["avx512", 0]
    assert all(all(np.array_equal(a, b) for a, b in zip(first, r, strict=True)) for r in results.values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_backward_reads_the_saved_preactivations(layout):
    """The training forward's residual holds each pair's gate|up: the backward reading it gives the recomputing
    backward's bits, and a stale residual (another x's) changes the input and weight gradients."""
    E, H, I, T, K = 5, 24, 17, 40, 3
    experts = _experts(E, H, I, bias=True, layout=layout)
    x, slots, act, g = rows(T, H, 1), _slots(T, K, E, 2, in_scale=True), ACTIVATIONS["silu"], rows(T, H, 3)
    perturbed = _perturbed(experts, slots)

    def run(x_residual):
        residual = _train_forward(experts, x_residual, slots, act)[1]
        run = lambda e, x, s, g, r: native.routed_backward(e, x, s, act, g, perturbed, residual=r)
        return jax.jit(run)(experts, x, slots, g, residual)

    recomputed = _bits(_backward(experts, x, slots, act, g, 0))
    assert all(np.array_equal(a, b) for a, b in zip(recomputed, _bits(run(x)), strict=True))
    stale = run(rows(T, H, 9))
    assert not np.array_equal(np.asarray(stale[1]), np.asarray(_backward(experts, x, slots, act, g, 0)[1]))


@settings(max_examples=8, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    act=st.sampled_from(sorted(ACTIVATIONS)),
    sizes=st.sampled_from([(1, 13, 7, 1, 1), (7, 24, 11, 5, 5), (300, 20, 9, 6, 2)]),
    bias=st.booleans(),
    in_scale=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_training_forward_equals_the_forward_kernels(layout, act, sizes, bias, in_scale, seed):
    """Its routed sum is the forward kernels' and the reference's within float32 rounding (another summation
    order), slots of weight 0 and skipped ids contributing nothing."""
    T, H, I, E, K = sizes
    experts = _experts(E, H, I, bias=bias, seed=seed, layout=layout)
    x, slots, act = rows(T, H, seed + 1), _slots(T, K, E, seed + 2, in_scale=in_scale), ACTIVATIONS[act]
    out, residual = _train_forward(experts, x, slots, act)
    assert residual.shape == (T * K, 2 * I)
    inference = jax.jit(lambda e, x, s: native.routed_experts(e, x, s, act))(experts, x, slots)
    _assert_close(out, inference, 1e-5)
    stacked = to_layout(experts, "stacked")
    stacked = stacked.as_dense() if isinstance(stacked, FusedExpertWeights) else stacked
    _assert_close(out, backends.run_routed("reference", stacked, x, slots, act), 1e-5)


def test_the_training_forward_runs_only_when_differentiated():
    """A plain forward is the inference kernels' alone; a grad program runs the training forward and hands its
    residual to the backward (under "native" and "auto"); `save_residuals(False)` and `jax.checkpoint` recompute,
    with the same gradients."""
    E, H, I, T, K = 4, 16, 8, 6, 2
    experts, x, slots, act = _experts(E, H, I, bias=True), rows(T, H), _slots(T, K, E, 1), ACTIVATIONS["silu"]
    probe = rows(T, H, 3)
    assert native.TRAIN_TARGET not in _jaxpr(lambda e, x: backends.run_routed("native", e, x, slots, act), experts, x)
    loss = lambda e, x, impl="native": jnp.sum(backends.run_routed(impl, e, x, slots, act) * probe)
    grad = jax.grad(loss, argnums=(0, 1))
    for impl in ("native", "auto"):
        text = _jaxpr(jax.grad(functools.partial(loss, impl=impl), argnums=(0, 1)), experts, x)
        assert native.TRAIN_TARGET in text, impl
    saved = jax.jit(grad)(experts, x)
    try:
        native.save_residuals(False)
        text = _jaxpr(grad, experts, x)
        assert native.TRAIN_TARGET not in text and native.BACKWARD_TARGET in text
        recomputed = jax.jit(grad)(experts, x)
    finally:
        native.save_residuals(True)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(experts, x)
    for other in (recomputed, remat):
        assert all(np.array_equal(a, b) for a, b in zip(_bits(saved), _bits(other), strict=True))


def test_a_rows_input_gradient_does_not_depend_on_its_neighbours():
    """Row 0's dx and slot gradients (from the saved pre-activations) and its training forward output alone, among
    4 rows, and among 150 rows (other blocks of its experts): the same bits."""
    E, H, I, K = 3, 40, 24, 2
    experts, act = _experts(E, H, I, bias=True), ACTIVATIONS["silu"]
    x, g = rows(150, H, 1), rows(150, H, 3)
    slots = Slots(jnp.asarray(np.random.default_rng(4).integers(0, E, (150, K)), jnp.int32), jnp.full((150, K), 0.5))
    results = []
    for n in (1, 4, 150):
        s = Slots(slots.indices[:n], slots.out_weight[:n])
        _, dx, ds = _backward(experts, x[:n], s, act, g[:n], 0, saved=True)
        out = _train_forward(experts, x[:n], s, act)[0]
        results.append([np.asarray(a) for a in (dx[0], ds.out_weight[0], out[0])])
    for got in results[1:]:
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, results[0], strict=True))


QUANTIZED = {
    "int8": ("int8", {"group_size": 16}),
    "int8_channel_asym": ("int8", {"group_size": None, "symmetric": False}),
    "int4_asym": ("int4", {"group_size": 16, "symmetric": False}),
    "fp8_block": ("fp8_block", {}),
    "mxfp4": ("mxfp4", {}),
    "nvfp4": ("nvfp4", {}),
}


def _quantized(name, layout, bias=False):
    kind, kwargs = QUANTIZED[name]
    extra = {"expert_bias": True} if bias else {}
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=5, top_k=2, hidden_size=160, intermediate_size=96, **extra)
    q = moejax.quantize(moejax.init_params(cfg, jax.random.key(0), layout="stacked"), cfg, kind, **kwargs)
    return q.experts, to_layout(q.experts, layout)


def _input_grads(impl, experts, x, slots, act, probe):
    def loss(x, out_weight, in_scale):
        s = Slots(slots.indices, out_weight, in_scale)
        return jnp.sum(backends.run_routed(impl, experts, x, s, act) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, slots.out_weight, slots.in_scale)


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_quantized_bases_give_the_reference_input_gradients(fmt, layout):
    """QLoRA-style: the base frozen and quantized, gradients w.r.t. x, the slots' weights and input scales through
    the weights decoded as the forward decodes them; the program calls the native backward."""
    stacked, experts = _quantized(fmt, layout)
    T = 11
    x, slots, probe = rows(T, 160, 1), _slots(T, 2, 5, 2, in_scale=True), rows(T, 160, 3)
    act = ACTIVATIONS["gpt_oss"]
    got = _input_grads("native", experts, x, slots, act, probe)
    want = _input_grads("reference", stacked, x, slots, act, probe)
    _assert_close(got, want, 2e-4)
    loss = lambda x: jnp.sum(backends.run_routed("native", experts, x, slots, act) * probe)
    assert native.BACKWARD_TARGET in _jaxpr(jax.grad(loss), x)


def test_what_the_native_backward_does_not_read_falls_back_to_the_grouped_backward():
    """A differentiated quantized base and int8 activations: the grouped JAX backward, gradients the reference's."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    params = moejax.init_params(cfg, jax.random.key(0), layout="stacked")
    a8 = moejax.quantize(params, cfg, "int4", group_size=32, activations="int8").experts
    int8 = moejax.quantize(params, cfg, "int8", group_size=16).experts
    T = 5
    x, slots, act, probe = rows(T, 64, 1), _slots(T, 2, 4, 2), ACTIVATIONS["silu"], rows(T, 64, 3)

    def loss(x, experts, impl):
        return jnp.sum(backends.run_routed(impl, experts, x, slots, act) * probe)

    text = _jaxpr(jax.grad(lambda x: loss(x, a8, "native")), x)
    assert native.BACKWARD_TARGET not in text
    _assert_close(jax.grad(loss)(x, a8, "native"), jax.grad(loss)(x, a8, "reference"), 2e-4)
    text = _jaxpr(jax.grad(lambda e: loss(x, e, "native"), allow_int=True), int8)
    assert native.BACKWARD_TARGET not in text


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_grad_program_memory_does_not_grow_with_the_number_of_experts(layout):
    """The compiled temporary memory of the native grad program stays within 2·T·K·(H+3I)·4 bytes at E = 16 and
    128 (same T, K), plus the gradient outputs for the per-expert layout (compiled from shapes alone)."""
    T, K, H, I = 64, 4, 32, 16
    act, x, probe = ACTIVATIONS["silu"], rows(T, H, 1), rows(T, H, 3)
    temp = {}
    for E in (16, 128):
        experts = jax.eval_shape(lambda E=E: _experts(E, H, I, layout=layout))
        slots = _slots(T, K, E, 2)
        loss = lambda e, x, s=slots: jnp.sum(backends.run_routed("native", e, x, s, act) * probe)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(experts, x).compile()
        temp[E] = compiled.memory_analysis().temp_size_in_bytes
    budget = {E: 2 * T * K * (H + 3 * I) * 4 + (3 * E * H * I * 4 if layout == "per_expert" else 0) for E in temp}
    assert all(temp[E] <= budget[E] for E in temp), (temp, budget)


def test_the_isa_variants_agree(monkeypatch):
    """AVX-512 and AVX2 run the same chains of fmas (the same bits; the backward and the training forward); the
    portable variant is within float32 rounding (on x86-64 it has no fused multiply-add). The variant is read per
    call (MOEJAX_NATIVE_ISA)."""
    E, H, I, T, K = 4, 40, 24, 30, 3
    experts = _experts(E, H, I, bias=True)
    x, slots, act, g = rows(T, H, 1), _slots(T, K, E, 2, in_scale=True), ACTIVATIONS["gelu_tanh"], rows(T, H, 3)
    results = {}
    for isa in ("avx512", "avx2", "generic"):
        monkeypatch.setenv("MOEJAX_NATIVE_ISA", isa)
        results[isa] = (_backward(experts, x, slots, act, g, 0, saved=True), _train_forward(experts, x, slots, act))
    assert all(np.array_equal(a, b) for a, b in zip(_bits(results["avx512"]), _bits(results["avx2"]), strict=True))
    floats = lambda tree: [leaf for leaf in jax.tree.leaves(tree) if leaf.dtype != jax.dtypes.float0]
    _assert_close(floats(results["generic"]), floats(results["avx512"]), 1e-5)


_FRESH_BUFFERS = """
import resource
import numpy as np
import sys
from moejax.backends import native
if sys.argv[1] == "keep":
    assert native.keep_freed_memory()
def step():
    buffers = [np.ones(6 << 20, np.float32) for _ in range(3)]  # 3 x 24 MiB, as a step's gradients
    del buffers
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    sys.platform != "linux" or "asan" in os.environ.get("LD_PRELOAD", ""), reason="glibc's malloc (not ASan's)"
)
def test_keep_freed_memory_reuses_the_last_steps_pages():
    """After `keep_freed_memory`, a step's fresh buffers (72 MiB freed between steps, which fault in again about 1k
    times with glibc's defaults: the control run) reuse the last step's pages. In subprocesses: the setting is
    process-wide."""
    root = os.path.dirname(os.path.dirname(moejax.__file__))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    faults = {}
    for mode in ("keep", "default"):  # the default: the control that shows the buffers do fault in anew
        run = subprocess.run([sys.executable, "-c", _FRESH_BUFFERS, mode], capture_output=True, text=True, check=True,
                             env=env)  # fmt: skip
        faults[mode] = int(run.stdout.split()[-1])
    # without the setting each 24 MiB buffer is mapped anew: at least one fault per page (4 KiB, or 2 MiB with THP)
    assert faults["keep"] < 100 and 4 * faults["keep"] < faults["default"], faults
