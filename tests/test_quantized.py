"""Quantized routed-expert formats (moejax.quantized): code tables, packing, the on-disk layouts against numpy
dequantizers written here from docs/FORMATS.md, every plan and EP against dequantize-then-reference, the nnx
module, and the errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from benchmark_scripts import load
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from multihost_worker import numpy_params

import moejax
from moejax import parallel, sharding
from moejax import quantized as Q
from moejax.hf import expert_tensors as ET
from moejax.hf import quant_config as QC
from moejax.hf import quant_tensors as QT
from moejax.params import with_experts_layout

# (format name, options, on-disk sources to check)
FORMATS = {
    "int8": ("int8", {"group_size": 16}, ("compressed-tensors",)),
    "int8_channel_asym": ("int8", {"group_size": None, "symmetric": False}, ("compressed-tensors",)),
    "int4": ("int4", {"group_size": 16}, ("compressed-tensors",)),
    "int4_asym": ("int4", {"group_size": 16, "symmetric": False}, ("compressed-tensors",)),
    "fp8_block": ("fp8_block", {}, ("compressed-tensors", "deepseek")),
    "mxfp4": ("mxfp4", {}, ("compressed-tensors", "gpt-oss")),
    "nvfp4": ("nvfp4", {}, ("compressed-tensors", "modelopt")),
}
# H, I not multiples of 128 (partial FP8 blocks: 160 = 128 + 32, 96 < 128); groups of 16 and 32 divide both.
SIZES = {"hidden_size": 160, "intermediate_size": 96}


@functools.cache
def _quantized(key: str, family: str = "qwen3_moe", num_experts: int = 8):
    name, options, _ = FORMATS[key]
    cfg = moejax.MoEConfig.preset(family, num_experts=num_experts, **SIZES)
    dense = moejax.init_params(cfg, jax.random.key(0), layout="stacked")
    qparams = moejax.quantize(dense, cfg, name, **options)
    return cfg, dense, qparams


@functools.cache
def _dequantized(key: str, family: str = "qwen3_moe"):
    return jax.jit(Q.dequantize)(_quantized(key, family)[2])


@functools.cache
def _in_layout(key: str, layout: str, family: str = "qwen3_moe"):
    return with_experts_layout(_quantized(key, family)[2], layout)


# -- code tables and packing ------------------------------------------------------------------------------------


def test_e2m1_codes_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(Q.e2m1_to_f32(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0.0 at code 8
    np.testing.assert_array_equal(Q.E2M1_VALUES, want)


def test_e8m0_scales_match_ml_dtypes():
    s = np.arange(256, dtype=np.uint8)
    want = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = np.asarray(Q.e8m0_to_f32(jnp.asarray(s)))
    np.testing.assert_array_equal(got[1:255], want[1:255])
    assert got[0] == np.float32(2.0**-127) == want[0] and np.isnan(got[255]) and np.isnan(want[255])


def test_nibble_and_int32_packing_round_trip():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (10, 7), dtype=np.uint8)
    packed = Q.pack_nibbles(codes)
    assert packed.shape == (5, 7) and packed[0, 0] == codes[0, 0] | codes[1, 0] << 4  # low nibble = even element
    np.testing.assert_array_equal(Q.unpack_nibbles(packed), codes)
    # compressed-tensors int32 rows: element j at bits 4j.. of a little-endian stream; 12 nibbles -> 2 int32
    row = rng.integers(0, 16, (3, 12), dtype=np.uint8)
    words = QT._int32_rows_of_bytes(QT._stream_of_codes(row, 4))
    assert words.shape == (3, 2) and words.dtype == np.int32
    want = sum(int(row[0, j]) << (4 * j) for j in range(8))
    assert words[0, 0] == np.array(want, np.uint32).view(np.int32)
    np.testing.assert_array_equal(QT._codes_of_stream(QT._bytes_of_int32_rows(words), 4, 12), row)


def test_each_scheme_names_its_kernel_kind():
    """The kernels' kind is read off the scheme (one attribute, no translation table elsewhere)."""
    from pallas_kernels.quantized_weights import KINDS

    kinds = {name: Q.format_by_name(name).scheme.kernel_kind for name in Q.FORMAT_NAMES}
    assert kinds == {"int8": "int8", "int4": "int4", "fp8_block": "fp8_block", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
    assert set(kinds.values()) == set(KINDS)
    assert Q.format_by_name("int4", group_size=None, symmetric=False).scheme.kernel_kind == "int4"


# -- the on-disk layouts against numpy written from the spec ----------------------------------------------------


def _numpy_dequant(t: dict, prefix: str, source: str, key: str, out: int, inn: int) -> np.ndarray:
    """w [out, in] float64 from one projection's checkpoint tensors, straight from docs/FORMATS.md."""
    name, options, _ = FORMATS[key]
    f64 = lambda a: np.asarray(a).astype(np.float64)
    if name in ("int8", "int4"):
        bits = int(name[3:])
        words = np.asarray(t[prefix + "weight_packed"]).astype(np.int64) & 0xFFFFFFFF
        per = 32 // bits
        q = np.zeros((out, words.shape[1] * per), np.int64)
        for j in range(q.shape[1]):
            q[:, j] = (words[:, j // per] >> (bits * (j % per))) & ((1 << bits) - 1)
        q = q[:, :inn] - (1 << (bits - 1))
        group = options["group_size"] or inn
        scale = np.repeat(f64(t[prefix + "weight_scale"]), group, axis=1)
        zp = 0
        if not options.get("symmetric", True):
            zw = np.asarray(t[prefix + "weight_zero_point"]).astype(np.int64) & 0xFFFFFFFF  # packed along out
            z = np.zeros((zw.shape[0] * per, zw.shape[1]), np.int64)
            for i in range(z.shape[0]):
                z[i] = (zw[i // per] >> (bits * (i % per))) & ((1 << bits) - 1)
            zp = np.repeat(z[:out] - (1 << (bits - 1)), group, axis=1)
        return (q - zp) * scale
    if name == "fp8_block":
        s = f64(t[prefix + ("weight_scale_inv" if source == "deepseek" else "weight_scale")])
        q = f64(np.asarray(t[prefix + "weight"]).view(ml_dtypes.float8_e4m3fn))
        i, j = np.meshgrid(np.arange(out), np.arange(inn), indexing="ij")
        return q * s[i // 128, j // 128]
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    byte = np.asarray(t[prefix + ("weight" if source == "modelopt" else "weight_packed")]).view(np.uint8)
    nib = np.zeros((out, inn), np.int64)
    nib[:, 0::2], nib[:, 1::2] = byte & 15, byte >> 4
    fp4 = np.where(nib & 8, -1.0, 1.0) * np.array(table)[nib & 7]
    if name == "mxfp4":
        return fp4 * 2.0 ** (np.repeat(np.asarray(t[prefix + "weight_scale"]).astype(np.int64), 32, axis=1) - 127)
    s = np.repeat(f64(np.asarray(t[prefix + "weight_scale"]).view(ml_dtypes.float8_e4m3fn)), 16, axis=1)
    if source == "modelopt":
        return fp4 * s * f64(t[prefix + "weight_scale_2"])
    return fp4 * s / f64(t[prefix + "weight_global_scale"])[0]


def _gpt_oss_dequant(t: dict, fused: str, e: int) -> np.ndarray:
    blocks, scales = np.asarray(t[fused + "_blocks"][e]), np.asarray(t[fused + "_scales"][e]).astype(np.int64)
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    vals = np.stack([table[blocks & 15], table[blocks >> 4]], axis=-1).reshape(*blocks.shape[:2], 32)
    return (vals * 2.0 ** (scales[..., None] - 127)).reshape(blocks.shape[0], -1)  # [out, in]


CASES = [(key, source) for key, (_, _, sources) in FORMATS.items() for source in sources]


@pytest.mark.parametrize(("key", "source"), CASES)
def test_layout_round_trip_and_numpy_dequantizer(key, source):
    family = "gpt_oss" if source == "gpt-oss" else "qwen3_moe"
    cfg, _, qparams = _quantized(key, family)
    quant = QC.HfQuant(Q.format_of(qparams.experts), source)
    tensors = ET.format_to_hf_tensors(qparams.experts, quant)
    back = ET.format_from_hf_tensors(tensors, cfg, quant, layout="stacked")
    for name, value in qparams.experts.fields().items():  # bit-exact round trip
        if name.endswith("scale2") and source == "compressed-tensors":  # stored as its reciprocal: 1 ulp
            np.testing.assert_allclose(getattr(back, name), value, rtol=2**-23)
            continue
        np.testing.assert_array_equal(np.asarray(getattr(back, name)).view(np.uint8), np.asarray(value).view(np.uint8))
    dense = Q.dequantize(back)
    H, I = cfg.hidden_size, cfg.intermediate_size
    for e in (0, cfg.num_experts - 1):
        for p, name, (out, inn) in (
            ("gate", "gate_proj", (I, H)),
            ("up", "up_proj", (I, H)),
            ("down", "down_proj", (H, I)),
        ):
            if source == "gpt-oss":
                fused = "experts.down_proj" if p == "down" else "experts.gate_up_proj"
                w = _gpt_oss_dequant(tensors, fused, e)
                w = w if p == "down" else w[(p == "up") :: 2]
            else:
                w = _numpy_dequant(tensors, f"experts.{e}.{name}.", source, key, out, inn)
            np.testing.assert_allclose(np.asarray(getattr(dense, p)[e]).T, w, rtol=1e-6, atol=1e-30)
    if source == "gpt-oss":
        np.testing.assert_array_equal(tensors["experts.gate_up_proj_bias"][:, 1::2], np.asarray(back.up_bias))


def test_quantize_error_is_small_and_dequantize_keeps_layout():
    for key, tol in (("int8", 0.01), ("fp8_block", 0.07), ("int4", 0.15), ("nvfp4", 0.15), ("mxfp4", 0.25)):
        _, dense, qparams = _quantized(key)
        w, wq = np.asarray(dense.experts.down), np.asarray(Q.dequantize(qparams).experts.down)
        assert np.abs(wq - w).max() <= tol * np.abs(w).max(), key
    per_expert = with_experts_layout(qparams, "per_expert")
    assert isinstance(Q.dequantize(per_expert).experts, moejax.weights.PerExpert)


# -- plans, EP and the module against dequantize-then-reference -------------------------------------------------

forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))
IMPL_LAYOUTS = [
    ("reference", "stacked"),
    ("xla_decode", "stacked"),
    ("xla_grouped", "stacked"),
    ("cpu_decode", "per_expert"),
    ("cpu_grouped", "per_expert"),
    ("auto", "per_expert"),
    ("auto", "stacked"),
]


@settings(max_examples=8)
@given(
    key=st.sampled_from(list(FORMATS)),
    impl_layout=st.sampled_from(IMPL_LAYOUTS),
    T=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
)
def test_every_plan_equals_dequantize_then_reference(key, impl_layout, T, seed, bf16):
    impl, layout = impl_layout
    cfg = _quantized(key)[0]
    if impl in ("xla_grouped", "cpu_grouped"):
        T = 9 + T  # grouped plans: prefill sizes
    x = jax.random.normal(jax.random.key(seed), (T, cfg.hidden_size))
    x = x.astype(jnp.bfloat16) if bf16 else x
    want = forward(_dequantized(key), x, cfg, None, "reference")
    got = forward(_in_layout(key, layout), x, cfg, None, impl)
    tol = 2e-2 if bf16 else 2e-5  # output rounded to x's dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0.05


@pytest.mark.parametrize("impl", ["cpu_decode"])
def test_biased_gpt_oss_experts_in_mxfp4(impl):
    cfg, _, qparams = _quantized("mxfp4", "gpt_oss")
    assert qparams.experts.gate_bias is not None
    T = 12 if impl == "xla_grouped" else 3
    x = jax.random.normal(jax.random.key(3), (T, cfg.hidden_size))
    want = forward(_dequantized("mxfp4", "gpt_oss"), x, cfg, None, "reference")
    layout = "per_expert" if impl.startswith("cpu") else "stacked"
    np.testing.assert_allclose(forward(_in_layout("mxfp4", layout, "gpt_oss"), x, cfg, None, impl), want, atol=2e-5)


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_quantized_experts_under_expert_parallelism(mode):
    cfg = moejax.MoEConfig.preset("deepseek_v3", hidden_size=64, intermediate_size=64, num_experts=16)
    dense = moejax.init_params(cfg, jax.random.key(0), layout="stacked")
    qparams = moejax.quantize(dense, cfg, "int4", group_size=16, symmetric=False)
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = sharding.shard_params(qparams, cfg, mesh, tensor_axis="tensor")
    spec = sharded.experts.down_scale.sharding.spec  # scales shard with their experts (and I with the tensor axis)
    assert spec[0] == "expert" and spec[1] == "tensor"
    x = jax.random.normal(jax.random.key(1), (12, cfg.hidden_size))
    ep = jax.jit(
        lambda p, x: parallel.moe_forward_ep(p, x, cfg, mesh=mesh, mode=mode, tensor_axis="tensor", impl="xla"),
    )
    want = forward(jax.jit(Q.dequantize)(qparams), x, cfg, None, "reference")
    np.testing.assert_allclose(ep(sharded, x), want, rtol=2e-5, atol=2e-5)


def test_nnx_module_holds_quantized_params():
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=8, **SIZES)
    fmt = Q.format_by_name("nvfp4")
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), fmt=fmt, layout="stacked")
    assert layer.experts.gate_q[...].dtype == jnp.uint8
    assert layer.experts.gate_scale[...].dtype == jnp.float8_e4m3fn
    x = jax.random.normal(jax.random.key(1), (4, cfg.hidden_size))
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    want = forward(jax.jit(Q.dequantize)(layer.params), x, cfg, None, "reference")
    np.testing.assert_allclose(y, want, atol=2e-5)
    assert float(jnp.max(jnp.abs(want))) > 0.05


def test_params_stay_packed_in_memory():
    """Routed-expert bytes per format at Qwen3-30B-A3B sizes (shapes only) against the issue's targets."""
    cfg = load("model_layers").MODEL_LAYERS["qwen3-30b-a3b"]
    bf16 = 3 * cfg.num_experts * cfg.hidden_size * cfg.intermediate_size * 2
    for name, limit in (("int8", 0.55), ("fp8_block", 0.55), ("int4", 0.32), ("mxfp4", 0.32), ("nvfp4", 0.32)):
        shapes = jax.eval_shape(functools.partial(Q.format_by_name(name).init, cfg), jax.random.key(0))
        nbytes = sum(v.size * v.dtype.itemsize for v in shapes.fields().values())
        assert nbytes <= limit * bf16, (name, nbytes / bf16)
    shapes = jax.eval_shape(functools.partial(Q.format_by_name("int4", symmetric=False).init, cfg), jax.random.key(0))
    assert shapes.gate_q.shape == (128, 1024, 768) and shapes.gate_q.dtype == jnp.uint8
    assert sum(v.size * v.dtype.itemsize for v in shapes.fields().values()) <= 0.32 * bf16


# -- config and errors --------------------------------------------------------------------------------------------


def _ct(weights: dict, fmt: str = "pack-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": {"weights": weights}}}


