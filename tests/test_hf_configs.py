"""Every config.json in tests/fixtures/hf_configs (as transformers 5.24 saves them) maps to the right MoEConfig.

The expected values are read from each JSON under the exact field names transformers writes for that class,
never through `moejax.hf`, so a spelling moejax does not read shows up as a default instead of the JSON's value.
"""

import json
import pathlib

import pytest

import moejax
from moejax import hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf_configs"

# fixture -> (expert count, top-k, expert intermediate size, shared intermediate size or None, scoring): each a
# field name of the JSON's text part, or a function of it.
_SOFTMAX = lambda t: "softmax"  # scoring fixed by the family's code, no config field
_SIGMOID = lambda t: "sigmoid"


def _deepseek_shared(t):
    return t["moe_intermediate_size"] * t["n_shared_experts"]


_QWEN_SHARED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
EXPECTED = {
    "mixtral.json": ("num_local_experts", "num_experts_per_tok", "intermediate_size", None, _SOFTMAX),
    "qwen2moe.json": (*_QWEN_SHARED, _SOFTMAX),
    "qwen3moe.json": ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", None, _SOFTMAX),
    "qwen3next.json": (*_QWEN_SHARED, _SOFTMAX),
    "qwen3_5moe.json": (*_QWEN_SHARED, _SOFTMAX),
    "qwen3_5moetext.json": (*_QWEN_SHARED, _SOFTMAX),
    "deepseekv3.json": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", _deepseek_shared, _SIGMOID),
    "glm4moe.json": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", _deepseek_shared, _SIGMOID),
    "glmmoedsa.json": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", _deepseek_shared, _SIGMOID),
    "minimaxm2.json": ("num_local_experts", "num_experts_per_tok", "intermediate_size", None, _SIGMOID),
    "longcatflash.json": ("n_routed_experts", "moe_topk", "expert_ffn_hidden_size", None, _SOFTMAX),
    "deepseekv4.json": (
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_intermediate_size",
        lambda t: t["scoring_func"],
    ),
    "gptoss.json": ("num_local_experts", "num_experts_per_tok", "intermediate_size", None, _SOFTMAX),
    "llama4.json": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "intermediate_size", _SIGMOID),
    "llama4text.json": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "intermediate_size", _SIGMOID),
    "olmoe.json": ("num_experts", "num_experts_per_tok", "intermediate_size", None, _SOFTMAX),
    "step3p7.json": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "share_expert_dim", _SIGMOID),
    "step3p7text.json": (
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "share_expert_dim",
        _SIGMOID,
    ),
}
# Gemma-4's class default has no MoE block (enable_moe_block=False, sizes None); the MoE variant sets them.
GEMMA4 = ("gemma4.json", "gemma4text.json")
_GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704}


def _load(name):
    config = json.loads((FIXTURES / name).read_text())
    return config, config.get("text_config") or config


def _value(text, spec):
    return None if spec is None else spec(text) if callable(spec) else text[spec]


def test_every_fixture_is_checked():
    on_disk = {p.name for p in FIXTURES.glob("*.json")}
    assert on_disk == set(EXPECTED) | set(GEMMA4)
    listed = (FIXTURES / "README.md").read_text()
    assert all(f"`{name}`" in listed for name in on_disk)


