"""Reading hostile files: corrupt safetensors headers, truncated shards, malformed JSON, index entries
pointing outside the checkpoint, absurd layer counts, and quantized checkpoints whose config or stored dtypes
contradict their tensors. Each is refused with a ValueError naming the file and the key or field, before any
tensor is decoded the wrong way. Checkpoints are written here with numpy and safetensors (headers by hand where
they must be invalid)."""

import builtins
import json
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from oracles import normal
from safetensors.numpy import save_file

import moejax
from moejax import hf
from moejax import quantized as Q
from moejax.hf import expert_tensors as ET
from moejax.hf import quant_config as QC

H, I, E, K = 8, 4, 4, 2
QH, QI = 32, 32  # quantized cases: multiples of the int4 / NVFP4 groups


def _qwen_config(**fields):
    config = {"model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": 2, "num_experts_per_tok": K}
    return config | {"num_local_experts": E, "moe_intermediate_size": I} | fields


def _dense_block(rng, layer):
    prefix = f"model.layers.{layer}.mlp."
    block = {prefix + "gate.weight": normal(rng, E, H)}
    for e in range(E):
        block[f"{prefix}experts.{e}.gate_proj.weight"] = normal(rng, I, H)
        block[f"{prefix}experts.{e}.up_proj.weight"] = normal(rng, I, H)
        block[f"{prefix}experts.{e}.down_proj.weight"] = normal(rng, H, I)
    return block


def _dense_checkpoint(path, **config):
    """A two-layer Qwen3-MoE checkpoint over two shards with an index; every layer MoE."""
    rng = np.random.default_rng(0)
    weight_map = {}
    for layer in range(2):
        file = f"model-{layer + 1:05d}-of-00002.safetensors"
        block = _dense_block(rng, layer)
        save_file(block, str(path / file))
        weight_map |= dict.fromkeys(block, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(_qwen_config(**config)))
    return weight_map


def _raw_file(path, head, data=b"", length=None):
    """A file laid out as safetensors: 8-byte little-endian header length, the header (a dict as JSON, or raw
    bytes), the data area."""
    text = head if isinstance(head, bytes) else json.dumps(head).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


def _f32(shape, begin, end):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


# -- safetensors headers ---------------------------------------------------------------------------------------

# name -> (header, data bytes, the key the message names, a phrase of the message)
_BAD_HEADERS = {
    "offsets into another tensor": ({"a": _f32([2], 0, 8), "b": _f32([2], 0, 8)}, bytes(8), "b", "overlaps"),
    "gap between tensors": ({"a": _f32([2], 0, 8), "b": _f32([2], 12, 20)}, bytes(20), "b", "gap"),
    "begin after end": ({"a": _f32([0], 8, 0)}, bytes(8), "a", "begin after they end"),
    "offsets past the end": ({"a": _f32([2], 0, 8), "b": _f32([4], 8, 24)}, bytes(8), "b", "ends at byte 24"),
    "bytes not matching shape": ({"a": _f32([2, 2], 0, 12)}, bytes(12), "a", "needs 16"),
    "unknown dtype": ({"a": {"dtype": "F13", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "a", "unknown dtype"),
    "negative shape": ({"a": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}, bytes(2), "a", "shape"),
    "entry not an object": ({"a": [0, 8]}, bytes(8), "a", "expected an object"),
    "bytes after the last tensor": ({"a": _f32([2], 0, 8)}, bytes(12), "", "after its last tensor"),
    "header not an object": ([1, 2], b"", "", "expected an object"),
    "header not UTF-8": (b'{"a\xff": 1}', b"", "", "not UTF-8"),
    "header not JSON": (b'{"a": {', b"", "", "not valid JSON"),
}


@pytest.mark.parametrize("case", _BAD_HEADERS)
def test_a_corrupt_header_names_the_file_and_the_key(tmp_path, case):
    """Validated as the safetensors library does (it refuses each of these files) before any byte is decoded."""
    head, data, key, phrase = _BAD_HEADERS[case]
    path = _raw_file(tmp_path / "model.safetensors", head, data)
    match = f"{path}.*{key and repr(key)}.*{phrase}" if key else f"{path}.*{phrase}"
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        hf.files.read_file(str(path), [key or "a"])


def test_a_huge_header_length_is_refused_without_allocating(tmp_path):
    path = _raw_file(tmp_path / "model.safetensors", {"a": _f32([2], 0, 8)}, bytes(8), length=2**62)
    with pytest.raises(ValueError, match=rf"{path}: header length {2**62} exceeds the safetensors limit"):
        hf.files.weight_map(str(path))
    short = _raw_file(tmp_path / "short.safetensors", b"{}", length=1000)  # a header running past the file
    with pytest.raises(ValueError, match=rf"{short} is truncated: its header needs 1008 bytes"):
        hf.files.weight_map(str(short))


def test_a_truncated_shard_says_truncated(tmp_path):
    _dense_checkpoint(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-127])
    with pytest.raises(ValueError, match=rf"{shard} is truncated or corrupt: tensor 'model\.layers\.1\.mlp\..*"):
        hf.load_layer(tmp_path, 1)
    hf.load_layer(tmp_path, 0)  # the intact shard still loads


# -- JSON files --------------------------------------------------------------------------------------------------

_BAD_JSON = {"not JSON": b'{"model_type": "qwen3_moe",', "not UTF-8": b'{"model_type": "qwen3\xff"}', "a list": b"[]"}


@pytest.mark.parametrize("content", _BAD_JSON)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "hf_quant_config.json"])
def test_malformed_json_names_the_file(tmp_path, name, content):
    _dense_checkpoint(tmp_path)
    (tmp_path / name).write_bytes(_BAD_JSON[content])
    with pytest.raises(ValueError, match=rf"{tmp_path / name} (is not|holds a JSON list)"):
        hf.load_layer(tmp_path, 0)


