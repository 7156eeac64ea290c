"""The tile kernels over quantized expert weights (int8/int4 group-wise, FP8 128x128 blocks, MXFP4, NVFP4): in
Mosaic GPU interpret mode on CPU against `moejax.backends.reference.reference_routed` of the dequantized weights,
through moejax's kernel adapter (`moejax.backends.pallas`), and lowered for CUDA from this CPU host.

Interpretation is slow (seconds per call): one small case per format, each exercising several properties at once
(empty experts, ids >= E, awkward shapes where the format allows them, decode and grouped). The sm_90a compile
of int8 and FP8 at real sizes is in tests/test_cuda_compile.py.
"""

import functools
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from moejax.backends import pallas as kernel_plans
from moejax.backends.reference import reference_routed
from moejax.quantized import format_by_name
from moejax.slots import Slots
from pallas_kernels import GatedActivation, QuantizedWeight
from pallas_kernels.gpu_decode import moe_decode_reference


def experts_config(E, H, I, bias=False):
    return types.SimpleNamespace(num_experts=E, hidden_size=H, intermediate_size=I, expert_bias=bias)


def random_experts(name, *, E, H, I, bias=False, seed=0, **options):
    """Random non-zero codes and scales of format `name`, made with numpy from its declaration (no compile):
    every code value, scales spread over a factor of 4, small zero points."""
    fmt = format_by_name(name, **options)
    rng = np.random.default_rng(seed)
    fields = {}
    for field, spec in fmt.declare(experts_config(E, H, I, bias)).items():
        dtype = np.dtype(spec.dtype or "float32")
        kind = field.rsplit("_", 1)[-1]
        if kind == "q" and dtype == np.uint8:
            v = rng.integers(0, 256, spec.shape)
        elif kind == "q":  # fp8 codes, |q| <= ~300 < 448
            v = rng.standard_normal(spec.shape) * 64
        elif kind == "zero":
            v = rng.integers(-4, 4, spec.shape)
        elif kind == "scale" and dtype == np.uint8:  # e8m0: 2^-10 .. 2^-7
            v = rng.integers(117, 121, spec.shape)
        elif kind in ("scale", "scale2"):
            v = rng.uniform(0.5, 2.0, spec.shape) * (0.01 if dtype == np.float32 else 1.0)
        else:  # biases
            v = rng.standard_normal(spec.shape) * 0.1
        fields[field] = jnp.asarray(np.asarray(v).astype(dtype))
    return fmt(**fields)


def assert_close(actual, expected):
    """bf16 activations, dequantized weights and h against the float32 oracle: 2% of the output's scale."""
    expected = np.asarray(expected, np.float32)
    scale = float(np.max(np.abs(expected)))
    assert scale > 0
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, atol=2e-2 * scale, rtol=2e-2)


CASES = {
    # W8A16, groups of 64 (one scale row per 64-element step), asymmetric; T=3 decode, experts 1 and 3 empty.
    "int8": dict(fmt="int8", options=dict(group_size=64, symmetric=False), T=3, K=2, E=4, H=128, I=128, ids=3),
    # W4A16 groups of 32: four scale rows per 128-element step; T=8, K=2; id 4 (= E) skipped.
    "int4": dict(fmt="int4", options=dict(group_size=32), T=8, K=2, E=4, H=128, I=128, ids=5),
    # DeepSeek FP8: H and I not multiples of 64 (partial 128-blocks, zero-padded codes and scales); T=1.
    "fp8_block": dict(fmt="fp8_block", options={}, T=1, K=3, E=5, H=200, I=96, ids=5),
    # gpt-oss MXFP4 with expert biases.
    "mxfp4": dict(fmt="mxfp4", options={}, T=2, K=2, E=3, H=128, I=128, ids=3, bias=True),
    # NVFP4 (e4m3 scales per 16, float32 scale2 per expert): the grouped prefill kernels, 40 pairs in 64-row tiles.
    "nvfp4": dict(fmt="nvfp4", options={}, T=20, K=2, E=4, H=128, I=128, ids=3),
}


@pytest.mark.parametrize("label", list(CASES))
def test_quantized_kernels_match_reference(label):
    c = CASES[label]
    experts = random_experts(c["fmt"], E=c["E"], H=c["H"], I=c["I"], bias=c.get("bias", False), **c["options"])
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((c["T"], c["H"])), jnp.float32)
    indices = jnp.asarray(rng.integers(0, c["ids"], (c["T"], c["K"])), jnp.int32)
    slots = Slots(indices, jnp.asarray(rng.uniform(0.1, 1.0, (c["T"], c["K"])), jnp.float32))
    act = GatedActivation("gpt_oss", limit=7.0) if c.get("bias") else GatedActivation()
    plan = kernel_plans.pallas_decode if c["T"] <= 8 else kernel_plans.pallas_grouped
    # One program each (eager, every small op of the wrappers would compile on its own).
    y = jax.jit(lambda e, x, s: plan(e, x, s, act))(experts, x, slots)
    expected = jax.jit(lambda e, x, s: reference_routed(e.dequantize(), x, s, act))(experts, x, slots)
    assert_close(y, expected)


