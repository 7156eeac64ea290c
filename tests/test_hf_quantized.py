"""`moejax.hf.load_layer` / `load_layers` / `save_layer` on quantized checkpoints written here in each on-disk
layout of docs/FORMATS.md (DeepSeek-V3 FP8 with shared experts, compressed-tensors W4A16 / W4A16_ASYM / W8A16 /
FP8_BLOCK / NVFP4A16 / MXFP4A16, gpt-oss MXFP4, ModelOpt NVFP4 with hf_quant_config.json), sharded over three files
with an index. H = 160 and I = 96 are not multiples of 128: partial FP8 blocks.

The expert tensors are written with `moejax.hf.expert_tensors.format_to_hf_tensors` (checked against numpy
dequantizers from the spec in tests/test_quantized.py); the DeepSeek shared expert is checked here against its own numpy
dequantizer."""

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import moejax
from moejax import hf
from moejax import quantized as Q
from moejax.hf import expert_tensors as ET
from moejax.hf import quant_config as QC
from moejax.hf import quant_tensors as QT

H, I, E, K = 160, 96, 4, 2
N_LAYERS = 2
forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


def _ct(weights: dict, fmt: str, ignore=("lm_head", "re:.*mlp.gate$")) -> dict:
    group = {"weights": weights, "targets": ["Linear"], "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
    }


def _int(bits, symmetric=True, group=32):
    return {"num_bits": bits, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric}


_QWEN = {"model_type": "qwen3_moe", "num_local_experts": E, "moe_intermediate_size": I}
_DS = {
    "model_type": "deepseek_v3",
    "n_routed_experts": E,
    "moe_intermediate_size": I,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
}
_GPT_OSS = {"model_type": "gpt_oss", "num_local_experts": E, "intermediate_size": I}
_MIXTRAL = {"model_type": "mixtral", "num_local_experts": E, "intermediate_size": I}  # w1/w3/w2, block_sparse_moe.
_MODELOPT = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.mlp.gate"]}}

# name -> (config.json text fields, quantization_config or None, hf_quant_config.json or None,
#          moejax.quantize format and options, on-disk source)
CASES = {
    "deepseek_fp8": (
        _DS,
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        None,
        ("fp8_block", {}),
        "deepseek",
    ),
    "w4a16": (_QWEN, _ct(_int(4), "pack-quantized"), None, ("int4", {"group_size": 32}), "compressed-tensors"),
    "w4a16_asym": (
        _QWEN,
        _ct(_int(4, symmetric=False), "pack-quantized"),
        None,
        ("int4", {"group_size": 32, "symmetric": False}),
        "compressed-tensors",
    ),
    "w8a16": (_QWEN, _ct(_int(8), "pack-quantized"), None, ("int8", {"group_size": 32}), "compressed-tensors"),
    "fp8_block": (
        _QWEN,
        _ct({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}, "float-quantized"),
        None,
        ("fp8_block", {}),
        "compressed-tensors",
    ),
    "nvfp4a16": (
        _QWEN,
        _ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "nvfp4-pack-quantized"),
        None,
        ("nvfp4", {}),
        "compressed-tensors",
    ),
    "mxfp4a16": (
        _QWEN,
        _ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}, "mxfp4-pack-quantized"),
        None,
        ("mxfp4", {}),
        "compressed-tensors",
    ),
    "gpt_oss": (
        _GPT_OSS,
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]},
        None,
        ("mxfp4", {}),
        "gpt-oss",
    ),
    "modelopt_nvfp4": (_QWEN, None, _MODELOPT, ("nvfp4", {}), "modelopt"),
    "mixtral_w4a16": (
        _MIXTRAL,
        _ct(_int(4), "pack-quantized", ignore=("lm_head", "re:.*block_sparse_moe.gate$")),
        None,
        ("int4", {"group_size": 32}),
        "compressed-tensors",
    ),
}
_W1_W3_W2 = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _prefix(name: str, layer: int) -> str:
    module = "block_sparse_moe" if CASES[name][0] is _MIXTRAL else "mlp"
    return f"model.layers.{layer}.{module}."


