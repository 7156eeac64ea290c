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


@pytest.mark.parametrize("T", [3, 40])
def test_pallas_lowers_quantized_weights_to_the_tpu_kernels_for_tpu(T):
    """impl="pallas" with int4 (asymmetric, groups of 32) weights in a program lowered for TPU: the Mosaic TPU
    tile kernels of decode (T <= 8) and of the quantized grouped prefill (T > 8)."""
    fmt = moejax.quantized.format_by_name("int4", group_size=32, symmetric=False)
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=256, num_experts=6, top_k=2, intermediate_size=256)
    init = lambda k: moejax.init_params(cfg, k, jnp.bfloat16, fmt=fmt, layout="stacked")
    params = jax.eval_shape(init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((T, 256), jnp.bfloat16)
    f = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas"))
    text = f.trace(params, x).lower(lowering_platforms=("tpu",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
    assert calls.count("tpu_custom_call") == 2, calls
    assert f"moe_tpu_{'decode' if T <= 8 else 'grouped'}_gate_up" in text


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


def _quantized_case(fmt, *, T, K, E, H, I, ids, bias=False, scale=False, seed=0, **options):
    experts = random_experts(fmt, E=E, H=H, I=I, bias=bias, seed=seed, **options)
    gate, up, down = kernel_plans.quantized_weights("test", experts)
    rng = np.random.default_rng(seed + 1)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    # distinct ids per row, as top-k gives (grouped scales each pair on its own, the reference each expert's row)
    indices = jnp.asarray(np.stack([rng.permutation(ids)[:K] for _ in range(T)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    in_scale = jnp.asarray(rng.uniform(0.5, 1.5, (T, K)), jnp.float32) if scale else None
    kw = {}
    if bias:
        kw = dict(gate_bias=experts.gate_bias, up_bias=experts.up_bias, down_bias=experts.down_bias)
        kw["activation"] = GatedActivation("gpt_oss", limit=7.0)
    return (x, gate, up, down, indices, weights, in_scale), kw


QUANTIZED_DECODE = {
    # int4 asymmetric groups of 32: two contraction steps and two column blocks in gate/up, four in down; T=3 odd,
    # E=3, id 3 (= E) skipped.
    "int4": (
        dict(fmt="int4", group_size=32, symmetric=False, T=3, K=2, E=3, H=512, I=256, ids=4),
        (256, 128, 256, 128),
    ),
    # DeepSeek FP8: H=200, I=96 (partial 128-blocks: a last group of 72 rows), input scales, T=1 over 5 experts.
    "fp8_block": (dict(fmt="fp8_block", T=1, K=3, E=5, H=200, I=96, ids=5, scale=True), None),
    # gpt-oss MXFP4 with biases and its activation: two 256-code-row chunks in gate/up's one step.
    "mxfp4": (dict(fmt="mxfp4", T=2, K=2, E=3, H=1024, I=128, ids=3, bias=True), (1024, 128, 128, 1024)),
}


@pytest.mark.parametrize("label", list(QUANTIZED_DECODE))
def test_quantized_decode_matches_the_reference(label):
    """Every quantized kind dequantized in VMEM (bf16 MXU, float32 accumulation) against the reference of the same
    rounding (`dense_reference`: each expert dequantized to float32, rounded to bf16)."""
    case, blocks = QUANTIZED_DECODE[label]
    args, kw = _quantized_case(**case)
    if blocks:
        kw["block_sizes"] = tpu_decode.TpuDecodeBlockSizes(*blocks, 32 << 20)
    got = jax.jit(lambda *a: tpu_decode.moe_tpu_decode(*a, interpret=True, **kw))(*args)
    assert_close_quantized(got, tpu_decode.moe_tpu_decode_reference(*args, **kw))


def test_quantized_grouped_matches_the_reference():
    """NVFP4 (e4m3 scales per 16, scale2 per expert) prefill on the tile kernels: T=13 odd over E=5, I=384 in
    clipped 256-column blocks, input scales, 8-row tiles (several per expert, 26 pairs), a skipped id. (int8 runs
    the same tile kernels: its decoding is checked by the decode test.)"""
    args, _ = _quantized_case("nvfp4", T=13, K=2, E=5, H=512, I=384, ids=6, scale=True)
    tiles = tpu_decode.TpuDecodeBlockSizes(512, 256, 384, 256, 32 << 20)
    bs = tpu_grouped.TpuGroupedBlockSizes((8, 128, 128), (8, 128, 128), tiles)
    got = jax.jit(lambda *a: tpu_grouped.moe_tpu_grouped(*a, block_sizes=bs, interpret=True))(*args)
    assert_close_quantized(got, tpu_grouped.moe_tpu_grouped_reference(*args))


def test_fused_decode_matches_the_reference():
    """The fused kernel (gate/up, activation and down in one, h in VMEM): float32, I=192 in 128-blocks (a masked
    partial last block), H=320 whole, skipped ids, gpt-oss biases and activation, input scales: 1e-5."""
    T, K, E, H, I = 3, 2, 3, 320, 192
    x, gate, up, down, indices, weights, scale = random_case(
        7, T=T, K=K, E=E, H=H, I=I, dtype=jnp.float32, id_range=E + 1, scale=True
    )
    kw = dict(activation=GatedActivation("gpt_oss", limit=7.0), **_biases(8, E, H, I, jnp.float32))
    blocks = tpu_decode.TpuDecodeBlockSizes(H, 128, I, 128, 32 << 20, fused_block_i=128)
    args = (x, gate, up, down, indices, weights, scale)
    got = jax.jit(lambda *a: tpu_decode.moe_tpu_decode(*a, block_sizes=blocks, interpret=True, **kw))(*args)
    assert_close(got, tpu_decode.moe_tpu_decode_reference(*args, **kw), jnp.float32)


def test_fused_quantized_grouped_matches_the_reference():
    """The fused kernel on int4 groups of 32 (the down weights' [even | odd] columns of h permuted in VMEM), two
    I blocks, T=11 over E=5 in 8-row tiles."""
    args, _ = _quantized_case("int4", group_size=32, T=11, K=2, E=5, H=256, I=512, ids=5)
    tiles = tpu_decode.TpuDecodeBlockSizes(256, 256, 512, 256, 32 << 20, fused_block_i=256)
    bs = tpu_grouped.TpuGroupedBlockSizes((8, 128, 128), (8, 128, 128), tiles)
    got = jax.jit(lambda *a: tpu_grouped.moe_tpu_grouped(*a, block_sizes=bs, interpret=True))(*args)
    assert_close_quantized(got, tpu_grouped.moe_tpu_grouped_reference(*args))


def test_e4m3_decodes_directly_as_through_float16():
    """The TPU kernels' e4m3 decoding (straight to float32) equals the shared one (through float16) on every
    byte, NaNs included."""
    from pallas_kernels.codecs import e4m3_to_f32

    codes = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(e4m3_to_f32(codes, direct=True)), np.asarray(e4m3_to_f32(codes)))