def test_kernel_weights_are_the_stored_arrays():
    """The adapter passes moejax's arrays as they are (no copy); the kernels' dequantizer is checked end to end."""
    experts = jax.eval_shape(lambda k: format_by_name("nvfp4").init(experts_config(2, 64, 32), k), jax.random.key(0))
    gate, _, _ = kernel_plans.quantized_weights("t", experts)
    assert gate.codes is experts.gate_q and gate.scale is experts.gate_scale and gate.scale2 is experts.gate_scale2
    assert gate.kind == "nvfp4" and gate.group == 16 and gate.shape == (2, 64, 32)


def test_kernel_reference_takes_quantized_weights():
    """`moe_decode_reference` (the kernels' own oracle) takes `QuantizedWeight`s like the kernels."""
    experts = random_experts("int8", E=3, H=64, I=64, group_size=None)
    x = jnp.ones((2, 64), jnp.float32)
    idx, w = jnp.asarray([[0, 2], [2, 5]], jnp.int32), jnp.asarray([[0.5, 0.5], [1.0, 1.0]], jnp.float32)
    y, expected = jax.jit(
        lambda e, x: (
            moe_decode_reference(x, *kernel_plans.quantized_weights("t", e), idx, w),
            reference_routed(e.dequantize(), x, Slots(idx, w), GatedActivation()),
        )
    )(experts, x)
    assert_close(y, expected)


def test_unsupported_group_raises_not_implemented():
    """A group size that does not tile the 64-element steps: NotImplementedError, so impl='auto' falls back."""
    fmt = format_by_name("int8", group_size=96)
    experts = jax.eval_shape(lambda k: fmt.init(experts_config(2, 192, 96), k), jax.random.key(0))
    slots = Slots(jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.float32))
    with pytest.raises(NotImplementedError, match="groups of 96"):
        kernel_plans.pallas_decode(experts, jnp.ones((1, 192)), slots, GatedActivation())
    with pytest.raises(ValueError, match="QuantizedWeight"):
        QuantizedWeight(experts.gate_q, experts.gate_scale, kind="int3")


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_block", "mxfp4", "nvfp4"])
def test_quantized_kernels_lower_for_cuda(name):
    """Decode (T=2) lowers for CUDA: two Mosaic GPU custom calls, no interpreter callbacks. Grouped prefill runs the
    same two kernels over another tile table."""
    E, H, I = 8, 256, 128
    experts = jax.eval_shape(lambda k: format_by_name(name).init(experts_config(E, H, I), k), jax.random.key(0))
    x = jax.ShapeDtypeStruct((2, H), jnp.bfloat16)
    slots = Slots(jax.ShapeDtypeStruct((2, 2), jnp.int32), jax.ShapeDtypeStruct((2, 2), jnp.float32))

    def f(experts, x, slots):
        return kernel_plans.pallas_decode(experts, x, slots, GatedActivation())

    text = jax.jit(f).trace(experts, x, slots).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
    assert [c for c in calls if c.startswith("mosaic_gpu")] == ["mosaic_gpu_v2"] * 2, calls
    assert "moe_gate_up_tiles" in text and "moe_down_tiles" in text
    assert not any("callback" in c for c in calls), calls


def test_auto_needs_a_validation_of_the_quantized_kernels(monkeypatch, tmp_path):
    """On a GPU where the dense kernels are validated, "auto" runs quantized experts on a kernel only when
    validated.json has a row for that format too (the quantized kernel bodies are separate code)."""
    from moejax import backends

    experts = jax.eval_shape(
        lambda k: format_by_name("fp8_block").init(experts_config(2, 64, 64), k), jax.random.key(0)
    )
    row = {"kernel": "moe_decode", "device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__}
    is_validated = pallas_kernels.is_validated
    for rows, quantized_ok in (([row], False), ([row, {**row, "weights": "fp8_block"}], True)):
        table = tmp_path / f"validated{len(rows)}.json"
        table.write_text(json.dumps(rows))
        monkeypatch.setattr(pallas_kernels, "is_validated", functools.partial(is_validated, path=table))
        assert backends._auto_may_run("pallas_decode", experts) is quantized_ok
        assert backends._auto_may_run("xla_decode", experts)