def _config(name: str) -> dict:
    text, qc, _, _, _ = CASES[name]
    config = {**text, "hidden_size": H, "num_hidden_layers": N_LAYERS, "num_experts_per_tok": K}
    return json.loads(json.dumps(config | ({"quantization_config": qc} if qc is not None else {})))  # a copy


def _deepseek_shared(rng, layer_prefix: str) -> tuple[dict, dict]:
    """DeepSeek-V3's FP8 shared expert (width I): (disk tensors, numpy float64 dequantized [out, in])."""
    scheme = Q.quantized_format("fp8_block").scheme
    tensors, dense = {}, {}
    for name, (out, inn) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        w = (rng.standard_normal((inn, out)) / np.sqrt(inn)).astype(np.float32)
        fields = Q.quantize_projection(w, scheme)
        disk = QT.projection_to_hf(fields, f"shared_experts.{name}.", scheme, "deepseek")
        tensors |= {layer_prefix + k: v for k, v in disk.items()}
        q = disk[f"shared_experts.{name}.weight"].astype(np.float64)  # [out, in]
        s = disk[f"shared_experts.{name}.weight_scale_inv"].astype(np.float64)
        o, j = np.meshgrid(np.arange(out), np.arange(inn), indexing="ij")
        dense[name] = q * s[o // 128, j // 128]
    return tensors, dense


def write_checkpoint(path, name, *, mutate=None, shards=3, seed=0):
    """The checkpoint of case `name`; returns {layer: (cfg, quantized params as written, shared dense [out, in])}."""
    text, _, hqc, (fmt_name, options), source = CASES[name]
    config = _config(name)
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((10, H)).astype(ml_dtypes.bfloat16)}
    written = {}
    for layer in range(N_LAYERS):
        cfg = hf.config_from_hf(config, layer)
        dense = moejax.init_params(cfg, jax.random.key(seed + layer), layout="stacked")
        qparams = moejax.quantize(dense, cfg, fmt_name, **options)
        quant = QC.HfQuant(Q.format_of(qparams.experts), source)
        prefix = _prefix(name, layer)
        block = {k: np.asarray(v) for k, v in ET.format_to_hf_tensors(qparams.experts, quant).items()}
        if text is _MIXTRAL:
            block = {re.sub(r"\.(\w+_proj)\.", lambda m: f".{_W1_W3_W2[m[1]]}.", k): v for k, v in block.items()}
        router = np.asarray(dense.router.kernel).T.astype(ml_dtypes.bfloat16)
        shared = None
        if text is _GPT_OSS:
            block |= {"router.weight": router, "router.bias": np.asarray(dense.router.bias, ml_dtypes.bfloat16)}
        else:
            block["gate.weight"] = router
        if text is _DS:
            block["gate.e_score_correction_bias"] = rng.standard_normal(E).astype(np.float32)
            shared_tensors, shared = _deepseek_shared(rng, "")
            block |= shared_tensors
        if source == "modelopt":  # activation scales: weight-only, left unread
            for e in range(E):
                block |= {f"experts.{e}.{p}.input_scale": np.float32(1.5) for p in ("gate_proj", "up_proj")}
        tensors |= {prefix + k: np.asarray(v) for k, v in block.items()}
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = np.ones(H, ml_dtypes.bfloat16)
        written[layer] = (cfg, qparams, shared)
    if mutate is not None:
        mutate(tensors)
    names = sorted(tensors)
    size = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * size : (i + 1) * size]
        save_file({k: np.ascontiguousarray(tensors[k]) for k in part}, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    if hqc is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hqc))
    return written


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _assert_experts_equal(got, want, source):
    assert type(got) is type(want)
    for field, value in want.fields().items():
        if field.endswith("scale2") and source == "compressed-tensors":  # stored as its reciprocal: 1 ulp
            np.testing.assert_allclose(getattr(got, field), value, rtol=2**-23)
        else:
            np.testing.assert_array_equal(_bits(getattr(got, field)), _bits(value), err_msg=field)


def _assert_params_identical(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(_bits(a), _bits(b)), got, want)


