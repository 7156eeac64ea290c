"""`moejax.hf` against FAMILIES.md: configs, both HF tensor layouts, a numpy oracle per family, safetensors.

The Hugging Face tensors here are built with numpy straight from FAMILIES.md (per-expert Linear weights, then the
documented conversion to the fused in-memory layout), never through `moejax.hf`; the numpy oracles read the fused
in-memory layout exactly as FAMILIES.md writes each formula (gate rows first, gpt-oss interleaved, Llama-4 and
gpt-oss transposed).
"""

import dataclasses
import json
import types

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracles import gelu_tanh, normal, sigmoid, silu, softmax, softplus
from safetensors.numpy import save_file

import moejax
from moejax import hf
from moejax.params import expected_shapes, flatten, unflatten, with_experts_layout

H, I = 16, 8  # hidden, expert intermediate (shared sizes differ on purpose)

# -- config ----------------------------------------------------------------------------------------------------

CONFIG_CASES = [
    # (hf config, layer_idx, expected MoEConfig fields)
    (
        {"model_type": "mixtral", "hidden_size": 16, "num_local_experts": 6, "intermediate_size": 8},
        None,
        {"num_experts": 6, "top_k": 2, "intermediate_size": 8, "normalize": True, "weights_dtype": "float32"},
    ),
    (
        {"model_type": "qwen2_moe", "hidden_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [5]},
        3,
        {"num_experts": 60, "top_k": 4, "intermediate_size": 1408, "normalize": False, "weights_dtype": "input"},
    ),
    (
        {"model_type": "qwen2_moe", "hidden_size": 16},
        None,
        {"shared_expert": moejax.SharedExpert.SIGMOID_GATED, "shared_intermediate_size": 5632},
    ),
    (
        {"model_type": "qwen3_moe", "hidden_size": 16, "norm_topk_prob": True, "num_experts": 32},
        None,
        {"num_experts": 32, "top_k": 8, "intermediate_size": 768, "normalize": True, "shared_expert": "none"},
    ),
    ({"model_type": "qwen3_moe", "hidden_size": 16}, None, {"normalize": False}),
    (
        {"model_type": "qwen3_next", "hidden_size": 16},
        None,
        {"num_experts": 512, "top_k": 10, "normalize": True, "shared_intermediate_size": 512},
    ),
    (
        {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 16}},
        None,
        {"num_experts": 256, "top_k": 8, "normalize": True, "shared_expert": "sigmoid_gated"},
    ),
    (
        {"model_type": "deepseek_v3", "hidden_size": 16},
        3,
        {
            "num_experts": 256,
            "top_k": 8,
            "intermediate_size": 2048,
            "n_group": 8,
            "topk_group": 4,
            "scoring": "sigmoid",
            "correction_bias": True,
            "normalize": True,
            "norm_epsilon": 1e-20,
            "routed_scaling_factor": 2.5,
            "shared_expert": "ungated",
            "shared_intermediate_size": 2048,
            "router_dtype": "float32",
        },
    ),
    (
        {"model_type": "deepseek_v3", "hidden_size": 16, "num_local_experts": 16, "n_shared_experts": 2},
        None,
        {"num_experts": 16, "shared_intermediate_size": 4096},
    ),
    (
        {"model_type": "glm4_moe", "hidden_size": 16},
        1,
        {"num_experts": 128, "intermediate_size": 1408, "n_group": 1, "routed_scaling_factor": 1.0},
    ),
    (
        {"model_type": "glm_moe_dsa", "hidden_size": 16, "num_experts": 32, "mlp_layer_types": ["dense", "sparse"]},
        1,
        {"num_experts": 32, "routed_scaling_factor": 2.5, "correction_bias": True},
    ),
    (
        {"model_type": "minimax_m2", "hidden_size": 16, "num_experts": 12},
        None,
        {
            "num_experts": 12,
            "intermediate_size": 1536,
            "scoring": "sigmoid",
            "correction_bias": True,
            "normalize": True,
            "norm_epsilon": 0.0,
            "routed_scaling_factor": 1.0,
            "router_dtype": "input",
            "weights_dtype": "float32",
        },
    ),
    (
        {
            "model_type": "step3p7",
            "text_config": {
                "model_type": "step3p5",
                "hidden_size": 16,
                "moe_num_experts": 12,
                "moe_top_k": 3,
                "share_expert_dims": 24,
                "moe_router_scaling_factor": 3.0,
                "swiglu_limits": [None, 0, 7.0],
                "swiglu_limits_shared": [None, 16.0, 0],
                "mlp_layer_types": ["dense", "sparse", "sparse"],
                "hidden_act": "swigluoai",  # forced to silu by Step3p7TextConfig
            },
        },
        1,
        {
            "num_experts": 12,
            "top_k": 3,
            "scaling_target": "output",
            "routed_scaling_factor": 3.0,
            "swiglu_limit": None,
            "shared_swiglu_limit": 16.0,
            "clamp_order": "after_activation",
            "shared_intermediate_size": 24,
            "activation": "silu",
        },
    ),
    (
        {"model_type": "step3p5", "hidden_size": 16, "swiglu_limits": [0, 0, 0, 7.0], "moe_layers_enum": "1,3"},
        3,
        {"num_experts": 288, "top_k": 8, "intermediate_size": 1280, "swiglu_limit": 7.0, "shared_swiglu_limit": None},
    ),
    (
        {"model_type": "longcat_flash", "hidden_size": 16},
        None,
        {
            "num_experts": 512,
            "num_zero_experts": 256,
            "top_k": 12,
            "intermediate_size": 2048,
            "routed_scaling_factor": 6.0,
            "scoring": "softmax",
            "correction_bias": True,
            "normalize": False,
            "router_dtype": "float32",
        },
    ),
    (
        {
            "model_type": "longcat_flash",
            "hidden_size": 16,
            "num_local_experts": 8,
            "zero_expert_num": 2,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 24,
        },
        None,
        {"num_experts": 8, "num_zero_experts": 2, "top_k": 3, "intermediate_size": 24},
    ),
    (
        {"model_type": "deepseek_v4", "hidden_size": 16, "num_hidden_layers": 5},
        4,
        {
            "num_experts": 256,
            "top_k": 6,
            "intermediate_size": 2048,
            "scoring": "sqrtsoftplus",
            "correction_bias": True,
            "hash_routing": False,
            "routed_scaling_factor": 1.5,
            "swiglu_limit": 10.0,
            "shared_swiglu_limit": 10.0,
            "shared_intermediate_size": 2048,
            "clamp_order": "before_activation",
            "weights_dtype": "input",
        },
    ),
    (
        {"model_type": "deepseek_v4", "hidden_size": 16, "num_local_experts": 8, "intermediate_size": 32},
        2,
        {
            "num_experts": 8,
            "intermediate_size": 32,
            "hash_routing": True,
            "vocab_size": 129280,
            "correction_bias": False,
        },
    ),
    (
        {"model_type": "deepseek_v4", "hidden_size": 16, "mlp_layer_types": ["moe", "moe"], "scoring_func": "sigmoid"},
        None,
        {"scoring": "sigmoid", "hash_routing": False},
    ),
    (
        {
            "model_type": "gemma4",
            "text_config": {
                "model_type": "gemma4_text",
                "hidden_size": 16,
                "enable_moe_block": True,
                "num_experts": 8,
                "top_k_experts": 2,
                "moe_intermediate_size": 4,
                "rms_norm_eps": 1e-5,
            },
        },
        None,
        {
            "num_experts": 8,
            "top_k": 2,
            "intermediate_size": 4,
            "activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-5,
            "router_prenorm": True,
            "expert_prenorm": True,
            "per_expert_scale": True,
            "normalize": True,
        },
    ),
    (
        {"model_type": "gpt_oss", "hidden_size": 16, "num_experts": 32, "swiglu_limit": 5.0},
        None,
        {
            "num_experts": 32,
            "top_k": 4,
            "intermediate_size": 2880,
            "swiglu_limit": 5.0,
            "swiglu_alpha": 1.702,
            "activation": "gpt_oss",
            "score_order": "after_topk",
            "router_bias": True,
            "expert_bias": True,
        },
    ),
    (
        {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "hidden_size": 16}},
        None,
        {
            "num_experts": 16,
            "top_k": 1,
            "intermediate_size": 8192,
            "shared_intermediate_size": 8192,
            "scoring": "sigmoid",
            "score_order": "after_topk",
            "weights_on_input": True,
        },
    ),
    (
        {"model_type": "olmoe", "hidden_size": 16, "num_local_experts": 10},
        None,
        {"num_experts": 10, "top_k": 8, "intermediate_size": 2048, "normalize": False, "weights_dtype": "input"},
    ),
]


