"""The fused union-of-experts decode kernel in Mosaic GPU interpret mode on CPU: equal to its plain-jnp reference
and to `moe_forward(impl="reference")`, on random inputs with awkward shapes (H, I not multiples of the blocks),
E=256, empty experts, zero-computation expert ids, T = 1..8 and T·K = 64, bf16 and float32.

Interpretation is slow (seconds per call): few, small cases, each one exercising several properties at once.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
import pallas_kernels
from moejax import backends
from pallas_kernels import GatedActivation, gpu_decode, gpu_grouped, gpu_tiles


def random_case(seed, *, T, K, E, H, I, dtype, id_range=None, scale=False):
    """Random inputs made with numpy (no JAX compilation per op); ids distinct per row unless `id_range`."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    gate = jnp.asarray(rng.standard_normal((E, H, I)) / H**0.5, dtype)
    up = jnp.asarray(rng.standard_normal((E, H, I)) / H**0.5, dtype)
    down = jnp.asarray(rng.standard_normal((E, I, H)) / I**0.5, dtype)
    if id_range is None:  # distinct ids per row, as top-k gives
        indices = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    else:
        indices = rng.integers(0, id_range, (T, K))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    in_scale = jnp.asarray(rng.uniform(0.5, 1.5, (T, K)), jnp.float32) if scale else None
    return x, gate, up, down, jnp.asarray(indices, jnp.int32), weights, in_scale


def assert_close(actual, expected, dtype):
    expected = np.asarray(expected, np.float32)
    scale = float(np.max(np.abs(expected))) or 1.0
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: one rounding of h may differ by an ulp
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, atol=tol * scale, rtol=tol)


CASES = [
    # T=1 over 256 experts: 248 empty experts, H and I below one block.
    dict(T=1, K=8, E=256, H=40, I=24, dtype=jnp.bfloat16, act=GatedActivation()),
    # T·K = 64 with repeated ids across rows, I above one block (80 -> 128), clamped GELU.
    dict(
        T=8,
        K=8,
        E=16,
        H=72,
        I=80,
        dtype=jnp.float32,
        id_range=16,
        act=GatedActivation("gelu_tanh", limit=1.0, clamp_order="after_activation"),
    ),
    # Ids >= E (zero-computation experts) contribute nothing; clamped SwiGLU, gate clamped first.
    dict(T=5, K=4, E=12, H=40, I=24, dtype=jnp.bfloat16, id_range=16, act=GatedActivation(limit=0.5)),
    # gpt-oss activation; odd T.
    dict(T=3, K=4, E=8, H=40, I=24, dtype=jnp.float32, act=GatedActivation("gpt_oss", limit=0.5, alpha=1.5)),
    # Weights on the input (Llama-4: K=1).
    dict(T=4, K=1, E=8, H=40, I=24, dtype=jnp.bfloat16, scale=True, act=GatedActivation()),
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c['T']}K{c['K']}E{c['E']}" for c in CASES])
def test_decode_kernel_equals_reference(case):
    case = dict(case)
    act, dtype = case.pop("act"), case["dtype"]
    args = random_case(case["T"] * 100 + case["K"], **case)
    got = jax.jit(lambda *a: gpu_decode.moe_decode(*a, activation=act))(*args)  # interpreted: lowered for CPU
    want = jax.jit(lambda *a: gpu_decode.moe_decode_reference(*a, activation=act))(*args)
    assert got.dtype == want.dtype == jnp.float32 and got.shape == want.shape
    assert_close(got, want, dtype)


def test_union_of_experts_dedupes_on_device():
    indices = jnp.array([[3, 7, 9], [7, 3, 1], [9, 12, 3]], jnp.int32)  # 12 >= E: not in the union
    union_ids, n_union, position = gpu_decode.union_of_experts(indices, num_experts=10)
    assert int(n_union) == 4
    assert list(np.asarray(union_ids[:4])) == [3, 7, 9, 1]
    np.testing.assert_array_equal(
        np.asarray(union_ids)[np.asarray(position)][indices < 10], np.asarray(indices)[indices < 10]
    )


@pytest.mark.parametrize(
    ("family", "T", "dtype"),
    [("deepseek_v3", 2, jnp.bfloat16), ("longcat_flash", 4, jnp.float32), ("gpt_oss", 3, jnp.bfloat16)],
)
def test_moe_forward_pallas_equals_reference(family, T, dtype):
    cfg = moejax.MoEConfig.preset(family, hidden_size=40, intermediate_size=24)
    params = jax.jit(lambda k: moejax.init_params(cfg, k, dtype=dtype, layout="stacked"))(jax.random.key(1))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((T, 40)), dtype)
    assert backends.candidates("pallas", T, cfg.top_k) == ["pallas_decode"]
    got = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas"))(params, x)
    want = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="reference"))(params, x)
    assert got.dtype == x.dtype
    assert_close(got, want, dtype)