# -- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_load_layer_keeps_experts_quantized(tmp_path, name):
    written = write_checkpoint(tmp_path, name)
    source = CASES[name][4]
    cfg, params = hf.load_layer(tmp_path, 1, layout="stacked")
    want_cfg, want, shared = written[1]
    assert cfg == want_cfg
    experts = params.experts
    assert isinstance(experts, Q.QuantizedExperts) and experts.scheme == want.experts.scheme
    packed = jnp.float8_e4m3fn if CASES[name][3][0] == "fp8_block" else jnp.uint8  # int codes: unsigned, as on disk
    assert experts.gate_q.dtype == packed and experts.down_q.dtype == packed
    _assert_experts_equal(experts, want.experts, source)
    assert params.router.kernel.dtype == jnp.bfloat16  # the router stays dense
    np.testing.assert_array_equal(params.router.kernel, want.router.kernel.astype(jnp.bfloat16))
    if shared is not None:  # DeepSeek's FP8 shared expert: dequantized exactly, float32, [in, out]
        for p, n in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            got = getattr(params.shared, p)
            assert got.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(got, np.float64), shared[n].T)
    x = jax.random.normal(jax.random.key(1), (3, H))
    y = forward(params, x, cfg, None, "auto")
    ref = forward(moejax.dequantize(params), x, cfg, None, "reference")
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)
    assert float(jnp.max(jnp.abs(ref))) > 0.05


def test_load_layers_and_default_layout(tmp_path):
    write_checkpoint(tmp_path, "w4a16_asym")
    layers = hf.load_layers(tmp_path, layout="stacked")
    assert list(layers) == list(range(N_LAYERS))
    for layer, (cfg, params) in layers.items():
        _, one = hf.load_layer(tmp_path, layer, layout="stacked")
        assert cfg == hf.config_from_hf(_config("w4a16_asym"), layer)
        _assert_params_identical(params, one)
    _, per_expert = hf.load_layer(tmp_path, 0)  # CPU default: per-expert, still quantized
    assert isinstance(per_expert.experts, moejax.weights.PerExpert)
    assert Q.format_of(per_expert.experts).scheme.kind == "int"


def test_dtype_casts_float_tensors_never_codes_or_scales(tmp_path):
    write_checkpoint(tmp_path, "deepseek_fp8")
    _, params = hf.load_layer(tmp_path, 1, layout="stacked")
    _, cast = hf.load_layer(tmp_path, 1, layout="stacked", dtype=jnp.bfloat16)
    _assert_params_identical(cast.experts, params.experts)  # float32 weight_scale_inv not rounded to bfloat16
    assert cast.shared.gate.dtype == jnp.bfloat16
    np.testing.assert_array_equal(cast.shared.down, params.shared.down.astype(jnp.bfloat16))
    assert cast.router.correction_bias.dtype == jnp.float32


def test_gpt_oss_mxfp4_dense_weights_through_dequantize(tmp_path):
    written = write_checkpoint(tmp_path, "gpt_oss")
    _, params = hf.load_layer(tmp_path, 0, layout="stacked")
    _, cast = hf.load_layer(tmp_path, 0, layout="stacked", dtype=jnp.bfloat16)
    assert cast.experts.gate_bias.dtype == jnp.bfloat16  # biases are ordinary tensors: dtype= casts them
    np.testing.assert_array_equal(cast.experts.gate_scale, params.experts.gate_scale)  # e8m0 scales: never
    dense = moejax.dequantize(params).experts
    want = moejax.dequantize(written[0][1]).experts
    np.testing.assert_array_equal(dense.gate, want.gate)
    np.testing.assert_array_equal(dense.down, want.down)