def test_format_from_config():
    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
    assert QC.format_from_config(_ct(w4)).fmt is Q.format_by_name("int4", group_size=128)
    w8 = {**w4, "num_bits": 8, "symmetric": False}
    assert QC.format_from_config(_ct(w8)).fmt is Q.format_by_name("int8", group_size=128, symmetric=False)
    fp8 = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
    assert QC.format_from_config(_ct(fp8, "float-quantized")) == QC.HfQuant(
        Q.format_by_name("fp8_block"), "compressed-tensors"
    )
    nv = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    assert QC.format_from_config(_ct(nv, "nvfp4-pack-quantized")).fmt is Q.format_by_name("nvfp4")
    mx = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
    assert QC.format_from_config(_ct(mx, "mxfp4-pack-quantized")).fmt is Q.format_by_name("mxfp4")
    ds = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert QC.format_from_config(ds).source == "deepseek"
    assert QC.format_from_config({"quant_method": "mxfp4", "modules_to_not_convert": []}).source == "gpt-oss"
    modelopt = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}}
    assert QC.format_from_config(None, modelopt) == QC.HfQuant(Q.format_by_name("nvfp4"), "modelopt")
    assert QC.format_from_config({"quant_method": "modelopt", "quant_algo": "NVFP4"}).source == "modelopt"
    assert QC.format_from_config(None) is None