def _field(cfg, name):
    value = getattr(cfg, name)
    return value.value if hasattr(value, "value") else value


@pytest.mark.parametrize(("hf_config", "layer_idx", "expected"), CONFIG_CASES)
def test_config_from_hf(hf_config, layer_idx, expected):
    cfg = hf.config_from_hf(hf_config, layer_idx)
    assert cfg.hidden_size == 16
    for name, value in expected.items():
        value = value.value if hasattr(value, "value") else value
        assert _field(cfg, name) == value, name


def test_config_families_cover_model_types():
    assert set(hf.MODEL_TYPES.values()) == set(moejax.FAMILIES)
    covered = {hf.MODEL_TYPES[(c.get("text_config") or c)["model_type"]] for c, _, _ in CONFIG_CASES}
    assert covered == set(moejax.FAMILIES)


# Fields that say *which* math a family does (not sizes, not checkpoint-dependent values like norm_topk_prob).
_SEMANTIC = (
    "scoring",
    "score_order",
    "correction_bias",
    "router_bias",
    "per_expert_scale",
    "router_prenorm",
    "hash_routing",
    "weights_on_input",
    "router_dtype",
    "weights_dtype",
    "activation",
    "clamp_order",
    "expert_bias",
    "expert_prenorm",
    "scaling_target",
    "shared_expert",
)


@pytest.mark.parametrize("family", moejax.FAMILIES)
def test_config_matches_preset_semantics(family):
    model_type = next(t for t, f in hf.MODEL_TYPES.items() if f == family)
    hf_config = {"model_type": model_type, "hidden_size": 16}
    if family == "gemma4":  # no defaults for these
        hf_config |= {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 4}
    cfg = hf.config_from_hf(hf_config, layer_idx=5)
    preset = moejax.MoEConfig.preset(family)
    assert {n: _field(cfg, n) for n in _SEMANTIC} == {n: _field(preset, n) for n in _SEMANTIC}
    assert (cfg.num_zero_experts > 0) == (preset.num_zero_experts > 0)


def test_config_from_transformers_like_objects():
    class FakePretrainedConfig:  # what transformers' PretrainedConfig offers
        def to_dict(self):
            return {"model_type": "qwen3_moe", "hidden_size": 16, "num_experts": 8, "num_experts_per_tok": 2}

    cfg = hf.config_from_hf(FakePretrainedConfig())
    assert (cfg.num_experts, cfg.top_k) == (8, 2)
    text = types.SimpleNamespace(model_type="llama4_text", hidden_size=16, num_local_experts=4, intermediate_size=8)
    cfg = hf.config_from_hf(types.SimpleNamespace(model_type="llama4", text_config=text))
    assert (cfg.num_experts, cfg.intermediate_size, cfg.shared_intermediate_size) == (4, 8, 8)


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'.*mixtral.*deepseek_v4.*olmoe"):
        hf.config_from_hf({"model_type": "llama", "hidden_size": 16})


@pytest.mark.parametrize(
    "hf_config",
    [
        {"model_type": "deepseek_v4", "hidden_size": 16},
        {"model_type": "deepseek_v4", "hidden_size": 16, "mlp_layer_types": ["hash_moe", "moe"]},
        {
            "model_type": "step3p5",
            "hidden_size": 16,
            "swiglu_limits": [None, 0, 7.0],
            "mlp_layer_types": ["sparse"] * 3,
        },
        {"model_type": "step3p5", "hidden_size": 16, "swiglu_limits_shared": [0, 0, 0, 5.0, 6.0]},
    ],
)
def test_layer_idx_needed(hf_config):
    with pytest.raises(ValueError, match="pass layer_idx"):
        hf.config_from_hf(hf_config)


def test_layer_idx_not_needed_when_uniform():
    # Only layer 3 is MoE (layers 0-2 dense by default), so the limits of layers 0-2 do not matter.
    cfg = hf.config_from_hf({"model_type": "step3p5", "hidden_size": 16, "swiglu_limits": [1.0, 2.0, 3.0, 7.0]})
    assert cfg.swiglu_limit == 7.0


