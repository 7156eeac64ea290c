"""CUDA lowering from this CPU host of `moe_forward(..., impl="pallas")` at real layer sizes, with abstract inputs
(`jax.ShapeDtypeStruct`: no memory). Lowering runs the Mosaic GPU pipeline up to the kernel's MLIR module,
including the shared-memory budget check, so a kernel that would not build for a GPU fails here; what the GPU's
own compiler and the device decide (registers, numerics, speed) is seen only on a GPU (benchmarks/gpu_bench.py)."""

import re

import jax
import jax.numpy as jnp
import pytest

import moejax
from moejax.bench import MODEL_LAYERS
from moejax.forward import resolve_impl
from moejax.kernel_plans import compiled_kernels

QWEN3_30B_A3B = MODEL_LAYERS["qwen3-30b-a3b"]
DEEPSEEK_V3 = MODEL_LAYERS["deepseek-v3"]


def lower_for_cuda(cfg, T, dtype):
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, dtype=dtype), jax.random.key(0))
    x = jax.ShapeDtypeStruct((T, cfg.hidden_size), dtype)
    with compiled_kernels():
        traced = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas")).trace(params, x)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    ("cfg", "T", "dtype"),
    [
        (QWEN3_30B_A3B, 1, jnp.bfloat16),
        (QWEN3_30B_A3B, 8, jnp.bfloat16),
        (QWEN3_30B_A3B, 2048, jnp.bfloat16),
        (QWEN3_30B_A3B, 4, jnp.float32),  # TF32 path: transposed weights
        (DEEPSEEK_V3, 8, jnp.bfloat16),
        (DEEPSEEK_V3, 16384, jnp.bfloat16),  # E=256 prefill at the largest T
    ],
    ids=["qwen-T1", "qwen-T8", "qwen-T2048", "qwen-T4-f32", "dsv3-T8", "dsv3-T16384"],
)
def test_moe_forward_pallas_lowers_for_cuda(cfg, T, dtype):
    text = lower_for_cuda(cfg, T, dtype)
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
    kernel_calls = [c for c in calls if c.startswith("mosaic_gpu")]
    assert len(kernel_calls) == 2, calls  # gate/up + activation, then down
    assert "moe_gate_up_tiles" in text and "moe_down_tiles" in text
    assert not any("callback" in c for c in calls), calls  # no interpreter left in a GPU program
    plan = resolve_impl("pallas", T, cfg)
    assert plan == ("pallas_decode" if T * cfg.top_k <= 64 and T <= 8 else "pallas_grouped")


VARIANTS = {
    # gpt-oss-120b: expert biases, its clamped activation; H = 45·64 (64-column blocks).
    "gpt_oss": dict(hidden_size=2880, num_experts=128, top_k=4, intermediate_size=2880),
    # Gemma-4 26B-A4B: tanh-GELU, expert pre-norm; I = 11·64.
    "gemma4": dict(hidden_size=2816, num_experts=128, top_k=8, intermediate_size=704),
    # Llama-4 Maverick: routing weight on the input, one slot.
    "llama4": dict(hidden_size=5120, num_experts=128, top_k=1, intermediate_size=8192, shared_intermediate_size=8192),
    # Step-3.7-like: SwiGLU clamped after the activation; DeepSeek-V4-like: clamped before it.
    "step3p7": dict(hidden_size=4096, num_experts=128, top_k=8, intermediate_size=1280),
    "deepseek_v4": dict(hidden_size=4096, num_experts=256, top_k=6, intermediate_size=2048),
    "mixtral": dict(hidden_size=4096, num_experts=8, top_k=2, intermediate_size=14336),
}


@pytest.mark.parametrize("family", list(VARIANTS))
@pytest.mark.parametrize("T", [4, 256])
def test_family_variants_lower_for_cuda(family, T):
    cfg = moejax.MoEConfig.preset(family, **VARIANTS[family])
    text = lower_for_cuda(cfg, T, jnp.bfloat16)
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
    assert len([c for c in calls if c.startswith("mosaic_gpu")]) == 2, calls


def test_lowering_needs_compiled_kernels_on_a_cpu_host():
    """Without `compiled_kernels()`, tracing on CPU picks the interpreter, whose host callbacks cannot be lowered
    for CUDA: the failure is loud, not a silently interpreted GPU program."""
    params = jax.eval_shape(lambda k: moejax.init_params(QWEN3_30B_A3B, k, dtype=jnp.bfloat16), jax.random.key(0))
    x = jax.ShapeDtypeStruct((2, QWEN3_30B_A3B.hidden_size), jnp.bfloat16)
    traced = jax.jit(lambda p, x: moejax.moe_forward(p, x, QWEN3_30B_A3B, impl="pallas")).trace(params, x)
    with pytest.raises(ValueError, match="platform"):
        traced.lower(lowering_platforms=("cuda",))
