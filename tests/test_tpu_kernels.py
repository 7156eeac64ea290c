"""The Mosaic TPU kernels (pallas_kernels/tpu_decode.py, tpu_grouped.py) under Pallas's TPU interpreter on CPU,
against their references, on awkward shapes; and `moe_decode` / `moe_grouped` lowering to them for TPU."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_decode import assert_close, random_case
from test_pallas_quantized import assert_close as assert_close_quantized
from test_pallas_quantized import random_experts

import moejax
from moejax.backends import pallas as kernel_plans
from pallas_kernels import tpu_decode, tpu_grouped
from pallas_kernels.activations import GatedActivation


def _biases(seed, E, H, I, dtype):
    rng = np.random.default_rng(seed)
    b = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.1, dtype)
    return dict(gate_bias=b(E, I), up_bias=b(E, I), down_bias=b(E, H))


def test_decode_matches_the_reference():
    """Partial last blocks (H = 2.5, I = 1.5 blocks of 128: masked contraction, clipped columns), several k
    steps and column blocks per kernel, skipped ids (>= E), gpt-oss biases and activation, float32 to 1e-5."""
    T, K, E, H, I = 2, 2, 3, 320, 192
    x, gate, up, down, indices, weights, _ = random_case(1, T=T, K=K, E=E, H=H, I=I, dtype=jnp.float32, id_range=E + 2)
    kw = dict(activation=GatedActivation("gpt_oss", limit=7.0), **_biases(2, E, H, I, jnp.float32))
    blocks = tpu_decode.TpuDecodeBlockSizes(128, 128, 128, 128, 32 << 20)
    args = (x, gate, up, down, indices, weights)
    got = jax.jit(lambda *a: tpu_decode.moe_tpu_decode(*a, block_sizes=blocks, interpret=True, **kw))(*args)
    assert_close(got, tpu_decode.moe_tpu_decode_reference(*args, **kw), jnp.float32)


@pytest.mark.parametrize("op", ["decode", "grouped"])
def test_awkward_shapes_match_the_reference(op):
    """H=40, I=24 (no 128-multiple: whole-dimension blocks), input scales; bf16 decode, float32 grouped."""
    T, dtype = (3, jnp.bfloat16) if op == "decode" else (11, jnp.float32)
    args = random_case(3, T=T, K=2, E=4, H=40, I=24, dtype=dtype, scale=True)
    module = tpu_decode if op == "decode" else tpu_grouped
    kernel, reference = getattr(module, f"moe_tpu_{op}"), getattr(module, f"moe_tpu_{op}_reference")
    got = jax.jit(lambda *a: kernel(*a, interpret=True))(*args)
    assert_close(got, reference(*args), dtype)


def test_signatures_match_their_references():
    for kernel, reference in (
        (tpu_decode.moe_tpu_decode, tpu_decode.moe_tpu_decode_reference),
        (tpu_grouped.moe_tpu_grouped, tpu_grouped.moe_tpu_grouped_reference),
    ):
        assert inspect.signature(kernel) == inspect.signature(reference)


def test_block_sizes_are_checked_and_sized_by_the_chip():
    with pytest.raises(ValueError, match="block_h"):
        tpu_decode.TpuDecodeBlockSizes(0, 128, 128, 128, 1 << 20)
    with pytest.raises(ValueError, match="block_h=96"):
        tpu_decode.TpuDecodeBlockSizes(96, 128, 128, 128, 1 << 20).check(256, 256)
    with pytest.raises(ValueError, match="tm % 8"):
        tpu_grouped.TpuGroupedBlockSizes((12, 128, 128), (8, 128, 128))
    v5e = tpu_decode.TpuDecodeBlockSizes.default(7168, 2048, jnp.bfloat16, "TPU v5 lite")
    unknown = tpu_decode.TpuDecodeBlockSizes.default(7168, 2048, jnp.bfloat16, None)
    assert v5e.vmem_limit_bytes == 64 << 20 and unknown.vmem_limit_bytes == 16 << 20
    assert v5e.block_h > unknown.block_h  # the larger VMEM takes longer contraction tiles
    assert tpu_grouped.TpuGroupedBlockSizes.default(4096, 2048, 768, jnp.bfloat16, "TPU v6 lite").gate_up[0] == 256
    with pytest.raises(NotImplementedError, match="bf16/float32"):
        tpu_decode.moe_tpu_decode(*random_case(0, T=1, K=1, E=2, H=8, I=8, dtype=jnp.float16))


@pytest.mark.parametrize("T", [2, 40])
def test_pallas_lowers_to_the_tpu_kernels_for_tpu(T):
    """impl="pallas" in a program lowered for TPU on this CPU host: Mosaic TPU calls, no Mosaic GPU ones."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=256, num_experts=8, top_k=2, intermediate_size=128)
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, jnp.bfloat16, layout="stacked"), jax.random.key(0))
    x = jax.ShapeDtypeStruct((T, 256), jnp.bfloat16)
    f = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas"))
    text = f.trace(params, x).lower(lowering_platforms=("tpu",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
    assert "tpu_custom_call" in calls and not any(c.startswith("mosaic_gpu") for c in calls), calls
    assert ("moe_tpu_decode_gate_up" in text) == (T <= 8)


def test_int8_decode_matches_the_reference():
    """int8 groups of 128 with zero points, dequantized in VMEM (bf16 MXU): two groups per contraction tile."""
    experts = random_experts("int8", E=3, H=256, I=128, group_size=128, symmetric=False)
    gate, up, down = kernel_plans.quantized_weights("test", experts)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    indices = jnp.asarray([[0, 3], [2, 0]], jnp.int32)  # id 3 skipped; expert 1 empty
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (2, 2)), jnp.float32)
    args = (x, gate, up, down, indices, weights)
    got = jax.jit(lambda *a: tpu_decode.moe_tpu_decode(*a, interpret=True))(*args)
    assert_close_quantized(got, tpu_decode.moe_tpu_decode_reference(*args))
