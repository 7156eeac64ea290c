"""`moejax.hf.load_layer` / `load_layers` / `save_layer` on checkpoints written here in each family's real on-disk
layout (key names from FAMILIES.md §5 of each family, written with numpy, never through `moejax.hf`), sharded
over three files with an index, one MoE layer spanning two shards."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracles import normal
from safetensors.numpy import save_file

import moejax
from moejax import hf

H, I, E, K = 8, 4, 4, 2
N_LAYERS = 4


def _per_expert(rng, names=("gate_proj", "up_proj", "down_proj"), n=E, prefix="experts."):
    keys = {}
    for e in range(n):
        keys[f"{prefix}{e}.{names[0]}.weight"] = normal(rng, I, H)
        keys[f"{prefix}{e}.{names[1]}.weight"] = normal(rng, I, H)
        keys[f"{prefix}{e}.{names[2]}.weight"] = normal(rng, H, I)
    return keys


def _mlp(rng, prefix, width, names=("gate_proj", "up_proj", "down_proj")):
    return {
        f"{prefix}{names[0]}.weight": normal(rng, width, H),
        f"{prefix}{names[1]}.weight": normal(rng, width, H),
        f"{prefix}{names[2]}.weight": normal(rng, H, width),
    }


# -- each family's block as its checkpoint class stores it (keys relative to the block prefix) ---------------


def _mixtral_block(rng, layer):
    return {"gate.weight": normal(rng, E, H)} | _per_expert(rng, ("w1", "w3", "w2"))


def _minimax_block(rng, layer):
    return _mixtral_block(rng, layer) | {"e_score_correction_bias": normal(rng, E)}


def _qwen_block(rng, layer):
    return {"gate.weight": normal(rng, E, H)} | _per_expert(rng)


def _qwen_shared_block(rng, layer):
    shared = _mlp(rng, "shared_expert.", 6) | {"shared_expert_gate.weight": normal(rng, 1, H)}
    return _qwen_block(rng, layer) | shared


def _deepseek_block(rng, layer):
    block = {"gate.weight": normal(rng, E, H), "gate.e_score_correction_bias": normal(rng, E)}
    return block | _per_expert(rng) | _mlp(rng, "shared_experts.", I)


def _step_block(rng, layer):  # the decoder layer: experts stacked per layer, own names
    return {
        "moe.gate.weight": normal(rng, E, H),
        "moe.router_bias": normal(rng, E),
        "moe.gate_proj.weight": normal(rng, E, I, H),
        "moe.up_proj.weight": normal(rng, E, I, H),
        "moe.down_proj.weight": normal(rng, E, H, I),
        **_mlp(rng, "share_expert.", 6),
        "self_attn.q_proj.weight": normal(rng, H, H),
        "input_layernorm.weight": normal(rng, H),
        "post_attention_layernorm.weight": normal(rng, H),
    }


def _longcat_block(rng, layer):  # router sized with the 2 zero experts, weights for the real experts only
    block = {"router.classifier.weight": normal(rng, E + 2, H), "router.e_score_correction_bias": normal(rng, E + 2)}
    return block | _per_expert(rng)


def _deepseek_v4_block(rng, layer):
    block = {"gate.weight": normal(rng, E, H)} | _per_expert(rng, ("w1", "w3", "w2"))
    block |= _mlp(rng, "shared_experts.", I, ("w1", "w3", "w2"))
    if layer == 0:  # hash layer
        block["gate.tid2eid"] = np.stack([rng.permutation(E)[:K] for _ in range(10)]).astype(np.int64)
    else:
        block["gate.bias"] = normal(rng, E)
    return block


def _gemma4_block(rng, layer):  # the decoder layer: router, experts and norms beside the dense MLP
    block = {
        "router.proj.weight": normal(rng, E, H),
        "router.scale": normal(rng, H),
        "router.per_expert_scale": normal(rng, E),
        "experts.gate_up_proj": normal(rng, E, 2 * I, H),
        "experts.down_proj": normal(rng, E, H, I),
        "pre_feedforward_layernorm_2.weight": normal(rng, H),
        "post_feedforward_layernorm_1.weight": normal(rng, H),
        "post_feedforward_layernorm_2.weight": normal(rng, H),
        "pre_feedforward_layernorm.weight": normal(rng, H),
        "post_feedforward_layernorm.weight": normal(rng, H),
        "self_attn.q_proj.weight": normal(rng, H, H),
    }
    return block | _mlp(rng, "mlp.", 12)


def _gpt_oss_block(rng, layer):
    return {
        "router.weight": normal(rng, E, H),
        "router.bias": normal(rng, E),
        "experts.gate_up_proj": normal(rng, E, H, 2 * I),
        "experts.gate_up_proj_bias": normal(rng, E, 2 * I),
        "experts.down_proj": normal(rng, E, I, H),
        "experts.down_proj_bias": normal(rng, E, H),
    }


def _llama4_block(rng, layer):
    block = {"router.weight": normal(rng, E, H), "experts.gate_up_proj": normal(rng, E, H, 2 * I)}
    return block | {"experts.down_proj": normal(rng, E, I, H)} | _mlp(rng, "shared_expert.", I)


_SIZES = {"hidden_size": H, "num_hidden_layers": N_LAYERS, "num_experts_per_tok": K}
_DS = {"n_routed_experts": E, "moe_intermediate_size": I, "n_group": 2, "topk_group": 1, "n_shared_experts": 1}


def _text(model_type, **fields):
    return {"model_type": model_type, **_SIZES, **fields}


def _multimodal(model_type, text):
    return {"model_type": model_type, "text_config": text, "vision_config": {"hidden_size": 3}}


# name -> (config.json, block prefix with {layer}, block builder, MoE layers)
CHECKPOINTS = {
    "mixtral": (
        _text("mixtral", num_local_experts=E, intermediate_size=I),
        "model.layers.{layer}.block_sparse_moe.",
        _mixtral_block,
        [0, 1, 2, 3],
    ),
    "qwen2_moe": (
        _text(
            "qwen2_moe",
            num_experts=E,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=6,
            mlp_only_layers=[0],
        ),
        "model.layers.{layer}.mlp.",
        _qwen_shared_block,
        [1, 2, 3],
    ),
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    "qwen3_moe": (
        _text("qwen3_moe", num_local_experts=E, moe_intermediate_size=I, decoder_sparse_step=2),
        "model.layers.{layer}.mlp.",
        _qwen_block,
        [1, 3],
    ),
    "qwen3_next": (
        _text("qwen3_next", num_experts=E, moe_intermediate_size=I, shared_expert_intermediate_size=6),
        "model.layers.{layer}.mlp.",
        _qwen_shared_block,
        [0, 1, 2, 3],
    ),
    "qwen3_5_moe": (
        _multimodal(
            "qwen3_5_moe",
            _text("qwen3_5_moe_text", num_experts=E, moe_intermediate_size=I, shared_expert_intermediate_size=6),
        ),
        "model.language_model.layers.{layer}.mlp.",
        _qwen_shared_block,
        [0, 1, 2, 3],
    ),
    "qwen3_5_moe_text": (
        _text("qwen3_5_moe_text", num_experts=E, moe_intermediate_size=I, shared_expert_intermediate_size=6),
        "model.layers.{layer}.mlp.",
        _qwen_shared_block,
        [0, 1, 2, 3],
    ),
    "deepseek_v3": (
        _text("deepseek_v3", first_k_dense_replace=1, **_DS),
        "model.layers.{layer}.mlp.",
        _deepseek_block,
        [1, 2, 3],
    ),
    "glm4_moe": (_text("glm4_moe", **_DS), "model.layers.{layer}.mlp.", _deepseek_block, [1, 2, 3]),
    "glm_moe_dsa": (
        _text("glm_moe_dsa", mlp_layer_types=["dense", "sparse", "dense", "sparse"], **_DS),
        "model.layers.{layer}.mlp.",
        _deepseek_block,
        [1, 3],
    ),
    "minimax_m2": (
        _text("minimax_m2", num_local_experts=E, intermediate_size=I),
        "model.layers.{layer}.block_sparse_moe.",
        _minimax_block,
        [0, 1, 2, 3],
    ),
    "step3p7": (
        _multimodal(
            "step3p7",
            _text(
                "step3p5",
                n_routed_experts=E,
                moe_intermediate_size=I,
                share_expert_dim=6,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            ),
        ),
        "model.layers.{layer}.",
        _step_block,
        [1, 2, 3],
    ),
    "longcat_flash": (
        {
            "model_type": "longcat_flash",
            "hidden_size": H,
            "num_layers": N_LAYERS,
            "num_hidden_layers": 2 * N_LAYERS,
            "n_routed_experts": E,
            "zero_expert_num": 2,
            "moe_topk": K,
            "expert_ffn_hidden_size": I,
        },
        "model.layers.{layer}.mlp.",
        _longcat_block,
        [0, 1, 2, 3],
    ),
    "deepseek_v4": (
        _text(
            "deepseek_v4",
            n_routed_experts=E,
            moe_intermediate_size=I,
            vocab_size=10,
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        ),
        "model.layers.{layer}.ffn.",
        _deepseek_v4_block,
        [0, 1, 2, 3],
    ),
    "deepseek_v4_original": (  # the original release's prefix, without model.
        _text(
            "deepseek_v4",
            n_routed_experts=E,
            moe_intermediate_size=I,
            vocab_size=10,
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        ),
        "layers.{layer}.ffn.",
        _deepseek_v4_block,
        [0, 1, 2, 3],
    ),
    "gemma4": (
        _multimodal(
            "gemma4",
            _text("gemma4_text", enable_moe_block=True, num_experts=E, top_k_experts=K, moe_intermediate_size=I),
        ),
        "model.language_model.layers.{layer}.",
        _gemma4_block,
        [0, 1, 2, 3],
    ),
    "gemma4_text": (
        _text("gemma4_text", enable_moe_block=True, num_experts=E, top_k_experts=K, moe_intermediate_size=I),
        "model.layers.{layer}.",
        _gemma4_block,
        [0, 1, 2, 3],
    ),
    "gpt_oss": (
        _text("gpt_oss", num_local_experts=E, intermediate_size=I),
        "model.layers.{layer}.mlp.",
        _gpt_oss_block,
        [0, 1, 2, 3],
    ),
    "llama4": (
        _multimodal(
            "llama4", _text("llama4_text", num_local_experts=E, intermediate_size=I, interleave_moe_layer_step=2)
        ),
        "language_model.model.layers.{layer}.feed_forward.",
        _llama4_block,
        [1, 3],
    ),
    "llama4_text": (
        _text("llama4_text", num_local_experts=E, intermediate_size=I, moe_layers=[0, 2]),
        "model.layers.{layer}.feed_forward.",
        _llama4_block,
        [0, 2],
    ),
    "olmoe": (
        _text("olmoe", num_experts=E, intermediate_size=I),
        "model.layers.{layer}.mlp.",
        _qwen_block,
        [0, 1, 2, 3],
    ),
}


def _dense_layer(rng, prefix):
    """What a dense decoder layer holds: attention and a dense MLP (the text model's layer prefix)."""
    return {f"{prefix}self_attn.q_proj.weight": normal(rng, H, H)} | _mlp(rng, f"{prefix}mlp.", 12)


def _layer_prefix(block_prefix, layer):
    """The decoder layer's prefix from the block's (block prefixes end in the block's module name or the layer)."""
    prefix = block_prefix.format(layer=layer)
    marker = f"layers.{layer}."
    return prefix[: prefix.index(marker) + len(marker)]


def write_checkpoint(path, name, seed=0, shards=3, dtype=np.float32):
    """A checkpoint of `name` in its on-disk layout over `shards` files with an index; returns {layer: block keys}."""
    config, prefix, build, moe_layers = CHECKPOINTS[name]
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": normal(rng, 10, H), "lm_head.weight": normal(rng, 10, H)}
    blocks = {}
    for layer in range(N_LAYERS):
        if layer in moe_layers:
            blocks[layer] = {k: v.astype(dtype) if v.dtype == np.float32 else v for k, v in build(rng, layer).items()}
            tensors |= {prefix.format(layer=layer) + k: v for k, v in blocks[layer].items()}
            tensors[_layer_prefix(prefix, layer) + "input_layernorm.weight"] = normal(rng, H)
        else:
            tensors |= _dense_layer(rng, _layer_prefix(prefix, layer))
    names = sorted(tensors)
    size = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * size : (i + 1) * size]
        save_file({k: np.ascontiguousarray(tensors[k]) for k in part}, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return blocks


def _family(name):
    config = CHECKPOINTS[name][0]
    return hf.MODEL_TYPES[(config.get("text_config") or config)["model_type"]]


def _assert_params_equal(got, want):
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_load_layer_reads_the_on_disk_layout(tmp_path, name):
    blocks = write_checkpoint(tmp_path, name)
    config = CHECKPOINTS[name][0]
    assert hf.moe_layer_indices(config) == sorted(blocks)
    layer = sorted(blocks)[-1]
    cfg, params = hf.load_layer(tmp_path, layer, layout="stacked")
    assert cfg == hf.config_from_hf(config, layer)
    want = hf.params_from_hf(blocks[layer], cfg, layout="stacked", family=_family(name))
    _assert_params_equal(params, want)


def test_a_layer_spanning_two_shards(tmp_path):
    write_checkpoint(tmp_path, "qwen2_moe")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    spans = {
        layer: {file for key, file in index.items() if key.startswith(f"model.layers.{layer}.mlp.")}
        for layer in (1, 2, 3)
    }
    layer = next(layer for layer, shard_files in spans.items() if len(shard_files) == 2)
    _, params = hf.load_layer(tmp_path, layer, layout="stacked")
    layers = hf.load_layers(tmp_path, layout="stacked")
    assert list(layers) == [1, 2, 3]  # keyed by decoder layer index (layer 0 is dense)
    assert [c for c, _ in layers.values()] == [hf.config_from_hf(CHECKPOINTS["qwen2_moe"][0], i) for i in (1, 2, 3)]
    _assert_params_equal(layers[layer][1], params)


def test_load_layers_reads_each_shard_once(tmp_path, monkeypatch):
    blocks = write_checkpoint(tmp_path, "deepseek_v3")
    opened = []
    read_file = hf.files.read_file
    monkeypatch.setattr(hf.files, "read_file", lambda path, keys: opened.append(path) or read_file(path, keys))
    layers = hf.load_layers(tmp_path, layout="stacked")
    assert len(opened) == len(set(opened)) == 3
    assert list(layers) == sorted(blocks)
    for layer, (cfg, params) in layers.items():
        _assert_params_equal(params, hf.params_from_hf(blocks[layer], cfg, layout="stacked", family="deepseek_v3"))
    chosen = hf.load_layers(tmp_path, [3, 1], layout="stacked")
    assert list(chosen) == [3, 1]  # in the order asked for
    _assert_params_equal(chosen[3][1], layers[3][1])


@pytest.mark.parametrize(
    ("name", "layer", "block"),
    [("mixtral", 2, "model.layers.2.block_sparse_moe."), ("gemma4_text", 2, "model.layers.2.")],
)
def test_load_layer_reads_only_the_block(tmp_path, monkeypatch, name, layer, block):
    write_checkpoint(tmp_path, name)
    asked = []
    read_file = hf.files.read_file
    monkeypatch.setattr(hf.files, "read_file", lambda path, keys: asked.extend(keys) or read_file(path, keys))
    hf.load_layer(tmp_path, layer)
    assert asked and all(k.startswith(block) for k in asked)
    assert not any(k.startswith((f"{block}self_attn.", f"{block}mlp.")) for k in asked)  # Gemma-4's other modules


def test_single_file_checkpoint_and_dtype(tmp_path):
    blocks = write_checkpoint(tmp_path, "gpt_oss", shards=1, dtype=ml_dtypes.bfloat16)
    (tmp_path / "model.safetensors.index.json").unlink()  # one file, no index
    (tmp_path / "model-00001-of-00001.safetensors").rename(tmp_path / "model.safetensors")
    cfg, params = hf.load_layer(tmp_path, 1, layout="stacked")
    assert params.experts.gate.dtype == jnp.bfloat16
    _assert_params_equal(params, hf.params_from_hf(blocks[1], cfg, layout="stacked", family="gpt_oss"))
    _, as_f32 = hf.load_layer(tmp_path, 1, dtype=jnp.float32, layout="stacked")
    assert as_f32.experts.gate.dtype == jnp.float32 and as_f32.router.kernel.dtype == jnp.float32


def test_correction_bias_stays_float32(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3")
    _, params = hf.load_layer(tmp_path, 2, dtype=jnp.bfloat16, layout="stacked")
    assert params.experts.gate.dtype == jnp.bfloat16
    assert params.router.correction_bias.dtype == jnp.float32


def test_default_layout_is_per_expert_on_cpu(tmp_path):
    write_checkpoint(tmp_path, "olmoe")
    _, params = hf.load_layer(tmp_path, 0)
    assert isinstance(params.experts, moejax.weights.PerExpert)


# -- errors ------------------------------------------------------------------------------------------------------


def test_dense_layer_names_the_layer_and_the_moe_prefixes(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3")
    with pytest.raises(
        ValueError,
        match=r"layer 0 of .* is a dense MLP \(first_k_dense_replace=1\).*model\.layers\.1\.mlp\., "
        r"model\.layers\.2\.mlp\., model\.layers\.3\.mlp\. \(3 in all\)",
    ):
        hf.load_layer(tmp_path, 0)


def test_layer_out_of_range(tmp_path):
    write_checkpoint(tmp_path, "llama4")
    with pytest.raises(
        ValueError,
        match=r"layer 7 .*out of range: the llama4_text config has 4 layers.*"
        r"language_model\.model\.layers\.1\.feed_forward\., language_model\.model\.layers\.3\.feed_forward\.",
    ):
        hf.load_layer(tmp_path, 7)


def test_keys_matching_no_checkpoint_class(tmp_path):
    """A Qwen3.5 text checkpoint whose config says multimodal, with layer 2's router renamed: the error lists
    what was looked for and where MoE blocks are."""
    write_checkpoint(tmp_path, "qwen3_5_moe")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    old = "model.language_model.layers.2.mlp.gate.weight"
    index["weight_map"]["model.language_model.layers.2.mlp.router.weight"] = index["weight_map"].pop(old)
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"layer 2 .*no MoE block found; looked for model\.language_model\.layers\.2\.mlp\.gate\.weight "
        r"\(Qwen3_5MoeForConditionalGeneration\), model\.layers\.2\.mlp\.gate\.weight .*"
        r"model\.language_model\.layers\.0\.mlp\., model\.language_model\.layers\.1\.mlp\., "
        r"model\.language_model\.layers\.3\.mlp\. \(3 in all\)",
    ):
        hf.load_layer(tmp_path, 2)


def test_wrong_family_keys(tmp_path):
    """Mixtral tensors under a config that says Qwen3-MoE: no block found, and no prefix holds a Qwen block."""
    write_checkpoint(tmp_path, "mixtral")
    config = {"model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": N_LAYERS, "num_experts": E}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer 1 .*no MoE block found.*no prefix holds an MoE block"):
        hf.load_layer(tmp_path, 1)


def test_block_with_a_missing_tensor_names_layer_and_key(tmp_path):
    write_checkpoint(tmp_path, "mixtral")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"layer 2 \(MixtralForCausalLM, prefix 'model\.layers\.2\.block_sparse_moe\.'\).*"
        r"missing key 'experts\.3\.w2\.weight'",
    ):
        hf.load_layer(tmp_path, 2)


def test_wrong_directory(tmp_path):
    with pytest.raises(ValueError, match=r"is not a directory"):
        hf.load_layer(tmp_path / "absent", 0)
    with pytest.raises(ValueError, match=r"has no config\.json: expected a checkpoint directory"):
        hf.load_layer(tmp_path, 0)
    (tmp_path / "config.json").write_text(json.dumps(CHECKPOINTS["olmoe"][0]))
    with pytest.raises(ValueError, match=r"holds neither model\.safetensors\.index\.json nor \.safetensors"):
        hf.load_layer(tmp_path, 0)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": H}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'"):
        hf.load_layer(tmp_path, 0)


