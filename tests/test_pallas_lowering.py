"""CUDA lowering from this CPU host of `moe_forward(..., impl="pallas")` at real layer sizes, with abstract inputs
(`jax.ShapeDtypeStruct`: no memory). The kernels pick compiled or interpreted mode by the platform they are lowered
for (`interpret=None`, pallas_kernels/platform.py), so the same trace lowers for CUDA and for CPU. Lowering runs the
Mosaic GPU pipeline up to the kernel's MLIR module, including the shared-memory budget check, so a kernel that
would not build for a GPU fails here; ptxas's verdict (registers, spills) is tests/test_cuda_compile.py's, and
what the device decides (numerics, speed) is seen only on a GPU (benchmarks/gpu_bench.py)."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from benchmark_scripts import load

import moejax
import pallas_kernels
from moejax import backends

MODEL_LAYERS = load("model_layers").MODEL_LAYERS
QWEN3_30B_A3B = MODEL_LAYERS["qwen3-30b-a3b"]
DEEPSEEK_V3 = MODEL_LAYERS["deepseek-v3"]


def abstract_inputs(cfg, T, dtype):
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, dtype=dtype, layout="stacked"), jax.random.key(0))
    return params, jax.ShapeDtypeStruct((T, cfg.hidden_size), dtype)


def lower_for_cuda(cfg, T, dtype):
    traced = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas")).trace(*abstract_inputs(cfg, T, dtype))
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
    plan = backends.candidates("pallas", T, cfg.top_k)
    assert plan == ["pallas_decode" if T * cfg.top_k <= 64 and T <= 8 else "pallas_grouped"]


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


def custom_calls(text):
    return sorted(set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)))


def test_the_lowering_platform_picks_compiled_or_interpreted():
    """One trace of a kernel with the default `interpret=None`: lowered for CUDA it is the compiled Mosaic GPU
    kernel, lowered for CPU the interpreter (host callbacks); a platform without a rule fails loudly, and a forced
    mode keeps its own platform."""
    bf16 = jnp.bfloat16
    weights = jax.ShapeDtypeStruct((4, 64, 64), bf16)
    args = (jax.ShapeDtypeStruct((2, 64), bf16), weights, weights, weights)
    args += (jax.ShapeDtypeStruct((2, 2), jnp.int32), jax.ShapeDtypeStruct((2, 2), jnp.float32))
    traced = jax.jit(pallas_kernels.moe_decode).trace(*args)
    assert custom_calls(traced.lower(lowering_platforms=("cuda",)).as_text()) == ["mosaic_gpu_v2"]
    assert custom_calls(traced.lower(lowering_platforms=("cpu",)).as_text()) == ["xla_ffi_python_cpu_callback"]
    with pytest.raises(NotImplementedError, match=r"kernel_by_platform.*rocm"):
        traced.lower(lowering_platforms=("rocm",))
    forced = jax.jit(functools.partial(pallas_kernels.moe_decode, interpret=True)).trace(*args)
    with pytest.raises(ValueError, match="platform"):
        forced.lower(lowering_platforms=("cuda",))
    forced = jax.jit(functools.partial(pallas_kernels.moe_decode, interpret=False)).trace(*args)
    with pytest.raises(ValueError, match="interpret mode"):
        forced.lower(lowering_platforms=("cpu",))


def test_moe_forward_lowers_for_cuda_and_for_cpu_from_one_trace():
    traced = jax.jit(lambda p, x: moejax.moe_forward(p, x, QWEN3_30B_A3B, impl="pallas")).trace(
        *abstract_inputs(QWEN3_30B_A3B, 2, jnp.bfloat16)
    )
    cuda = custom_calls(traced.lower(lowering_platforms=("cuda",)).as_text())
    cpu = custom_calls(traced.lower(lowering_platforms=("cpu",)).as_text())
    assert "mosaic_gpu_v2" in cuda and not any("callback" in c for c in cuda), cuda
    assert "xla_ffi_python_cpu_callback" in cpu and "mosaic_gpu_v2" not in cpu, cpu


def export_for(platforms, T=2):
    # Flat array arguments: serializing needs no pytree registration of moejax's parameter classes.
    leaves, treedef = jax.tree.flatten(abstract_inputs(QWEN3_30B_A3B, T, jnp.bfloat16))
    f = jax.jit(lambda *leaves: moejax.moe_forward(*treedef.unflatten(leaves), QWEN3_30B_A3B, impl="pallas"))
    return jax.export.export(f, platforms=platforms)(*leaves)


@pytest.mark.parametrize("T", [2, 300])  # the decode kernels, the grouped kernels
def test_export_for_cuda_from_a_cpu_host(T):
    """`jax.export` for CUDA on this CPU-only host: `mosaic_gpu_v2` is one of the custom calls JAX guarantees
    stable (jax/_src/export/_export.py), so the compiled kernels export, and serialize round trip."""
    exported = export_for(("cuda",), T)
    assert exported.platforms == ("cuda",)
    assert custom_calls(exported.mlir_module()) == ["mosaic_gpu_v2"]
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers (the cuda-compile extra)")
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cuda",) and restored.out_avals == exported.out_avals
    assert custom_calls(restored.mlir_module()) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize(
    ("platforms", "error"),
    [
        (("cpu", "cuda"), "multi-platform lowering for python_callback"),
        (("cpu",), "serialization of host_callbacks is not yet implemented"),
    ],
)
def test_export_with_the_interpreter_is_refused(platforms, error):
    """An artifact for CPU would carry the interpreter, whose host callbacks JAX can neither lower for several
    platforms at once nor serialize (jax 0.10.2): export for CUDA alone."""
    with pytest.raises(NotImplementedError, match=error):
        export_for(platforms)


def test_the_four_moe_ops_take_the_written_out_arguments():
    """The MoE ops' signature pinned by hand: the references now take their op's signature (`moe_reference`), so
    comparing an op with its reference cannot catch a changed op; this can. The moejax backends and benchmarks
    call the ops positionally up to `activation` and by keyword after."""
    import inspect

    from pallas_kernels import GatedActivation, gpu_decode, gpu_grouped, tpu_decode, tpu_grouped

    common = [
        ("x", inspect.Parameter.empty),
        ("gate", inspect.Parameter.empty),
        ("up", inspect.Parameter.empty),
        ("down", inspect.Parameter.empty),
        ("indices", inspect.Parameter.empty),
        ("weights", inspect.Parameter.empty),
        ("in_scale", None),
        ("activation", GatedActivation()),
        ("gate_bias", None),
        ("up_bias", None),
        ("down_bias", None),
        ("block_sizes", None),
    ]
    gpu_tail, tpu_tail = [("interpret", None)], [("device_kind", None), ("interpret", False)]
    for op, tail in (
        (gpu_decode.moe_decode, gpu_tail),
        (gpu_grouped.moe_grouped, gpu_tail),
        (tpu_decode.moe_tpu_decode, tpu_tail),
        (tpu_grouped.moe_tpu_grouped, tpu_tail),
    ):
        got = [(name, p.default) for name, p in inspect.signature(op).parameters.items()]
        assert got == common + tail, op.__name__