def test_signatures_match():
    pairs = [
        (gpu_decode.moe_decode, gpu_decode.moe_decode_reference),
        (gpu_grouped.moe_grouped, gpu_grouped.moe_grouped_reference),
        (gpu_tiles.gate_up_tiles, gpu_tiles.gate_up_tiles_reference),
        (gpu_tiles.down_tiles, gpu_tiles.down_tiles_reference),
    ]
    for kernel, reference in pairs:
        k, r = inspect.signature(kernel), inspect.signature(reference)
        assert list(k.parameters) == list(r.parameters), kernel.__name__
        assert [p.default for p in k.parameters.values()] == [p.default for p in r.parameters.values()]
        assert "block_sizes" in k.parameters and "interpret" in k.parameters


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="block_n"):
        gpu_tiles.TileBlockSizes(block_n=48)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        gpu_tiles.TileBlockSizes(max_concurrent_steps=1)
    with pytest.raises(ValueError, match="gate_up"):
        gpu_decode.DecodeBlockSizes(gate_up=None, down=gpu_tiles.TileBlockSizes())
    bs = gpu_decode.DecodeBlockSizes.default(7168, 2048, jnp.bfloat16)
    assert (bs.gate_up.block_n, bs.gate_up.block_k, bs.down.block_n) == (64, 64, 128)
    assert gpu_tiles.TileBlockSizes.default(768, 2048, jnp.float32).block_k == 32


def test_decode_rejects_bad_inputs():
    args = random_case(0, T=9, K=2, E=4, H=8, I=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="T <= 8"):
        gpu_decode.moe_decode(*args)  # raised while tracing, before any platform is chosen
    with pytest.raises(ValueError, match="T <= 8"):
        gpu_decode.moe_decode(*args, interpret=True)
    args = random_case(0, T=2, K=2, E=4, H=8, I=8, dtype=jnp.float32)
    with pytest.raises(TypeError, match="GatedActivation"):
        gpu_decode.moe_decode(*args, activation="silu")
    with pytest.raises(ValueError, match="kind"):
        GatedActivation("relu")


def test_unsupported_weights_raise_and_auto_falls_back(monkeypatch):
    # The kernels read the stacked layout; the per-expert layout (the CPU plans') raises NotImplementedError.
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=40, num_experts=8, top_k=2, intermediate_size=24)
    params = jax.jit(lambda k: moejax.init_params(cfg, k, layout="per_expert"))(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((20, 40)), jnp.float32)
    with pytest.raises(NotImplementedError, match="ExpertWeights"):
        moejax.moe_forward(params, x, cfg, impl="pallas")
    # Where a kernel is validated but raises, "auto" falls back to the next implementation.
    monkeypatch.setattr(backends, "kernel_validated", lambda name: True)
    assert backends.candidates("auto", 20, cfg.top_k)[0] == "pallas_grouped"
    got = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="auto"))(params, x)
    following = next(name for name in backends.candidates("auto", 20, cfg.top_k)[1:] if name != "ragged")  # CPU
    want = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl=following))(params, x)
    np.testing.assert_array_equal(got, want)


def test_auto_picks_only_validated_kernels(tmp_path, monkeypatch):
    table = tmp_path / "validated.json"
    table.write_text('[{"kernel": "moe_decode", "device_kind": "NVIDIA H200", "jax_version": "0.11.0"}]')
    assert pallas_kernels.is_validated("moe_decode", "NVIDIA H200", "0.11.0", path=table)
    assert not pallas_kernels.is_validated("moe_decode", "NVIDIA H100 80GB HBM3", "0.11.0", path=table)
    assert not pallas_kernels.is_validated("moe_decode", "NVIDIA H200", "0.11.1", path=table)
    assert not pallas_kernels.is_validated("moe_grouped", "NVIDIA H200", "0.11.0", path=table)
    for r in pallas_kernels.validated_records():  # the shipped table: kernels checked on a named device and JAX
        assert r["kernel"] in pallas_kernels.KERNELS + pallas_kernels.BACKWARD_KERNELS
        assert r["device_kind"] and r["jax_version"] and r["max_rel_error"] < 2e-2
    with pytest.raises(ValueError, match="kernel_name"):
        pallas_kernels.is_validated("moe_other", "NVIDIA H200", "0.11.0")

    cfg = moejax.MoEConfig.preset("qwen3_moe")
    monkeypatch.setattr(backends, "kernel_validated", lambda name: name == "pallas_decode")
    assert backends.candidates("auto", 2, cfg.top_k)[0] == "pallas_decode"
    assert "pallas_grouped" not in backends.candidates("auto", 100, cfg.top_k)


def test_decode_kernel_is_batch_invariant():
    """A row's output does not depend on the rows that share its batch, byte for byte (rows never mix in a tile,
    and each row sums its own slots in slot order)."""
    x, gate, up, down, indices, weights, _ = random_case(7, T=6, K=4, E=16, H=40, I=24, dtype=jnp.bfloat16)
    run = jax.jit(lambda *a: gpu_decode.moe_decode(*a, interpret=True))
    batch = run(x, gate, up, down, indices, weights)
    alone = run(x[2:3], gate, up, down, indices[2:3], weights[2:3])
    np.testing.assert_array_equal(np.asarray(batch[2:3]), np.asarray(alone))