def test_an_index_without_a_weight_map(tmp_path):
    _dense_checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=rf"safetensors index {index} has no 'weight_map' object"):
        hf.load_layer(tmp_path, 0)


@pytest.mark.parametrize("entry", ["/etc/passwd", "../elsewhere/model.safetensors", "sub/../../x.safetensors", 5])
def test_index_entries_outside_the_directory_are_refused_unopened(tmp_path, monkeypatch, entry):
    """Resolved and refused before any file is opened: a valid shard outside the checkpoint is not read either."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    weight_map = _dense_checkpoint(checkpoint)
    (tmp_path / "elsewhere").mkdir()
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    shutil.copy(checkpoint / weight_map[key], tmp_path / "elsewhere" / "model.safetensors")  # a valid shard
    weight_map[key] = entry
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    opened, real_open = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opened.append(str(file)) or real_open(file, *a, **k))
    with pytest.raises(ValueError, match=rf"{index}: entry '{key}' (->|maps to) {entry!r}"):
        hf.load_layer(checkpoint, 0)
    assert not any(f == "/etc/passwd" or f.startswith(str(tmp_path / "elsewhere")) for f in opened)


def test_an_index_naming_a_missing_shard(tmp_path):
    """Loading the layer, or saving another one (which would keep the entry), names the index and the file, and
    the save writes nothing; the layers whose shards are there still load."""
    _dense_checkpoint(tmp_path)
    _, params = hf.load_layer(tmp_path, 0)
    missing = "model-00002-of-00002.safetensors"
    os.unlink(tmp_path / missing)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=rf"layer 1: the index maps .* to {missing}, which is missing from {tmp_path}"):
        hf.load_layer(tmp_path, 1)
    index = tmp_path / "model.safetensors.index.json"
    with pytest.raises(ValueError, match=rf"{index}: the index maps .* to {missing}, which is missing from {tmp_path}"):
        hf.save_layer(tmp_path, 0, params)
    assert sorted(set(os.listdir(tmp_path)) - {".moejax.lock"}) == before
    assert hf.load_layer(tmp_path, 0)[1].router.kernel.shape == (H, E)


def test_a_symlinked_shard_inside_the_directory_still_loads(tmp_path):
    """A Hugging Face cache snapshot links each shard to a blob outside the snapshot directory: allowed."""
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    weight_map = _dense_checkpoint(snapshot)
    (tmp_path / "blobs").mkdir()
    for file in set(weight_map.values()):
        os.replace(snapshot / file, tmp_path / "blobs" / file)
        os.symlink(os.path.join("..", "..", "blobs", file), snapshot / file)
    _, params = hf.load_layer(snapshot, 1)
    assert params.router.kernel.shape == (H, E)


# -- layer counts ----------------------------------------------------------------------------------------------


def test_load_layers_checks_the_layer_count_before_allocating(tmp_path):
    _dense_checkpoint(tmp_path, num_hidden_layers=10**9)
    with pytest.raises(ValueError, match=r"config.json: num_hidden_layers=1000000000, but the weights hold .* 0\.\.1"):
        hf.load_layers(tmp_path)
    assert list(hf.load_layers(tmp_path, [1])) == [1]  # explicit layers are read as before


# -- quantized checkpoints -------------------------------------------------------------------------------------


def _ct(weights, fmt, targets=("Linear",)):
    group = {"weights": weights, "targets": list(targets), "input_activations": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, "ignore": []}


def _int4(symmetric):
    return {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": symmetric}


_FP8 = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
_MODELOPT = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.mlp.gate"]}}
# name -> (moejax.quantize format and options, on-disk source, quantization_config or None)
_QUANTIZED = {
    "int4_asym": (
        ("int4", {"group_size": 16, "symmetric": False}),
        "compressed-tensors",
        _ct(_int4(False), "pack-quantized"),
    ),
    "int4_sym": (("int4", {"group_size": 16}), "compressed-tensors", _ct(_int4(True), "pack-quantized")),
    "fp8": (("fp8_block", {}), "compressed-tensors", _ct(_FP8, "float-quantized")),
    "nvfp4": (("nvfp4", {}), "modelopt", None),
}


@pytest.fixture(scope="module")
def dense_params():
    config = _qwen_config(hidden_size=QH, moe_intermediate_size=QI, num_hidden_layers=1)
    cfg = hf.config_from_hf(config, 0)
    return config, cfg, moejax.init_params(cfg, jax.random.key(0), layout="stacked")


def _quantized_checkpoint(path, dense_params, name, mutate=None, qc=None):
    """One MoE layer in `name`'s on-disk layout (single file); `mutate` edits the block's tensors (keys relative
    to the block) before they are written; `qc` replaces the quantization_config."""
    config, cfg, dense = dense_params
    (fmt, options), source, default_qc = _QUANTIZED[name]
    qparams = moejax.quantize(dense, cfg, fmt, **options)
    block = dict(ET.format_to_hf_tensors(qparams.experts, QC.HfQuant(Q.format_of(qparams.experts), source)))
    block["gate.weight"] = np.asarray(dense.router.kernel).T
    if mutate is not None:
        mutate(block)
    save_file(
        {f"model.layers.0.mlp.{k}": np.ascontiguousarray(v) for k, v in block.items()}, str(path / "m.safetensors")
    )
    qc = default_qc if qc is None else qc
    (path / "config.json").write_text(json.dumps(config | ({"quantization_config": qc} if qc else {})))
    if source == "modelopt":
        (path / "hf_quant_config.json").write_text(json.dumps(_MODELOPT))
    return qparams


def test_symmetric_must_be_a_bool(tmp_path, dense_params):
    qc = _ct(_int4(False), "pack-quantized")
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = "false"  # bool("false") is True
    _quantized_checkpoint(tmp_path, dense_params, "int4_asym", qc=qc)
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.weights\.symmetric='false' must be true or false"):
        hf.load_layer(tmp_path, 0)


def test_symmetric_must_agree_with_the_zero_points(tmp_path, dense_params):
    _quantized_checkpoint(tmp_path, dense_params, "int4_asym", qc=_ct(_int4(True), "pack-quantized"))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight_zero_point: .* zero point but .* symmetric"):
        hf.load_layer(tmp_path, 0)
    _quantized_checkpoint(tmp_path, dense_params, "int4_sym", qc=_ct(_int4(False), "pack-quantized"))
    with pytest.raises(ValueError, match=r"missing tensor 'experts\.0\.gate_proj\.weight_zero_point' \(asymmetric"):
        hf.load_layer(tmp_path, 0)
    want = _quantized_checkpoint(tmp_path, dense_params, "int4_asym")  # agreeing: loads, zero points kept
    _, params = hf.load_layer(tmp_path, 0, layout="stacked")
    np.testing.assert_array_equal(params.experts.down_zero, want.experts.down_zero)


def _retype(key, dtype, view=True):
    def mutate(block):
        block[key] = block[key].view(dtype) if view else block[key].astype(dtype)

    return mutate


@pytest.mark.parametrize(
    ("name", "key", "dtype", "view", "found", "expected"),
    [
        ("int4_asym", "experts.1.gate_proj.weight_packed", np.float32, False, "float32", "int32 or uint32"),
        ("fp8", "experts.2.down_proj.weight", ml_dtypes.float8_e5m2, True, "float8_e5m2", "float8_e4m3fn"),
        ("nvfp4", "experts.3.up_proj.weight_scale", ml_dtypes.float8_e5m2, True, "float8_e5m2", "float8_e4m3fn"),
    ],
)
def test_the_stored_dtype_decides_the_decoding(tmp_path, dense_params, name, key, dtype, view, found, expected):
    """An on-disk tensor of another dtype than its format stores is refused, never cast nor reinterpreted."""
    _quantized_checkpoint(tmp_path, dense_params, name, mutate=_retype(key, dtype, view))
    with pytest.raises(ValueError, match=rf"{re.escape(key)}: dtype {found}, expected {expected}"):
        hf.load_layer(tmp_path, 0)


def test_targets_decide_which_modules_are_quantized(tmp_path, dense_params):
    """An attention-only targets list: the experts are stored dense and load dense."""
    config = dense_params[0]
    rng = np.random.default_rng(1)
    block = {"model.layers.0.mlp.gate.weight": normal(rng, E, QH)}
    for e in range(E):
        block[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = normal(rng, QI, QH)
        block[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = normal(rng, QI, QH)
        block[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = normal(rng, QH, QI)
    save_file(block, str(tmp_path / "model.safetensors"))
    qc = _ct(_int4(True), "pack-quantized", targets=["re:.*self_attn\\.(q|k|v|o)_proj$"])
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    _, params = hf.load_layer(tmp_path, 0, layout="stacked")
    assert isinstance(params.experts, moejax.weights.ExpertWeights)
    np.testing.assert_array_equal(params.experts.up[3], block["model.layers.0.mlp.experts.3.up_proj.weight"].T)


@pytest.mark.parametrize(
    "extra", ["experts.1.up_proj.weight_global_scale", "experts.2.down_proj.bias", "experts.3.gate_proj.weight"]
)
def test_unused_keys_in_a_quantized_block_raise(tmp_path, dense_params, extra):
    """Keys under the block prefix that no loader read (an int4 block has no global scale, this config no
    expert bias, a pack-quantized module no dense weight) are named, not dropped."""

    def add(block):
        block[extra] = np.ones(3, np.float32)

    _quantized_checkpoint(tmp_path, dense_params, "int4_sym", mutate=add)
    with pytest.raises(ValueError, match=rf"keys no loader read: '{re.escape(extra)}' with shape \(3,\)"):
        hf.load_layer(tmp_path, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ignore", "lm_head", r"quantization_config\.ignore must be a list of strings, got 'lm_head'"),
        ("ignore", ["re:(unclosed"], r"quantization_config\.ignore: 're:\(unclosed' is not a valid regular expression"),
        ("targets", "Linear", r"config_groups\.group_0\.targets must be a list of strings, got 'Linear'"),
    ],
)
def test_malformed_quantization_config_fields_are_named(tmp_path, field, value, message):
    """A bare string would be matched one character at a time; a bad regex would escape as re.error."""
    _dense_checkpoint(tmp_path)
    qc = _ct(_int4(True), "pack-quantized")
    if field == "targets":
        qc["config_groups"]["group_0"]["targets"] = value
    else:
        qc[field] = value
    (tmp_path / "config.json").write_text(json.dumps(_qwen_config(quantization_config=qc)))
    with pytest.raises(ValueError, match=message):
        hf.load_layer(tmp_path, 0)