def test_ignored_experts_stay_dense(tmp_path):
    """A compressed-tensors config whose ignore list names layer 0's experts: that block is read dense."""
    config = _config("w8a16")
    config["quantization_config"]["ignore"].append("re:model\\.layers\\.0\\.mlp\\.experts\\..*")
    rng = np.random.default_rng(0)
    dense = {"model.layers.0.mlp.gate.weight": rng.standard_normal((E, H)).astype(np.float32)}
    for e in range(E):
        for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            dense[f"model.layers.0.mlp.experts.{e}.{n}.weight"] = rng.standard_normal(shape).astype(np.float32)
    save_file(dense, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, params = hf.load_layer(tmp_path, 0, layout="stacked")
    assert isinstance(params.experts, moejax.weights.ExpertWeights)
    np.testing.assert_array_equal(params.experts.down[2], dense["model.layers.0.mlp.experts.2.down_proj.weight"].T)


# -- saving ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_save_round_trip_is_exact(tmp_path, name):
    write_checkpoint(tmp_path, name)
    before = hf.files.weight_map(tmp_path)
    original = {}
    for path in set(before.values()):
        original |= hf.files.read_file(path, [k for k, f in before.items() if f == path])
    _, params = hf.load_layer(tmp_path, 1, layout="stacked")
    shard = hf.save_layer(tmp_path, 1, params)
    written = hf.files.read_file(shard, hf.files.weight_map(shard))
    expert_keys = [k for k in written if k.startswith(_prefix(name, 1) + "experts.")]
    assert expert_keys and all(k in original for k in expert_keys)
    for key in expert_keys:  # the routed experts in the checkpoint's own on-disk layout, bit for bit
        if key.endswith("weight_global_scale"):  # the reciprocal of the in-memory multiplier: 1 ulp
            np.testing.assert_allclose(written[key], original[key], rtol=2**-23)
        else:
            np.testing.assert_array_equal(_bits(written[key]), _bits(original[key]), err_msg=key)
    _, again = hf.load_layer(tmp_path, 1, layout="stacked")
    _assert_params_identical(again, params)
    _, other = hf.load_layer(tmp_path, 0, layout="stacked")  # layer 0 untouched, still quantized
    assert isinstance(other.experts, Q.QuantizedExperts)


def test_saved_shared_expert_is_dense_and_ignored_by_the_config(tmp_path):
    write_checkpoint(tmp_path, "deepseek_fp8")
    _, params = hf.load_layer(tmp_path, 1, layout="stacked")
    shard = hf.save_layer(tmp_path, 1, params)
    written = hf.files.read_file(shard, hf.files.weight_map(shard))
    assert written["model.layers.1.mlp.shared_experts.gate_proj.weight"].dtype == np.float32
    assert not any(k.startswith("model.layers.1.mlp.shared_experts.") and "scale" in k for k in written)
    ignored = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.mlp.shared_experts.down_proj" in ignored
    assert not any("experts.0" in m for m in ignored)


def test_save_quantized_params_into_a_dense_checkpoint_is_refused(tmp_path):
    written = write_checkpoint(tmp_path, "w4a16")
    config = _config("w4a16")
    del config["quantization_config"]
    with pytest.raises(ValueError, match=r"layer 1: params hold quantized experts \(Int4G32Sym\) but .* no quantiz"):
        hf.save_layer(tmp_path / "dst", 1, written[1][1], hf_config=config)
    shard = hf.save_layer(tmp_path / "dst2", 1, written[1][1], hf_config=_config("w4a16"))  # with one: written
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in hf.files.weight_map(shard)


def test_saving_params_in_another_format_names_both(tmp_path):
    written = write_checkpoint(tmp_path, "w8a16")
    int4 = moejax.quantize(moejax.dequantize(written[1][1]), written[1][0], "int4", group_size=32)
    with pytest.raises(ValueError, match=r"experts are Int4G32Sym, the checkpoint layout holds Int8G32Sym"):
        hf.save_layer(tmp_path, 1, int4)


# -- errors ------------------------------------------------------------------------------------------------------


def _drop(key):
    return lambda tensors: tensors.pop(key)


def test_scale_grid_not_matching_the_weight(tmp_path):
    key = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"

    def shrink(tensors):
        tensors[key] = tensors[key][:1]

    write_checkpoint(tmp_path, "deepseek_fp8", mutate=shrink)
    with pytest.raises(
        ValueError,
        match=r"layer 1 \(DeepseekV3ForCausalLM, prefix 'model\.layers\.1\.mlp\.'\): "
        r"experts\.2\.down_proj\.weight_scale_inv: scale grid \(1, 1\) does not match weight \[160, 96\]",
    ):
        hf.load_layer(tmp_path, 1)


def test_group_not_dividing_in(tmp_path):
    write_checkpoint(tmp_path, "w4a16")
    config = _config("w4a16")
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"group size 64 does not divide in=160 of experts\.0\.gate_proj\.weight"):
        hf.load_layer(tmp_path, 0)