@pytest.mark.parametrize(
    ("hf_config", "layer_idx", "reason"),
    [
        ({"model_type": "qwen2_moe", "hidden_size": 16, "mlp_only_layers": [2]}, 2, "mlp_only_layers"),
        ({"model_type": "qwen3_moe", "hidden_size": 16, "decoder_sparse_step": 2}, 2, "decoder_sparse_step=2"),
        ({"model_type": "deepseek_v3", "hidden_size": 16}, 2, "first_k_dense_replace=3"),
        ({"model_type": "glm4_moe", "hidden_size": 16}, 0, "first_k_dense_replace=1"),
        ({"model_type": "glm_moe_dsa", "hidden_size": 16, "mlp_layer_types": ["dense", "sparse"]}, 0, "mlp_layer"),
        ({"model_type": "step3p5", "hidden_size": 16}, 1, "layers 0-2 dense"),
        ({"model_type": "step3p5", "hidden_size": 16, "mlp_layer_types": ["sparse", "dense"]}, 1, "mlp_layer_types"),
        ({"model_type": "llama4_text", "hidden_size": 16, "interleave_moe_layer_step": 2}, 2, "interleave"),
        ({"model_type": "llama4_text", "hidden_size": 16, "moe_layers": [1, 3]}, 0, "moe_layers"),
    ],
)
def test_dense_layer_raises(hf_config, layer_idx, reason):
    assert not hf.is_moe_layer(hf_config, layer_idx)
    with pytest.raises(ValueError, match=f"layer_idx={layer_idx}.*dense MLP.*{reason}"):
        hf.config_from_hf(hf_config, layer_idx)