def test_errors_name_the_key():
    with pytest.raises(ValueError, match="quant_method='awq' is not one of"):
        QC.format_from_config({"quant_method": "awq"})
    with pytest.raises(ValueError, match="group_size=None"):
        QC.format_from_config(_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": None}))
    cfg, dense, _ = _quantized("int4")
    with pytest.raises(ValueError, match=r"group size 80 does not divide in=96 of experts\.down"):
        moejax.quantize(dense, cfg, "int4", group_size=80)
    with pytest.raises(ValueError, match="format 'int3' is not one of"):
        moejax.quantize(dense, cfg, "int3")

    def tensors_of(key, source):
        cfg, _, qparams = _quantized(key)
        quant = QC.HfQuant(Q.format_of(qparams.experts), source)
        return cfg, quant, dict(ET.format_to_hf_tensors(qparams.experts, quant))

    cfg, quant, t = tensors_of("int4_asym", "compressed-tensors")
    del t["experts.3.up_proj.weight_zero_point"]
    with pytest.raises(ValueError, match=r"missing tensor 'experts.3.up_proj.weight_zero_point' \(asymmetric"):
        ET.format_from_hf_tensors(t, cfg, quant)
    cfg, quant, t = tensors_of("int4", "compressed-tensors")
    t["experts.0.gate_proj.weight_scale"] = t["experts.0.gate_proj.weight_scale"][:, :-1]
    with pytest.raises(ValueError, match=r"experts.0.gate_proj.weight_scale: scale grid \(96, 9\) does not match"):
        ET.format_from_hf_tensors(t, cfg, quant)
    cfg, quant, t = tensors_of("fp8_block", "deepseek")
    t["experts.2.down_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv: scale grid \(1, 1\) does not match .* \(2, 1\)"):
        ET.format_from_hf_tensors(t, cfg, quant)
    cfg, quant, t = tensors_of("nvfp4", "compressed-tensors")
    del t["experts.1.down_proj.weight_global_scale"]
    with pytest.raises(ValueError, match=r"missing tensor 'experts\.1\.down_proj\.weight_global_scale'"):
        ET.format_from_hf_tensors(t, cfg, quant)
    cfg, quant, t = tensors_of("nvfp4", "modelopt")
    del t["experts.1.gate_proj.weight_scale_2"]
    with pytest.raises(ValueError, match=r"missing tensor 'experts\.1\.gate_proj\.weight_scale_2'"):
        ET.format_from_hf_tensors(t, cfg, quant)
    cfg, quant, t = tensors_of("int8", "compressed-tensors")
    t["experts.0.up_proj.weight_packed"] = t["experts.0.up_proj.weight_packed"][:, 1:]
    with pytest.raises(ValueError, match=r"experts.0.up_proj.weight_packed: expected shape \(96, 40\), got \(96, 39\)"):
        ET.format_from_hf_tensors(t, cfg, quant)
    bad = dataclasses.replace(_quantized("int8")[2].experts, up_scale=jnp.zeros((8, 3, 96), jnp.float32))
    with pytest.raises(ValueError, match=r"params.experts.up_scale: expected shape \(8, 10, 96\)"):
        moejax.weights.check_experts(bad, cfg)


@pytest.mark.parametrize("key", ["int8", "int4_asym", "mxfp4", "nvfp4"])
def test_qwix_qarray_round_trip(key):
    """qwix is optional (not a dependency): skipped where it is not installed."""
    qarray = pytest.importorskip("qwix._src.core.qarray")
    _, _, qparams = _quantized(key)
    qarrays = Q.to_qwix(qparams.experts)
    want = _dequantized(key).experts
    for p in ("gate", "up", "down"):
        np.testing.assert_allclose(qarray.dequantize(qarrays[p]), getattr(want, p), rtol=1e-6)
    if key == "nvfp4":
        with pytest.raises(NotImplementedError, match="two scales"):
            Q.from_qwix(qarrays, Q.format_of(qparams.experts))
        return
    back = Q.from_qwix(qarrays, Q.format_of(qparams.experts))
    for name, value in qparams.experts.fields().items():
        np.testing.assert_array_equal(np.asarray(getattr(back, name)).view(np.uint8), np.asarray(value).view(np.uint8))


@functools.cache
def _non_finite_params():
    """Dense params with a NaN in expert 2's up projection, and (per-expert layout) -inf and inf in expert 0's down."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=4, **SIZES)
    dense = numpy_params(cfg, 0)  # no random-number program to compile
    experts = jax.tree.map(np.array, dense.experts)
    up, down = experts.up.copy(), experts.down.copy()
    up[2, 3, 5] = np.nan
    down[0, 1, 0], down[0, 2, 7] = -np.inf, np.inf
    nan_up = dataclasses.replace(dense, experts=dataclasses.replace(experts, up=up))
    inf_down = dataclasses.replace(dense, experts=dataclasses.replace(experts, down=down))
    return cfg, nan_up, with_experts_layout(inf_down, "per_expert")


@pytest.mark.parametrize("key", ["int8", "int4_asym", "fp8_block", "mxfp4", "nvfp4"])
def test_quantize_refuses_non_finite_weights(key):
    """A NaN must not become finite codes (zeroing its group): the dense forward gives NaN."""
    name, options, _ = FORMATS[key]
    cfg, nan_up, inf_down = _non_finite_params()
    with pytest.raises(
        ValueError, match=r"quantize: expert 2 up \[160, 96\] has 1 non-finite values \(first w\[3, 5\]"
    ):
        moejax.quantize(nan_up, cfg, name, **options)
    with pytest.raises(ValueError, match=r"expert 0 down \[96, 160\] has 2 non-finite values \(first w\[1, 0\] = -inf"):
        moejax.quantize(inf_down, cfg, name, **options)