def test_missing_shard(tmp_path):
    write_checkpoint(tmp_path, "olmoe")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.3.mlp.gate.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(
        ValueError, match=rf"layer 3: the index maps 'model\.layers\.3\.mlp\..*to {shard}, which is missing"
    ):
        hf.load_layer(tmp_path, 3)


# -- saving --------------------------------------------------------------------------------------------------------


_DECODER_MODULES = {
    "self_attn",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_save_layer_writes_the_on_disk_layout(tmp_path, name):
    """load -> save into a new checkpoint as the same class -> the original on-disk keys, and load gives the same."""
    (tmp_path / "src").mkdir()
    blocks = write_checkpoint(tmp_path / "src", name)
    config, prefix, _, moe_layers = CHECKPOINTS[name]
    layer = moe_layers[0]
    record = next(f for f in hf.FAMILY_RECORDS if f.name == _family(name))
    checkpoint_class = next(b.checkpoint for b in record.blocks if b.prefix == prefix)
    cfg, params = hf.load_layer(tmp_path / "src", layer, layout="stacked")
    shard = hf.save_layer(tmp_path / "dst", layer, params, hf_config=config, checkpoint_class=checkpoint_class)
    written = hf.files.read_file(shard, hf.files.weight_map(shard))
    block_prefix = prefix.format(layer=layer)
    original = {block_prefix + k: v for k, v in blocks[layer].items()}
    for key in set(written) - set(original):  # LongCat: zero rows for the zero experts (a new checkpoint)
        assert name == "longcat_flash" and int(key.split(".")[-3]) >= E and not written[key].any(), key
    for key in set(written) & set(original):
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    left_out = {k[len(block_prefix) :].split(".")[0] for k in set(original) - set(written)}
    assert left_out <= _DECODER_MODULES  # only the decoder layer's other modules (Gemma-4, Step-3.7) are left out
    cfg2, params2 = hf.load_layer(tmp_path / "dst", layer, layout="stacked")
    assert cfg2 == cfg
    _assert_params_equal(params2, params)


@pytest.mark.parametrize("stored", ["per_expert", "fused", "fused_with_zero_rows"])
def test_longcat_zero_expert_rows_follow_the_checkpoint(tmp_path, stored):
    """transformers versions differ on rows for LongCat's zero experts (never used): some size the fused
    `gate_up_proj` with them, others refuse a checkpoint that has them. A save into a checkpoint keeps what it
    stores, so the transformers that wrote it still reads it."""
    blocks = write_checkpoint(tmp_path, "longcat_flash")
    layer, prefix = 1, "model.layers.1.mlp."
    if stored != "per_expert":  # the block re-saved fused, as a transformers version writes it
        rows = E + 2 if stored == "fused_with_zero_rows" else E
        hf.save_layer(tmp_path, layer, hf.load_layer(tmp_path, layer, layout="stacked")[1], experts="fused")
        shard = hf.files.weight_map(tmp_path)[prefix + "experts.gate_up_proj"]
        written = hf.files.read_file(shard, hf.files.weight_map(shard))
        written[prefix + "experts.gate_up_proj"] = written[prefix + "experts.gate_up_proj"][:rows]
        save_file(written, shard)
    params = hf.load_layer(tmp_path, layer, layout="stacked")[1]
    params = dataclasses.replace(params, experts=jax.tree.map(lambda w: 2 * w, params.experts))
    shard = hf.save_layer(tmp_path, layer, params, experts="per_expert" if stored == "per_expert" else "fused")
    written = hf.files.read_file(shard, hf.files.weight_map(shard))
    if stored == "per_expert":
        assert {k[len(prefix) :] for k in written if ".experts." in k} == {k for k in blocks[layer] if "experts." in k}
    else:
        assert written[prefix + "experts.gate_up_proj"].shape[0] == rows
    _assert_params_equal(hf.load_layer(tmp_path, layer, layout="stacked")[1], params)


def test_save_layer_replaces_a_block_in_a_sharded_checkpoint(tmp_path):
    write_checkpoint(tmp_path, "qwen2_moe")
    _, params = hf.load_layer(tmp_path, 2, layout="stacked")
    _, before = hf.load_layer(tmp_path, 1, layout="stacked")
    edited = jax.tree.map(lambda w: w * 2 if jnp.issubdtype(w.dtype, jnp.floating) else w, params)
    hf.save_layer(tmp_path, 2, edited)
    weight_map = hf.files.weight_map(tmp_path)
    block = [k for k in weight_map if k.startswith("model.layers.2.mlp.")]
    assert {weight_map[k] for k in block} == {str(tmp_path / "model-moejax-layer-00002.safetensors")}
    for path in {weight_map[k] for k in weight_map} - {weight_map[block[0]]}:  # old shards no longer hold it
        assert not any(k.startswith("model.layers.2.mlp.") for k in hf.files.header(path)[1])
    _assert_params_equal(hf.load_layer(tmp_path, 2, layout="stacked")[1], edited)
    _assert_params_equal(hf.load_layer(tmp_path, 1, layout="stacked")[1], before)  # other layers untouched
    assert list(hf.load_layers(tmp_path)) == [1, 2, 3]


def test_save_layer_checkpoint_class_and_experts(tmp_path):
    config = CHECKPOINTS["qwen3_5_moe"][0]
    (tmp_path / "src").mkdir()
    write_checkpoint(tmp_path / "src", "qwen3_5_moe")
    _, params = hf.load_layer(tmp_path / "src", 1, layout="stacked")
    tensors = hf.layer_tensors(params, config, 1, checkpoint_class="Qwen3_5MoeForCausalLM", experts="fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    with pytest.raises(ValueError, match=r"no checkpoint class 'Nope'.*Qwen3_5MoeForConditionalGeneration"):
        hf.layer_tensors(params, config, 1, checkpoint_class="Nope")
    with pytest.raises(ValueError, match=r"has no config\.json: pass hf_config"):
        hf.save_layer(tmp_path / "dst", 1, params)


def test_progress_is_silent_when_output_is_not_interactive(tmp_path, capsys):
    write_checkpoint(tmp_path, "olmoe")
    hf.load_layers(tmp_path)
    out, err = capsys.readouterr()
    assert out == err == ""


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("deepseek_v4_original", "layers.1.ffn.gate.weight"),  # the prefix the checkpoint uses, not the default
        ("gemma4_text", "model.layers.1.self_attn.q_proj.weight"),  # the decoder layer's other modules stay
        ("step3p7", "model.layers.1.input_layernorm.weight"),
    ],
)
def test_save_layer_in_place_keeps_the_checkpoint_class(tmp_path, name, kept):
    write_checkpoint(tmp_path, name)
    _, params = hf.load_layer(tmp_path, 1, layout="stacked")
    before = hf.files.weight_map(tmp_path)
    hf.save_layer(tmp_path, 1, params)
    after = hf.files.weight_map(tmp_path)
    assert kept in after
    assert set(after) == set(before)  # the same keys, the block's now in its own shard
    _assert_params_equal(hf.load_layer(tmp_path, 1, layout="stacked")[1], params)
