"""`load_layer` / `save_layer` on checkpoints saved by transformers itself (`save_pretrained`, sharded), for every
family and the multimodal classes: the block loads as transformers holds it in memory, and a block written back
by `save_layer` is what `from_pretrained` loads. Skipped where transformers and torch are not installed (the
`peers` extra)."""

import json
import warnings

import jax
import numpy as np
import pytest

from moejax import hf
from moejax.hf.families import BY_NAME

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = {
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
    "head_dim": 8,
}
_MLA = {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8}
_LINEAR_ATTENTION = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention", "full_attention"],
}
_QWEN = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "intermediate_size": 20}
_SHARED = {"shared_expert_intermediate_size": 12}
_DS = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "intermediate_size": 20}

# model_type -> text config fields (causal LM classes)
CAUSAL_LM = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8},
    "qwen2_moe": {**_QWEN, **_SHARED, "mlp_only_layers": [0]},
    "qwen3_moe": {**_QWEN, "decoder_sparse_step": 1},
    "qwen3_next": {**_QWEN, **_SHARED, **_LINEAR_ATTENTION},
    "deepseek_v3": {**_DS, **_MLA, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1},
    "glm4_moe": {**_DS, "first_k_dense_replace": 1},
    "glm_moe_dsa": {**_DS, **_MLA, "mlp_layer_types": ["dense", "sparse", "sparse"], "index_head_dim": 8},
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "longcat_flash": {
        **_MLA,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "moe_topk": 2,
        "expert_ffn_hidden_size": 8,
        "ffn_hidden_size": 20,
        "num_layers": 2,
    },
    "deepseek_v4": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "q_lora_rank": 8,
        "o_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "index_head_dim": 8,
        "index_n_heads": 2,
        "o_groups": 2,
    },
    "llama4_text": {
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size": 8,
        "intermediate_size_mlp": 20,
        "interleave_moe_layer_step": 2,
    },
    "gemma4_text": {
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 8,
        "intermediate_size": 20,
        "hidden_size_per_layer_input": 4,
        "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    },
}
_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
# model_type -> (text config fields, vision config fields)
MULTIMODAL = {
    "qwen3_5_moe": (
        {**_QWEN, **_SHARED, **_LINEAR_ATTENTION},
        {"hidden_size": 16, "intermediate_size": 32, "depth": 1, "num_heads": 2, "out_hidden_size": 16},
    ),
    "llama4": (
        CAUSAL_LM["llama4_text"],
        {**_VISION, "vision_output_dim": 16, "projector_input_dim": 16, "projector_output_dim": 16, "image_size": 28},
    ),
    "gemma4": (CAUSAL_LM["gemma4_text"], {**_VISION, "head_dim": 8, "num_key_value_heads": 1}),
    "step3p7": (
        {**_DS, "share_expert_dim": 12, "mlp_layer_types": ["dense", "sparse", "sparse"]},
        {**_VISION, "image_size": 28, "patch_size": 14},
    ),
}


def _causal_lm(model_type):
    config = transformers.AutoConfig.for_model(model_type, **TEXT, **CAUSAL_LM[model_type])
    return transformers.AutoModelForCausalLM.from_config(config)


def _multimodal(model_type):
    text, vision = MULTIMODAL[model_type]
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    extra = {"audio_config": None} if model_type == "gemma4" else {}
    config = config_class(text_config={**TEXT, **text}, vision_config=vision, **extra)
    return transformers.AutoModelForImageTextToText.from_config(config)


def _in_memory_block(state, router, layer):
    """(prefix, the block of `layer` in transformers' in-memory state dict with keys relative to the prefix)."""
    prefix = next(
        k[: -len(router)]
        for k in state
        if k.endswith(router) and f"layers.{layer}." in k and k[: -len(router)][-1:] == "."
    )
    return prefix, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _check(model, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path, max_shard_size="20KB")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (tmp_path / "model.safetensors.index.json").exists()
    family = hf.MODEL_TYPES[config["model_type"]]
    state = model.state_dict()
    layers = hf.moe_layer_indices(config)
    assert layers
    for layer in layers:
        cfg, params = hf.load_layer(tmp_path, layer, layout="stacked")
        _, block = _in_memory_block(state, BY_NAME[family].memory.router, layer)
        want = hf.params_from_hf(block, cfg, layout="stacked", family=family)
        jax.tree.map(np.testing.assert_array_equal, params, want)
    # Written back (doubled, so a block that was not replaced shows), the layer is what from_pretrained loads.
    doubled = jax.tree.map(lambda w: w * 2 if w.dtype.kind == "f" else w, params)
    hf.save_layer(tmp_path, layers[-1], doubled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = type(model).from_pretrained(tmp_path).state_dict()
    prefix, block = _in_memory_block(again, BY_NAME[family].memory.router, layers[-1])
    jax.tree.map(np.testing.assert_array_equal, hf.params_from_hf(block, cfg, layout="stacked", family=family), doubled)
    others = [k for k in state if not k.startswith(prefix)]  # everything else as it was
    for key in others:
        torch.testing.assert_close(again[key], state[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("model_type", CAUSAL_LM)
def test_causal_lm_checkpoint(tmp_path, model_type):
    torch.manual_seed(0)
    _check(_causal_lm(model_type), tmp_path)


@pytest.mark.parametrize("model_type", MULTIMODAL)
def test_multimodal_checkpoint(tmp_path, model_type):
    torch.manual_seed(0)
    _check(_multimodal(model_type), tmp_path)