def test_fixtures_cover_every_family():
    families = {hf.MODEL_TYPES[_load(name)[1]["model_type"]] for name in [*EXPECTED, *GEMMA4]}
    assert families == set(moejax.FAMILIES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_maps_to_its_own_values(name):
    config, text = _load(name)
    layers = hf.moe_layer_indices(config)
    assert layers and all(hf.is_moe_layer(config, i) for i in layers)
    experts, top_k, inter, shared, scoring = EXPECTED[name]
    for layer in (layers[0], layers[-1]):
        cfg = hf.config_from_hf(config, layer)
        assert cfg.hidden_size == text["hidden_size"]
        assert cfg.num_experts == _value(text, experts)
        assert cfg.top_k == _value(text, top_k)
        assert cfg.intermediate_size == _value(text, inter)
        if shared is None:
            assert cfg.shared_expert is moejax.SharedExpert.NONE
        else:
            assert cfg.shared_expert is not moejax.SharedExpert.NONE
            assert cfg.shared_intermediate_size == _value(text, shared)
        assert cfg.scoring.value == _value(text, scoring)


def test_fixture_layer_rules():
    """Which layers are MoE, from each JSON's own fields."""
    ds, _ = _load("deepseekv3.json")
    assert hf.moe_layer_indices(ds) == list(range(ds["first_k_dense_replace"], ds["num_hidden_layers"]))
    glm, _ = _load("glmmoedsa.json")
    assert hf.moe_layer_indices(glm) == [i for i, t in enumerate(glm["mlp_layer_types"]) if t == "sparse"]
    step, text = _load("step3p7.json")
    assert hf.moe_layer_indices(step) == [i for i, t in enumerate(text["mlp_layer_types"]) if t == "sparse"]
    llama, text = _load("llama4.json")
    assert hf.moe_layer_indices(llama) == text["moe_layers"]
    longcat, _ = _load("longcatflash.json")
    assert hf.moe_layer_indices(longcat) == list(range(longcat["num_layers"]))
    v4, _ = _load("deepseekv4.json")
    assert hf.config_from_hf(v4, 0).hash_routing and not hf.config_from_hf(v4, 3).hash_routing


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_fixture(name):
    config, text = _load(name)
    assert hf.moe_layer_indices(config) == []
    with pytest.raises(ValueError, match="enable_moe_block=False"):
        hf.config_from_hf(config)
    text.update(_GEMMA4_MOE)  # the MoE variant of the same class (text part updated in place)
    cfg = hf.config_from_hf(config, 0)
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k) == (text["hidden_size"], 128, 8)
    assert cfg.intermediate_size == 704 and cfg.router_prenorm and cfg.expert_prenorm
    assert hf.moe_layer_indices(config) == list(range(text["num_hidden_layers"]))


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_rms_norm_eps_is_the_configs_where_used_and_none_elsewhere(name):
    """Only Gemma-4's router and expert pre-norms read an RMSNorm epsilon: there it is config.json's (1e-6 in
    these files), elsewhere None, never a default that disagrees with the file (GLM-4.5 says 1e-5)."""
    config, text = _load(name)
    if name in GEMMA4:
        text.update(_GEMMA4_MOE)
    cfg = hf.config_from_hf(config, hf.moe_layer_indices(config)[0])
    if cfg.router_prenorm or cfg.expert_prenorm:
        assert cfg.rms_norm_eps == text["rms_norm_eps"]
        text["rms_norm_eps"] = 3e-5
        assert hf.config_from_hf(config, 0).rms_norm_eps == 3e-5
    else:
        assert cfg.rms_norm_eps is None, cfg.rms_norm_eps


@pytest.mark.parametrize(
    ("spellings", "expected"),
    [
        ({"num_local_experts": 8}, 8),  # transformers 5
        ({"num_experts": 8}, 8),  # hub configs before 5
        ({"num_experts": 8, "num_local_experts": 8}, 8),
    ],
)
def test_qwen3_moe_expert_count_spellings(spellings, expected):
    cfg = hf.config_from_hf({"model_type": "qwen3_moe", "hidden_size": 16, **spellings})
    assert cfg.num_experts == expected


def test_spellings_that_disagree_raise():
    with pytest.raises(ValueError, match=r"spells one field differently.*num_local_experts.*num_experts"):
        hf.config_from_hf({"model_type": "qwen3_moe", "hidden_size": 16, "num_local_experts": 8, "num_experts": 16})


@pytest.mark.parametrize(
    "hf_config",
    [
        {"model_type": "step3p5", "hidden_size": 16, "moe_num_experts": 12, "moe_top_k": 3, "moe_layers_enum": "3,4"},
        {
            "model_type": "deepseek_v3",
            "hidden_size": 16,
            "num_local_experts": 12,
            "num_experts_per_tok": 3,
            "n_group": 1,
            "topk_group": 1,
        },
        {"model_type": "gpt_oss", "hidden_size": 16, "num_experts": 12, "experts_per_token": 3},
        {"model_type": "longcat_flash", "hidden_size": 16, "num_local_experts": 12, "num_experts_per_tok": 3},
    ],
)
def test_hub_spellings(hf_config):
    cfg = hf.config_from_hf(hf_config, 3)
    assert (cfg.num_experts, cfg.top_k) == (12, 3)