def test_missing_zero_point(tmp_path):
    write_checkpoint(tmp_path, "w4a16_asym", mutate=_drop("model.layers.0.mlp.experts.3.up_proj.weight_zero_point"))
    with pytest.raises(ValueError, match=r"missing tensor 'experts\.3\.up_proj\.weight_zero_point' \(asymmetric"):
        hf.load_layer(tmp_path, 0)


@pytest.mark.parametrize(
    ("name", "key"),
    [("nvfp4a16", "experts.1.down_proj.weight_global_scale"), ("modelopt_nvfp4", "experts.1.gate_proj.weight_scale_2")],
)
def test_missing_global_scale(tmp_path, name, key):
    write_checkpoint(tmp_path, name, mutate=_drop(f"model.layers.0.mlp.{key}"))
    with pytest.raises(ValueError, match=rf"layer 0 .*missing tensor '{key}' \(NVFP4"):
        hf.load_layer(tmp_path, 0)


def test_unknown_quant_method(tmp_path):
    write_checkpoint(tmp_path, "w8a16")
    config = _config("w8a16") | {"quantization_config": {"quant_method": "awq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method='awq' is not one of"):
        hf.load_layer(tmp_path, 0)


def test_quantized_tensors_without_a_config(tmp_path):
    write_checkpoint(tmp_path, "deepseek_fp8")
    config = _config("deepseek_fp8")
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=r"layer 0 .*experts\.0\.down_proj\.weight_scale_inv"):
        hf.load_layer(tmp_path, 0)


def test_prefix_level_api_takes_the_quantization_config(tmp_path):
    written = write_checkpoint(tmp_path, "modelopt_nvfp4")
    cfg, want, _ = written[1]
    params = hf.load_safetensors(tmp_path, cfg, "model.layers.1.mlp.", layout="stacked", quantization_config=_MODELOPT)
    _assert_experts_equal(params.experts, want.experts, "modelopt")
    tensors = hf.layer_tensors(params, _config("modelopt_nvfp4"), 1, hf_quant_config=_MODELOPT)
    assert tensors["model.layers.1.mlp.experts.2.up_proj.weight"].dtype == np.uint8  # ModelOpt's packed e2m1
    relative = {k.removeprefix("model.layers.1.mlp."): v for k, v in tensors.items()}
    again = hf.params_from_hf(relative, cfg, layout="stacked", quantization_config=_MODELOPT)
    _assert_params_identical(again, params)


def test_dense_experts_saved_into_a_quantized_checkpoint_are_ignored_by_the_config(tmp_path):
    write_checkpoint(tmp_path, "w8a16")
    _, params = hf.load_layer(tmp_path, 1, layout="stacked")
    dense = moejax.dequantize(params)
    hf.save_layer(tmp_path, 1, dense)
    ignore = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.experts.3.down_proj" in ignore and "model.layers.1.mlp.gate" not in ignore
    _, again = hf.load_layer(tmp_path, 1, layout="stacked")
    _assert_params_identical(again, dense)
    _, other = hf.load_layer(tmp_path, 0, layout="stacked")
    assert isinstance(other.experts, Q.QuantizedExperts)


@pytest.mark.parametrize("name", ["w4a16_asym", "nvfp4a16", "mxfp4a16"])  # FP8: test_load_layer_keeps_experts_quantized
def test_host_dequantizer_of_a_shared_expert_equals_the_format(name):
    """`moejax.hf.quant_tensors.dequantize_projection` (numpy, for a quantized shared expert) against the format's own
    dequantization, bit for bit."""
    from moejax.hf.quant_tensors import dequantize_projection

    cfg = hf.config_from_hf(_config(name), 0)
    fmt_name, options = CASES[name][3]
    qparams = moejax.quantize(moejax.init_params(cfg, jax.random.key(2), layout="stacked"), cfg, fmt_name, **options)
    experts, dense = qparams.experts, moejax.dequantize(qparams).experts
    for p in ("gate", "down"):
        fields = {k: getattr(experts, f"{p}_{k}") for k in ("q", "scale", "zero", "scale2")}
        got = dequantize_projection({k: np.asarray(v)[1] for k, v in fields.items() if v is not None}, experts.scheme)
        np.testing.assert_array_equal(got, np.asarray(getattr(dense, p)[1]))