def test_is_moe_layer():
    llama = {"model_type": "llama4_text", "hidden_size": 16, "interleave_moe_layer_step": 2, "num_hidden_layers": 6}
    assert [hf.is_moe_layer(llama, i) for i in range(6)] == [False, True] * 3
    qwen = {"model_type": "qwen2_moe", "hidden_size": 16, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    assert [hf.is_moe_layer(qwen, i) for i in range(3)] == [False, True, True]
    assert hf.is_moe_layer({"model_type": "mixtral", "hidden_size": 16}, 31)
    with pytest.raises(ValueError, match="out of range"):
        hf.is_moe_layer({"model_type": "mixtral", "hidden_size": 16, "num_hidden_layers": 4}, 4)


def test_gemma4_without_moe_block_raises():
    with pytest.raises(ValueError, match="enable_moe_block=False"):
        hf.config_from_hf({"model_type": "gemma4_text", "hidden_size": 16})


# -- numpy oracles, written from FAMILIES.md on the fused in-memory layout ------------------------------------


def _top_k(v, k):
    return np.argsort(-v, kind="stable")[:k]


def _swiglu_expert(t, e, x, act=silu):
    """§0.2: gu = gate_up_proj[e]·x, gate = gu[0:I], up = gu[I:2I], y = down_proj[e]·(act(gate)⊙up)."""
    gu = t["experts.gate_up_proj"][e] @ x
    n = t["experts.down_proj"].shape[2]
    return t["experts.down_proj"][e] @ (act(gu[:n]) * gu[n:])


def _mlp(t, prefix, x, names=("gate_proj", "up_proj", "down_proj")):
    g, u, d = (t[f"{prefix}{n}.weight"] for n in names)
    return d @ (silu(g @ x) * (u @ x))


def _rows(fn, x, token_ids=None):
    x = np.asarray(x, np.float64)
    ids = [None] * len(x) if token_ids is None else np.asarray(token_ids)
    return np.stack([fn(row, tid) for row, tid in zip(x, ids, strict=True)])


def ref_mixtral(t, cfg, x, tid):
    p = softmax(t["gate.weight"] @ x)
    idx = _top_k(p, cfg.top_k)
    w = p[idx] / p[idx].sum()
    return sum(wj * _swiglu_expert(t, e, x) for wj, e in zip(w, idx, strict=True))


def ref_qwen2_moe(t, cfg, x, tid):
    p = softmax(t["gate.weight"] @ x)
    idx = _top_k(p, cfg.top_k)
    w = p[idx]  # norm_topk_prob=False: raw probabilities
    routed = sum(wj * _swiglu_expert(t, e, x) for wj, e in zip(w, idx, strict=True))
    g = sigmoid(t["shared_expert_gate.weight"] @ x)  # [1]
    return routed + g * _mlp(t, "shared_expert.", x)


def ref_deepseek_v3(t, cfg, x, tid, n_group=4, topk_group=2):
    s = sigmoid(t["gate.weight"] @ x)
    c = (s + t["gate.e_score_correction_bias"]).reshape(n_group, -1)
    group_score = np.sort(c, axis=1)[:, -2:].sum(1)
    masked = np.full_like(c, -np.inf)
    keep = _top_k(group_score, topk_group)
    masked[keep] = c[keep]
    idx = _top_k(masked.reshape(-1), cfg.top_k)
    w = s[idx] / (s[idx].sum() + 1e-20) * 2.5
    routed = sum(wj * _swiglu_expert(t, e, x) for wj, e in zip(w, idx, strict=True))
    return routed + _mlp(t, "shared_experts.", x)


def ref_minimax_m2(t, cfg, x, tid):
    s = sigmoid(t["gate.weight"] @ x)
    idx = _top_k(s + t["e_score_correction_bias"], cfg.top_k)
    w = s[idx] / s[idx].sum()
    return sum(wj * _swiglu_expert(t, e, x) for wj, e in zip(w, idx, strict=True))


def _step_expert(t, e, x, limit):
    gu = t["experts.gate_up_proj"][e] @ x
    n = t["experts.down_proj"].shape[2]
    return t["experts.down_proj"][e] @ (np.minimum(silu(gu[:n]), limit) * np.clip(gu[n:], -limit, limit))


def ref_step3p7(t, cfg, x, tid, limit=0.8, shared_limit=1.5, scale=1.7):
    s = sigmoid(t["gate.weight"] @ x)
    idx = _top_k(s + t["gate.e_score_correction_bias"], cfg.top_k)
    w = s[idx] / s[idx].sum()
    routed = sum(wj * _step_expert(t, e, x, limit) for wj, e in zip(w, idx, strict=True))
    g, u, d = (t[f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    shared = d @ (np.minimum(silu(g @ x), shared_limit) * np.clip(u @ x, -shared_limit, shared_limit))
    return routed * scale + shared


def ref_longcat_flash(t, cfg, x, tid):
    p = softmax(t["router.classifier.weight"] @ x)  # over routed + zero experts; classifier bias ignored
    idx = _top_k(p + t["router.e_score_correction_bias"], cfg.top_k)
    w = p[idx] * 6.0
    E = cfg.num_experts
    return sum(wj * (_swiglu_expert(t, e, x) if e < E else x) for wj, e in zip(w, idx, strict=True))


def _v4_clamped(gate, up, limit):
    return silu(np.minimum(gate, limit)) * np.clip(up, -limit, limit)


def ref_deepseek_v4(t, cfg, x, tid, limit=1.0):
    s = np.sqrt(softplus(t["gate.weight"] @ x))
    # Hash layers take the experts from the token-id table, top-k layers from the biased scores.
    idx = t["gate.tid2eid"][tid] if cfg.hash_routing else _top_k(s + t["gate.e_score_correction_bias"], cfg.top_k)
    w = s[idx] / (s[idx].sum() + 1e-20) * 1.5
    n = cfg.intermediate_size
    routed = 0
    for wj, e in zip(w, idx, strict=True):
        gu = t["experts.gate_up_proj"][e] @ x
        routed = routed + wj * (t["experts.down_proj"][e] @ _v4_clamped(gu[:n], gu[n:], limit))
    g, u, d = (t[f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    return routed + d @ _v4_clamped(g @ x, u @ x, limit)


def ref_gemma4(t, cfg, r, tid, eps=1e-6):
    n = r / np.sqrt(np.mean(r**2) + eps)
    z = n * t["router.scale"] * len(r) ** -0.5
    p = softmax(t["router.proj.weight"] @ z)
    idx = _top_k(p, cfg.top_k)
    w = p[idx] / p[idx].sum() * t["router.per_expert_scale"][idx]
    x_e = n * t["pre_feedforward_layernorm_2.weight"]
    return sum(wj * _swiglu_expert(t, e, x_e, gelu_tanh) for wj, e in zip(w, idx, strict=True))


def ref_gpt_oss(t, cfg, x, tid, limit=1.5, alpha=1.702):
    logits = t["router.weight"] @ x + t["router.bias"]
    idx = _top_k(logits, cfg.top_k)
    w = softmax(logits[idx])  # softmax after top-k
    out = 0
    for wj, e in zip(w, idx, strict=True):
        gu = x @ t["experts.gate_up_proj"][e] + t["experts.gate_up_proj_bias"][e]  # [E, H, 2I] transposed
        gate, up = np.minimum(gu[0::2], limit), np.clip(gu[1::2], -limit, limit)  # interleaved
        h = (up + 1) * (gate * sigmoid(alpha * gate))
        out = out + wj * (h @ t["experts.down_proj"][e] + t["experts.down_proj_bias"][e])
    return out


def ref_llama4(t, cfg, x, tid):
    logits = t["router.weight"] @ x
    idx = _top_k(logits, cfg.top_k)
    n = cfg.intermediate_size
    out = _mlp(t, "shared_expert.", x)
    for e in idx:
        x_e = sigmoid(logits[e]) * x  # the score scales the expert input
        gu = x_e @ t["experts.gate_up_proj"][e]  # [E, H, 2I] transposed, concatenated halves
        out = out + (gu[n:] * silu(gu[:n])) @ t["experts.down_proj"][e]
    return out


# -- HF tensors built from FAMILIES.md ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    cfg: moejax.MoEConfig
    fused: dict  # transformers in-memory layout (what the oracle reads)
    other: dict  # the other layout of the same weights (per-expert / on-disk)
    oracle: object
    token_ids: np.ndarray | None = None


def _experts(rng, E, n=I):
    """Per-expert Linear weights [out, in]: gate [E, I, H], up [E, I, H], down [E, H, I]."""
    return normal(rng, E, n, H), normal(rng, E, n, H), normal(rng, E, H, n)


def _fuse(gate, up, down):
    """The qwen2_moe / mixtral conversion pattern (§0.5): gate rows then up rows, stacked over experts."""
    return {"experts.gate_up_proj": np.concatenate([gate, up], axis=1), "experts.down_proj": down}


def _split(gate, up, down, names=("gate_proj", "up_proj", "down_proj")):
    keys = {}
    for e in range(len(gate)):
        for name, w in zip(names, (gate[e], up[e], down[e]), strict=True):
            keys[f"experts.{e}.{name}.weight"] = w
    return keys


def _mlp_keys(rng, prefix, n, names=("gate_proj", "up_proj", "down_proj")):
    g, u, d = normal(rng, n, H), normal(rng, n, H), normal(rng, H, n)
    return {f"{prefix}{names[0]}.weight": g, f"{prefix}{names[1]}.weight": u, f"{prefix}{names[2]}.weight": d}


def _rename(keys, old, new):
    return {k.replace(old, new, 1): v for k, v in keys.items()}


def case_mixtral(rng):
    cfg = hf.config_from_hf({"model_type": "mixtral", "hidden_size": H, "num_local_experts": 6, "intermediate_size": I})
    gate, up, down = _experts(rng, 6)
    router = {"gate.weight": normal(rng, 6, H)}
    return Case(cfg, router | _fuse(gate, up, down), router | _split(gate, up, down, ("w1", "w3", "w2")), ref_mixtral)


def case_qwen2_moe(rng):
    hf_config = {"model_type": "qwen2_moe", "hidden_size": H, "num_experts": 6, "num_experts_per_tok": 3}
    cfg = hf.config_from_hf(hf_config | {"moe_intermediate_size": I, "shared_expert_intermediate_size": 12})
    gate, up, down = _experts(rng, 6)
    common = {"gate.weight": normal(rng, 6, H), "shared_expert_gate.weight": normal(rng, 1, H)}
    common |= _mlp_keys(rng, "shared_expert.", 12)
    return Case(cfg, common | _fuse(gate, up, down), common | _split(gate, up, down), ref_qwen2_moe)


def case_deepseek_v3(rng):
    hf_config = {"model_type": "deepseek_v3", "hidden_size": H, "n_routed_experts": 8, "num_experts_per_tok": 3}
    hf_config |= {"n_group": 4, "topk_group": 2, "moe_intermediate_size": I, "n_shared_experts": 2}
    cfg = hf.config_from_hf(hf_config, layer_idx=3)
    gate, up, down = _experts(rng, 8)
    common = {"gate.weight": normal(rng, 8, H), "gate.e_score_correction_bias": normal(rng, 8, scale=0.2)}
    common |= _mlp_keys(rng, "shared_experts.", 2 * I)
    return Case(cfg, common | _fuse(gate, up, down), common | _split(gate, up, down), ref_deepseek_v3)


def case_minimax_m2(rng):
    hf_config = {"model_type": "minimax_m2", "hidden_size": H, "num_local_experts": 6, "intermediate_size": I}
    cfg = hf.config_from_hf(hf_config | {"num_experts_per_tok": 2})
    gate, up, down = _experts(rng, 6)
    common = {"gate.weight": normal(rng, 6, H), "e_score_correction_bias": normal(rng, 6, scale=0.2)}
    return Case(
        cfg, common | _fuse(gate, up, down), common | _split(gate, up, down, ("w1", "w3", "w2")), ref_minimax_m2
    )


def case_step3p7(rng):
    text = {"model_type": "step3p5", "hidden_size": H, "moe_num_experts": 6, "moe_top_k": 2}
    text |= {"moe_intermediate_size": I, "share_expert_dim": 12, "moe_router_scaling_factor": 1.7}
    text |= {"swiglu_limits": [None, 0, 0.8], "swiglu_limits_shared": [None, None, 1.5]}
    text |= {"mlp_layer_types": ["dense", "sparse", "sparse"]}
    cfg = hf.config_from_hf({"model_type": "step3p7", "text_config": text}, layer_idx=2)
    gate, up, down = _experts(rng, 6)
    W, b = normal(rng, 6, H), normal(rng, 6, scale=0.2)
    shared = _mlp_keys(rng, "shared_experts.", 12)
    fused = {"gate.weight": W, "gate.e_score_correction_bias": b} | _fuse(gate, up, down) | shared
    # On disk (own step3p7 mapping): keys relative to the decoder layer, experts stacked [E, I, H].
    disk = {"moe.gate.weight": W, "moe.router_bias": b, "moe.gate_proj.weight": gate, "moe.up_proj.weight": up}
    disk |= {"moe.down_proj.weight": down} | _rename(shared, "shared_experts.", "share_expert.")
    disk |= {"self_attn.q_proj.weight": normal(rng, H, H), "input_layernorm.weight": normal(rng, H)}
    return Case(cfg, fused, disk, ref_step3p7)


def case_longcat_flash(rng):
    hf_config = {"model_type": "longcat_flash", "hidden_size": H, "n_routed_experts": 6, "zero_expert_num": 2}
    cfg = hf.config_from_hf(hf_config | {"moe_topk": 3, "expert_ffn_hidden_size": I})
    gate, up, down = _experts(rng, 6)
    bias = normal(rng, 8, scale=0.05)
    bias[6:] += 0.2  # make the zero (identity) experts win often
    common = {"router.classifier.weight": normal(rng, 8, H), "router.e_score_correction_bias": bias}
    common["router.classifier.bias"] = normal(rng, 8)  # exists, never applied
    # In memory gate_up_proj has rows for the zero experts too (never used): fill them with garbage.
    fused = common | _fuse(np.concatenate([gate, normal(rng, 2, I, H)]), np.concatenate([up, up[:2]]), down)
    return Case(cfg, fused, common | _split(gate, up, down), ref_longcat_flash)


def _case_deepseek_v4(rng, layer):
    hf_config = {"model_type": "deepseek_v4", "hidden_size": H, "n_routed_experts": 6, "num_experts_per_tok": 2}
    hf_config |= {"moe_intermediate_size": I, "swiglu_limit": 1.0, "vocab_size": 20}
    cfg = hf.config_from_hf(hf_config | {"mlp_layer_types": ["hash_moe", "moe"]}, layer_idx=layer)
    gate, up, down = _experts(rng, 6)
    W = normal(rng, 6, H)
    shared = _mlp_keys(rng, "shared_experts.", I)
    fused = {"gate.weight": W} | _fuse(gate, up, down) | shared
    disk = {"gate.weight": W} | _split(gate, up, down, ("w1", "w3", "w2"))
    disk |= {f"shared_experts.{new}.weight": shared[f"shared_experts.{old}.weight"] for old, new in _V4_SHARED}
    token_ids = None
    if cfg.hash_routing:
        table = np.stack([rng.permutation(6)[:2] for _ in range(20)]).astype(np.int64)
        fused["gate.tid2eid"] = disk["gate.tid2eid"] = table
        token_ids = rng.integers(0, 20, size=7)
    else:
        bias = normal(rng, 6, scale=0.2)
        fused["gate.e_score_correction_bias"], disk["gate.bias"] = bias, bias
    return Case(cfg, fused, disk, ref_deepseek_v4, token_ids)


_V4_SHARED = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def case_gemma4(rng):
    text = {"model_type": "gemma4_text", "hidden_size": H, "enable_moe_block": True, "num_experts": 6}
    cfg = hf.config_from_hf(
        {"model_type": "gemma4", "text_config": text | {"top_k_experts": 2, "moe_intermediate_size": I}}
    )
    gate, up, down = _experts(rng, 6)
    common = {
        "router.proj.weight": normal(rng, 6, H, scale=2.0),
        "router.scale": 1 + normal(rng, H, scale=0.2),
        "router.per_expert_scale": 1 + normal(rng, 6, scale=0.2),
        "pre_feedforward_layernorm_2.weight": 1 + normal(rng, H, scale=0.2),
    }
    # The rest of the decoder layer, which params_from_hf must ignore by name.
    common |= _mlp_keys(rng, "mlp.", 24) | {"layer_scalar": np.ones((1,), np.float32)}
    for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_feedforward_layernorm_1"):
        common[f"{norm}.weight"] = normal(rng, H)
    common["post_feedforward_layernorm_2.weight"] = normal(rng, H)
    common["self_attn.q_proj.weight"] = normal(rng, H, H)
    return Case(cfg, common | _fuse(gate, up, down), common | _split(gate, up, down), ref_gemma4)


def case_gpt_oss(rng):
    hf_config = {"model_type": "gpt_oss", "hidden_size": H, "num_local_experts": 6, "num_experts_per_tok": 2}
    cfg = hf.config_from_hf(hf_config | {"intermediate_size": I, "swiglu_limit": 1.5})
    gate, up, down = _experts(rng, 6)
    gate_b, up_b, down_b = normal(rng, 6, I), normal(rng, 6, I), normal(rng, 6, H)
    common = {"router.weight": normal(rng, 6, H), "router.bias": normal(rng, 6)}
    gate_up = np.empty((6, H, 2 * I), np.float32)  # transposed [E, H, 2I], gate in even columns, up in odd
    gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    bias = np.empty((6, 2 * I), np.float32)
    bias[:, 0::2], bias[:, 1::2] = gate_b, up_b
    fused = common | {"experts.gate_up_proj": gate_up, "experts.gate_up_proj_bias": bias}
    fused |= {"experts.down_proj": down.transpose(0, 2, 1), "experts.down_proj_bias": down_b}
    per_expert = common | _split(gate, up, down)
    for e in range(6):
        per_expert |= {f"experts.{e}.gate_proj.bias": gate_b[e], f"experts.{e}.up_proj.bias": up_b[e]}
        per_expert[f"experts.{e}.down_proj.bias"] = down_b[e]
    return Case(cfg, fused, per_expert, ref_gpt_oss)


def case_llama4(rng):
    text = {"model_type": "llama4_text", "hidden_size": H, "num_local_experts": 6, "num_experts_per_tok": 2}
    cfg = hf.config_from_hf({"model_type": "llama4", "text_config": text | {"intermediate_size": I}})
    gate, up, down = _experts(rng, 6)
    common = {"router.weight": normal(rng, 6, H)} | _mlp_keys(rng, "shared_expert.", I)
    gate_up = np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=-1)  # [E, H, 2I]
    fused = common | {"experts.gate_up_proj": gate_up, "experts.down_proj": down.transpose(0, 2, 1)}
    return Case(cfg, fused, common | _split(gate, up, down), ref_llama4)


CASES = {
    "mixtral": case_mixtral,
    "qwen2_moe": case_qwen2_moe,
    "deepseek_v3": case_deepseek_v3,
    "minimax_m2": case_minimax_m2,
    "step3p7": case_step3p7,
    "longcat_flash": case_longcat_flash,
    "deepseek_v4_topk": lambda rng: _case_deepseek_v4(rng, 1),
    "deepseek_v4_hash": lambda rng: _case_deepseek_v4(rng, 0),
    "gemma4": case_gemma4,
    "gpt_oss": case_gpt_oss,
    "llama4": case_llama4,
}


def _forward(params, case, x):
    tid = None if case.token_ids is None else jnp.asarray(case.token_ids, jnp.int32)
    return np.asarray(moejax.moe_forward(params, jnp.asarray(x), case.cfg, tid, impl="reference"))


def _oracle(case, x):
    fused = {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else v for k, v in case.fused.items()}
    return _rows(lambda row, tid: case.oracle(fused, case.cfg, row, tid), x, case.token_ids)


@pytest.mark.parametrize("name", CASES)
def test_both_layouts_match_the_oracle(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    case = CASES[name](rng)
    from_fused = hf.params_from_hf(case.fused, case.cfg)
    from_other = hf.params_from_hf(case.other, case.cfg)
    flat_fused, flat_other = flatten(from_fused), flatten(from_other)
    assert flat_fused.keys() == flat_other.keys()
    for key in flat_fused:
        np.testing.assert_array_equal(flat_fused[key], flat_other[key], err_msg=key)
    x = rng.standard_normal((7, H)).astype(np.float32)
    np.testing.assert_allclose(_forward(from_fused, case, x), _oracle(case, x), rtol=1e-4, atol=1e-4)


def test_longcat_case_uses_zero_experts():
    case = case_longcat_flash(np.random.default_rng(0))
    params = hf.params_from_hf(case.fused, case.cfg)
    x = np.random.default_rng(1).standard_normal((7, H)).astype(np.float32)
    routing = moejax.route(params, jnp.asarray(x), case.cfg)
    assert 0 < int((routing.indices >= case.cfg.num_experts).sum()) < routing.indices.size


def _swap_halves(case):
    """Exchange gate and up in the fused tensors: the oracle must then disagree with the loaded params."""
    t = dict(case.fused)
    gu = t["experts.gate_up_proj"]
    if case.cfg.activation is moejax.Activation.GPT_OSS:
        swapped = np.empty_like(gu)
        swapped[..., 0::2], swapped[..., 1::2] = gu[..., 1::2], gu[..., 0::2]
    elif case.cfg.weights_on_input:
        swapped = np.concatenate([gu[..., I:], gu[..., :I]], axis=-1)
    else:
        swapped = np.concatenate([gu[:, I:], gu[:, :I]], axis=1)
    t["experts.gate_up_proj"] = swapped
    return dataclasses.replace(case, fused=t)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "llama4"])
def test_swapped_gate_up_is_detected(name):
    rng = np.random.default_rng(7)
    case = CASES[name](rng)
    swapped = _swap_halves(case)
    x = rng.standard_normal((7, H)).astype(np.float32)
    got = _forward(hf.params_from_hf(swapped.fused, case.cfg), case, x)
    assert not np.allclose(got, _oracle(case, x), rtol=1e-3, atol=1e-3)


def test_dtypes_are_kept():
    case = case_deepseek_v3(np.random.default_rng(0))
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in case.fused.items()}
    bf16["gate.weight"] = case.fused["gate.weight"]  # DeepSeek keeps the router in float32
    params = hf.params_from_hf(bf16, case.cfg, layout="stacked")
    assert params.experts.gate.dtype == jnp.bfloat16
    assert params.shared.down.dtype == jnp.bfloat16
    assert params.router.kernel.dtype == jnp.float32
    assert params.router.correction_bias.dtype == jnp.float32
    hashed = _case_deepseek_v4(np.random.default_rng(0), 0)
    assert hf.params_from_hf(hashed.other, hashed.cfg).router.tid2eid.dtype == jnp.int32


def test_jax_arrays_and_array_likes_are_accepted():
    case = case_mixtral(np.random.default_rng(0))

    class ArrayLike:  # e.g. a torch CPU tensor: only __array__
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    as_jax = hf.params_from_hf({k: jnp.asarray(v) for k, v in case.fused.items()}, case.cfg)
    as_like = hf.params_from_hf({k: ArrayLike(v) for k, v in case.fused.items()}, case.cfg)
    jax.tree.map(np.testing.assert_array_equal, as_jax, as_like)


@pytest.mark.parametrize("family", moejax.FAMILIES)
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_params_to_hf_round_trip(family, layout):
    cfg = moejax.MoEConfig.preset(family, hidden_size=8, intermediate_size=4)
    if family == "deepseek_v4":
        cfg = cfg.replace(hash_routing=True, vocab_size=5, correction_bias=False)
    rng = np.random.default_rng(0)
    flat = {}  # numpy random values: init_params would compile a sampler per shape, slow on 2 cores
    for name, shape in expected_shapes(cfg).items():
        if name == "router.tid2eid":
            flat[name] = jnp.asarray(rng.integers(0, cfg.num_selectable, shape), jnp.int32)
        else:
            flat[name] = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    params = unflatten(flat)
    written = hf.params_to_hf(params, cfg, layout, family=family)
    back = hf.params_from_hf(written, cfg, layout="stacked", family=family)
    jax.tree.map(np.testing.assert_array_equal, params, back)
    # The per-expert (CPU) layout writes the same checkpoint and loads back per-expert.
    per_expert = with_experts_layout(params, "per_expert")
    chex.assert_trees_all_equal(hf.params_to_hf(per_expert, cfg, layout, family=family), written)
    chex.assert_trees_all_equal(hf.params_from_hf(written, cfg, layout="per_expert", family=family), per_expert)


# -- gpt-oss MXFP4 -------------------------------------------------------------------------------------------

_FP4 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def _dequant_loop(blocks, scales):
    """FAMILIES.md §14, one byte at a time: low nibble -> even position, high -> odd, × 2^(scale-127)."""
    E, R, B, _ = blocks.shape
    out = np.zeros((E, R, B * 32))
    for e, r, b, j in np.ndindex(blocks.shape):
        byte, factor = int(blocks[e, r, b, j]), 2.0 ** (int(scales[e, r, b]) - 127)
        out[e, r, b * 32 + 2 * j] = _FP4[byte & 15] * factor
        out[e, r, b * 32 + 2 * j + 1] = _FP4[byte >> 4] * factor
    return out


def test_gpt_oss_mxfp4_blocks():
    E, Hq, Iq = 2, 32, 32
    rng = np.random.default_rng(3)
    cfg = hf.config_from_hf(
        {
            "model_type": "gpt_oss",
            "hidden_size": Hq,
            "num_local_experts": E,
            "intermediate_size": Iq,
            "num_experts_per_tok": 1,
        }
    )
    gu_blocks = rng.integers(0, 256, (E, 2 * Iq, Hq // 32, 16), dtype=np.uint8)
    gu_scales = rng.integers(120, 130, (E, 2 * Iq, Hq // 32), dtype=np.uint8)
    dn_blocks = rng.integers(0, 256, (E, Hq, Iq // 32, 16), dtype=np.uint8)
    dn_scales = rng.integers(120, 130, (E, Hq, Iq // 32), dtype=np.uint8)
    common = {"router.weight": normal(rng, E, Hq), "router.bias": normal(rng, E)}
    common |= {"experts.gate_up_proj_bias": normal(rng, E, 2 * Iq), "experts.down_proj_bias": normal(rng, E, Hq)}
    quantized = common | {"experts.gate_up_proj_blocks": gu_blocks, "experts.gate_up_proj_scales": gu_scales}
    quantized |= {"experts.down_proj_blocks": dn_blocks, "experts.down_proj_scales": dn_scales}
    dense = common | {
        "experts.gate_up_proj": _dequant_loop(gu_blocks, gu_scales).transpose(0, 2, 1).astype(ml_dtypes.bfloat16),
        "experts.down_proj": _dequant_loop(dn_blocks, dn_scales).transpose(0, 2, 1).astype(ml_dtypes.bfloat16),
    }
    got, want = hf.params_from_hf(quantized, cfg, layout="stacked"), hf.params_from_hf(dense, cfg, layout="stacked")
    assert got.experts.scheme.kind == "mxfp4" and got.experts.gate_q.dtype == jnp.uint8  # read as the MXFP4 format
    dense_got = moejax.dequantize(got)
    assert dense_got.experts.gate.dtype == jnp.float32
    want_f32 = jax.tree.map(lambda w: w.astype(jnp.float32), want.experts)
    jax.tree.map(np.testing.assert_array_equal, dense_got.experts, want_f32)
    jax.tree.map(np.testing.assert_array_equal, got.router, want.router)


# -- errors ----------------------------------------------------------------------------------------------------


def test_missing_key_names_key_and_shape():
    case = case_mixtral(np.random.default_rng(0))
    fused = {k: v for k, v in case.fused.items() if k != "experts.down_proj"}
    with pytest.raises(ValueError, match=r"missing key 'experts.down_proj'.*\(6, 16, 8\)"):
        hf.params_from_hf(fused, case.cfg)
    per_expert = {k: v for k, v in case.other.items() if k != "experts.5.w2.weight"}
    with pytest.raises(ValueError, match=r"missing key 'experts.5.w2.weight'.*\(16, 8\)"):
        hf.params_from_hf(per_expert, case.cfg)


def test_missing_alternative_keys_are_listed():
    case = case_minimax_m2(np.random.default_rng(0))
    fused = {k: v for k, v in case.fused.items() if k != "e_score_correction_bias"}
    with pytest.raises(ValueError, match=r"'gate.e_score_correction_bias' \(also accepted: 'e_score_corr.*\(6,\)"):
        hf.params_from_hf(fused, case.cfg)


def test_extra_key_names_key_and_shape():
    case = case_qwen2_moe(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"unexpected keys 'foo.weight' with shape \(3, 4\)"):
        hf.params_from_hf(case.fused | {"foo.weight": np.zeros((3, 4), np.float32)}, case.cfg)
    with pytest.raises(ValueError, match=r"unexpected keys 'experts.gate_up_proj' with shape \(6, 16, 16\)"):
        hf.params_from_hf(case.other | {"experts.gate_up_proj": case.fused["experts.gate_up_proj"]}, case.cfg)
    # Keys another family ignores are not ignored here.
    with pytest.raises(ValueError, match=r"unexpected keys 'mlp\.gate_proj\.weight'"):
        hf.params_from_hf(case.fused | {"mlp.gate_proj.weight": np.zeros((3, 4), np.float32)}, case.cfg)


def test_wrong_shape_names_key_and_both_shapes():
    case = case_gpt_oss(np.random.default_rng(0))
    bad = case.fused | {"router.weight": case.fused["router.weight"].T}
    with pytest.raises(ValueError, match=r"'router.weight': expected shape \(6, 16\), got \(16, 6\)"):
        hf.params_from_hf(bad, case.cfg)
    longcat = case_longcat_flash(np.random.default_rng(0))
    bad = longcat.fused | {"experts.gate_up_proj": longcat.fused["experts.gate_up_proj"][:5]}
    with pytest.raises(ValueError, match=r"expected shape \(6, 16, 16\) or \(8, 16, 16\), got \(5, 16, 16\)"):
        hf.params_from_hf(bad, longcat.cfg)


def test_quantized_keys_are_not_silently_dropped():
    case = case_deepseek_v3(np.random.default_rng(0))
    scales = {"experts.0.gate_proj.weight_scale_inv": np.ones((1, 1), np.float32)}
    with pytest.raises(NotImplementedError, match="weight_scale_inv"):
        hf.params_from_hf(case.other | scales, case.cfg)


def test_layout_found_from_the_keys_or_named_by_family():
    case = case_gpt_oss(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"holds no router key of any family's layout \(one of \['gate\.weight'"):
        hf.params_from_hf({"foo.weight": np.zeros((6, H), np.float32)}, case.cfg)
    with pytest.raises(ValueError, match=r"holds no router key of the llama4 layouts \(one of \['router\.weight'\]"):
        hf.params_from_hf({"gate.weight": case.fused["router.weight"]}, case.cfg, family="llama4")
    with pytest.raises(ValueError, match=r"unknown family 'gpt-oss'; known families: mixtral"):
        hf.params_from_hf(case.fused, case.cfg, family="gpt-oss")
    params = hf.params_from_hf(case.fused, case.cfg)
    with pytest.raises(ValueError, match=r"params_to_hf needs family= for this config.*router\.bias"):
        hf.params_to_hf(params, case.cfg)
    assert hf.params_to_hf(params, case.cfg, family="gpt_oss").keys() == case.fused.keys()


def test_hash_table_out_of_range():
    case = _case_deepseek_v4(np.random.default_rng(0), 0)
    bad = case.other | {"gate.tid2eid": case.other["gate.tid2eid"] + 6}
    with pytest.raises(ValueError, match=r"gate.tid2eid.*outside \[0, 6\)"):
        hf.params_from_hf(bad, case.cfg)


# -- safetensors ---------------------------------------------------------------------------------------------


def _write_sharded(tmp_path, per_layer, dtype=np.float32):
    """Three layers of a checkpoint split over two files, layer 1 straddling both, plus the index json."""
    tensors = {"model.embed_tokens.weight": np.ones((4, H), np.float32)}
    for layer, keys in enumerate(per_layer):
        tensors |= {f"model.layers.{layer}.mlp.{k}": v.astype(dtype) for k, v in keys.items()}
    tensors["model.layers.1.mlp_extra.weight"] = np.ones((2,), np.float32)  # shares the prefix text, not the dot
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    shards["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    assert any(k.startswith("model.layers.1.mlp.") for k in shards["model-00001-of-00002.safetensors"])
    assert any(k.startswith("model.layers.1.mlp.") for k in shards["model-00002-of-00002.safetensors"])
    for file, keys in shards.items():
        save_file({k: np.ascontiguousarray(tensors[k]) for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    weight_map["model.layers.9.mlp.gate.weight"] = "absent.safetensors"  # files without the layer are not opened
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [tmp_path / file for file in shards]


@pytest.fixture
def qwen_layers():
    rng = np.random.default_rng(0)
    return [case_qwen2_moe(rng) for _ in range(3)]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_load_safetensors_one_layer(tmp_path, qwen_layers, dtype):
    files = _write_sharded(tmp_path, [c.other for c in qwen_layers], dtype)
    cfg = qwen_layers[1].cfg
    want = hf.params_from_hf({k: v.astype(dtype) for k, v in qwen_layers[1].other.items()}, cfg, layout="stacked")
    for source in (tmp_path / "model.safetensors.index.json", tmp_path, files, str(tmp_path)):
        got = hf.load_safetensors(source, cfg, "model.layers.1.mlp", layout="stacked")
        assert got.experts.gate.dtype == jnp.dtype(dtype)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    by_keyword = hf.load_safetensors(files=tmp_path, cfg=cfg, prefix="model.layers.1.mlp.", layout="stacked")
    jax.tree.map(np.testing.assert_array_equal, by_keyword, want)
    # On a CPU backend the default is the per-expert layout, each expert's arrays their own buffers.
    got = hf.load_safetensors(tmp_path, cfg, "model.layers.1.mlp")
    assert isinstance(got.experts, moejax.weights.PerExpert)
    chex.assert_trees_all_equal(with_experts_layout(got, "stacked"), want)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float16, np.int64])
def test_read_file_returns_what_was_written(tmp_path, dtype):
    """bfloat16 / float8 come from the file bytes (safetensors' numpy reader fails on float8, and on bfloat16 in
    0.4), the other dtypes from safetensors: all equal, byte for byte, to what safetensors wrote."""
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(dtype), "b": rng.standard_normal((4,)).astype(dtype)}
    path = str(tmp_path / "x.safetensors")
    save_file(tensors, path)
    got = hf.files.read_file(path, ["b", "a"])
    for key, want in tensors.items():
        assert got[key].dtype == want.dtype
        np.testing.assert_array_equal(got[key].view(np.uint8), want.view(np.uint8))


def test_load_safetensors_unknown_prefix(tmp_path, qwen_layers):
    _write_sharded(tmp_path, [c.other for c in qwen_layers])
    with pytest.raises(ValueError, match=r"no tensors under prefix 'model\.layers\.7\.mlp\.'"):
        hf.load_safetensors(tmp_path, qwen_layers[0].cfg, "model.layers.7.mlp.")
