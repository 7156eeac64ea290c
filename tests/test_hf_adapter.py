"""`moejax.hf.load_adapter` / `save_adapter`: PEFT LoRA adapters of the MoE block.

Real data first: tests/fixtures/peft/<case>/ holds adapters written by peft 0.21 on tiny transformers 5 models
(tests/fixtures/peft/make_fixtures.py), with the block's weights before and after peft's `merge_and_unload` and
the block's outputs. Every adapter must give `base + ΔW == merged` on every weight of the block (targets the
adapter lacks unchanged), and `moe_forward(..., lora=)` with it must give torch's output.
Then synthetic adapter files written from the layout of docs/LORA.md for the error cases. No torch needed.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import hf, lora, moe_forward
from moejax.hf import adapter_config as adapter_mod

safetensors_numpy = pytest.importorskip("safetensors.numpy")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "peft")
CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
LAYER = 1


def _case(case):
    with open(os.path.join(FIXTURES, case, "config.json")) as f:
        cfg = hf.config_from_hf(json.load(f), LAYER)
    block = safetensors_numpy.load_file(os.path.join(FIXTURES, case, "block.safetensors"))
    part = lambda p: {k.removeprefix(p): v for k, v in block.items() if k.startswith(p)}
    base = hf.params_from_hf(part("base."), cfg, layout="stacked")
    merged = hf.params_from_hf(part("merged."), cfg, layout="stacked")
    return cfg, base, merged, block


def _field(params, name):
    """The moejax weight ([in, out]) a LoRA target adapts."""
    group, _, field = name.partition(".")
    return params.router.kernel if group == "router" else getattr(getattr(params, group), field)


def fold(params, adapter):
    """params with ΔW = s·B·A of each target added ([out, in] -> moejax's [in, out]), in float32 numpy."""
    for name, pair in adapter.pairs().items():
        delta = float(pair.scale) * np.einsum("...or,...ri->...io", np.asarray(pair.b), np.asarray(pair.a))
        w = np.asarray(_field(params, name), np.float32) + delta
        group, _, field = name.partition(".")
        if group == "router":
            params = dataclasses.replace(params, router=dataclasses.replace(params.router, kernel=w))
        else:
            sub = dataclasses.replace(getattr(params, group), **{field: w})
            params = dataclasses.replace(params, **{group: sub})
    return params


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _forward(params, x, cfg, stack, ids, impl="reference"):
    return moe_forward(params, x, cfg, impl=impl, lora=stack, adapter_ids=ids)


def test_fixture_cases_present():
    assert {"qwen3_moe_all", "qwen3_moe_down", "qwen2_moe_shared", "gpt_oss", "llama4"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_peft_fixture_delta_equals_merged(case):
    cfg, base, merged, _ = _case(case)
    adapter = hf.load_adapter(os.path.join(FIXTURES, case), cfg, LAYER)
    assert adapter.pairs(), case
    folded = fold(base, adapter)
    names = ["router", "experts.gate", "experts.up", "experts.down"]
    if cfg.shared_expert.value != "none":
        names += ["shared.gate", "shared.up", "shared.down"] + (
            ["shared.gate_kernel"] if base.shared.gate_kernel is not None else []
        )
    for name in names:
        got, want = np.asarray(_field(folded, name)), np.asarray(_field(merged, name))
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale, err_msg=f"{case}: {name}")
        if name not in adapter.pairs():  # untargeted weights are the base weights bit for bit
            np.testing.assert_array_equal(np.asarray(_field(base, name)), want, err_msg=f"{case}: {name}")


# qwen3_moe_all and qwen3_moe_down share one base model: test_peft_fixtures_mixed_batch runs them together
@pytest.mark.parametrize("case", [c for c in CASES if c not in ("qwen3_moe_all", "qwen3_moe_down")])
def test_peft_fixture_block_output(case):
    """`moe_forward(lora=, adapter_ids=)` with the loaded adapter gives torch's output with peft's merged weights,
    and with the adapter active (unmerged) too, except where peft's unmerged forward skips a target (LongCat's
    router); adapter id 0 gives the base block's output."""
    cfg, base, _, block = _case(case)
    if "x" not in block:
        pytest.skip(f"{case}: the fixture has no block output (Gemma-4's block is its whole decoder layer)")
    adapter = hf.load_adapter(os.path.join(FIXTURES, case), cfg, LAYER)
    x, T = block["x"], block["x"].shape[0]
    # one call: the adapter (id 1), no adapter (id 0), the adapter without its router (id 2)
    stack = lora.stack([adapter, dataclasses.replace(adapter, router=None)])
    ids = jnp.repeat(jnp.asarray([1, 0, 2], jnp.int32), T)
    out = np.asarray(_forward(base, jnp.asarray(np.concatenate([x, x, x])), cfg, stack, ids))
    got, got_base, got_no_router = out[:T], out[T : 2 * T], out[2 * T :]
    tol = lambda want: {"rtol": 1e-4, "atol": 1e-5 * np.abs(want).max()}
    assert np.abs(block["out.merged"] - block["out.base"]).max() > 100 * np.abs(got - block["out.merged"]).max()
    np.testing.assert_allclose(got, block["out.merged"], **tol(block["out.merged"]))
    np.testing.assert_allclose(got_base, block["out.base"], **tol(block["out.base"]))
    # LongcatFlashTopkRouter reads `classifier.weight` without calling the Linear, so peft's ParamWrapper (which
    # applies the delta around the wrapped module's forward) leaves the router unadapted until merged.
    unmerged = got_no_router if case == "longcat_flash" else got
    np.testing.assert_allclose(unmerged, block["out.adapter"], **tol(block["out.adapter"]))


def test_peft_fixtures_mixed_batch():
    """Two PEFT adapters of one base model in one batch (the xla plan): each row gets its adapter's output."""
    cfg, base, _, block_all = _case("qwen3_moe_all")
    _, base_down, _, block_down = _case("qwen3_moe_down")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), base, base_down))
    adapters = [hf.load_adapter(os.path.join(FIXTURES, c), cfg, LAYER) for c in ("qwen3_moe_all", "qwen3_moe_down")]
    x = jnp.asarray(block_all["x"])
    ids = jnp.asarray([1, 2, 0, 2, 1], jnp.int32)
    got = np.asarray(_forward(base, x, cfg, lora.stack(adapters), ids, impl="xla"))
    want = np.stack(
        [(block_all["out.base"], block_all["out.merged"], block_down["out.merged"])[i][r] for r, i in enumerate(ids)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_peft_layout_facts():
    """The layout on real files: nested wrappers, expert-major A / expert-minor B, patterns, rsLoRA."""
    path = os.path.join(FIXTURES, "qwen3_moe_all")
    cfg, *_ = _case("qwen3_moe_all")
    raw = safetensors_numpy.load_file(os.path.join(path, "adapter_model.safetensors"))
    mlp = "base_model.model.model.layers.1.mlp."
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    assert raw[mlp + "experts.base_layer.lora_A.weight"].shape == (4 * E, H)  # gate_up_proj, r=4: inner wrapper
    assert raw[mlp + "experts.base_layer.lora_B.weight"].shape == (2 * I, 4 * E)
    assert raw[mlp + "experts.lora_A.weight"].shape == (2 * E, I)  # down_proj, rank_pattern {"down_proj": 2}
    assert raw[mlp + "gate.lora_B.weight"].shape == (E, 4)
    adapter = hf.load_adapter(path, cfg, LAYER)
    a, b = raw[mlp + "experts.base_layer.lora_A.weight"], raw[mlp + "experts.base_layer.lora_B.weight"]
    e = 2
    np.testing.assert_array_equal(adapter.experts.gate.a[e], a[e * 4 : (e + 1) * 4])
    np.testing.assert_array_equal(adapter.experts.up.b[e], b[I:, e::E])
    assert float(adapter.router.scale) == 3 / 4  # alpha_pattern {"gate.weight": 3} on the parameter name
    assert float(adapter.experts.gate.scale) == 5 / 4
    assert float(adapter.experts.down.scale) == 8 / 2
    down = hf.load_adapter(os.path.join(FIXTURES, "qwen3_moe_down"), _case("qwen3_moe_down")[0], LAYER)
    assert set(down.pairs()) == {"experts.down"} and float(down.experts.down.scale) == pytest.approx(8 / 2)  # √4


def test_family_from_keys_and_explicit():
    """Without `auto_mapping` the family comes from the keys and cfg; an explicit family must fit."""
    cfg, *_ = _case("gpt_oss")
    path = os.path.join(FIXTURES, "gpt_oss")
    want = hf.load_adapter(path, cfg, LAYER)
    got = hf.load_adapter(path, cfg, LAYER, family="gpt_oss")
    np.testing.assert_array_equal(got.experts.gate.b, want.experts.gate.b)
    with pytest.raises(ValueError, match="unknown family"):
        hf.load_adapter(path, cfg, LAYER, family="nope")


# -- synthetic files from the spec ------------------------------------------------------------------------------

E, H, I, R = 4, 16, 8, 2
QWEN3 = {
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "num_experts": E,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": I,
    "num_hidden_layers": 2,
}
MLP = "base_model.model.model.layers.1.mlp."


def _cfg(**over):
    return hf.config_from_hf({**QWEN3, **over}, LAYER)


def _write(path, tensors, **config):
    os.makedirs(path, exist_ok=True)
    base = {"peft_type": "LORA", "r": R, "lora_alpha": 4, "target_parameters": ["experts.gate_up_proj"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(base | config, f)
    safetensors_numpy.save_file(
        {k: np.asarray(v, np.float32) for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors")
    )
    return path


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)


def _fused_files(prefix=MLP, r=R):
    return {
        prefix + "experts.lora_A.weight": _rand(r * E, H),
        prefix + "experts.lora_B.weight": _rand(2 * I, r * E),
        prefix + "gate.lora_A.weight": _rand(r, H),
        prefix + "gate.lora_B.weight": _rand(E, r),
        prefix.replace("mlp.", "self_attn.q_proj.") + "lora_A.weight": _rand(r, H),
        prefix.replace("mlp.", "self_attn.q_proj.") + "lora_B.weight": _rand(H, r),
    }


def test_spec_fused_delta(tmp_path):
    """ΔW[e] = s · B.reshape(out, r, E)[:, :, e] @ A.reshape(E, r, in)[e], gate rows first."""
    files = _fused_files()
    path = _write(tmp_path / "a", files, target_parameters=["experts.gate_up_proj", "gate.weight"], lora_alpha=3)
    got = hf.load_adapter(path, _cfg(), LAYER)
    A, B = files[MLP + "experts.lora_A.weight"], files[MLP + "experts.lora_B.weight"]
    for e in range(E):
        delta = 1.5 * B.reshape(2 * I, R, E)[:, :, e] @ A.reshape(E, R, H)[e]  # [2I, H]
        for target, rows in (("gate", delta[:I]), ("up", delta[I:])):
            pair = getattr(got.experts, target)
            got_rows = float(pair.scale) * np.asarray(pair.b[e] @ pair.a[e])
            np.testing.assert_allclose(got_rows, rows, rtol=1e-5, atol=1e-5)
    assert got.experts.down is None and got.router.b.shape == (E, R)


def test_per_expert_keys(tmp_path):
    """Adapters of transformers-4 models: per-expert nn.Linear targets (Mixtral's `block_sparse_moe.w1/w3/w2`)."""
    prefix = "base_model.model.model.layers.1.block_sparse_moe."
    files = {}
    for e in range(E):
        for name, (n_in, n_out) in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H))):
            files[f"{prefix}experts.{e}.{name}.lora_A.weight"] = _rand(R, n_in, seed=e)
            files[f"{prefix}experts.{e}.{name}.lora_B.weight"] = _rand(n_out, R, seed=e)
    cfg = hf.config_from_hf(
        {
            "model_type": "mixtral",
            "hidden_size": H,
            "num_local_experts": E,
            "num_experts_per_tok": 2,
            "intermediate_size": I,
        },
        LAYER,
    )
    path = _write(tmp_path / "a", files, target_modules=["w1", "w2", "w3"], target_parameters=None)
    got = hf.load_adapter(path, cfg, LAYER, family="mixtral")
    np.testing.assert_array_equal(got.experts.up.a[3], files[f"{prefix}experts.3.w3.lora_A.weight"])
    np.testing.assert_array_equal(got.experts.down.b[1], files[f"{prefix}experts.1.w2.lora_B.weight"])
    assert float(got.experts.gate.scale) == 2.0


def test_first_matching_pattern_wins(tmp_path):
    files = _fused_files(r=3)
    patterns = {"rank_pattern": {"gate_up_proj": 3, "experts.gate_up_proj": 5, "gate.weight": 3}}
    path = _write(tmp_path / "a", files, target_parameters=["experts.gate_up_proj", "gate.weight"], **patterns)
    got = hf.load_adapter(path, _cfg(), LAYER)
    assert got.experts.gate.rank == 3 and float(got.experts.gate.scale) == pytest.approx(4 / 3)
    assert adapter_mod._pattern({"proj": 1, "up_proj": 2}, "model.layers.1.mlp.experts.gate_up_proj", 0) == 0
    assert adapter_mod._pattern({"up_proj": 2}, "model.layers.1.mlp.experts.up_proj", 0) == 2


@pytest.mark.parametrize(
    "config, error, match",
    [
        ({"use_dora": True}, NotImplementedError, "use_dora"),
        ({"lora_bias": True}, NotImplementedError, "lora_bias"),
        ({"peft_type": "LOHA"}, NotImplementedError, "peft_type"),
        ({"layer_replication": [[0, 2]]}, NotImplementedError, "layer_replication"),
        ({"r": 4}, ValueError, r"gate\.lora_A\.weight has shape \(2, 16\), expected \(4, 16\)"),
        ({"target_parameters": ["experts.down_proj", "gate.weight"]}, ValueError, "expected"),
        ({"target_parameters": ["mlp.gate.weight"]}, ValueError, "names neither"),
    ],
)
def test_config_errors(tmp_path, config, error, match):
    path = _write(tmp_path / "a", _fused_files(), **config)
    with pytest.raises(error, match=match):
        hf.load_adapter(path, _cfg(), LAYER)


@pytest.mark.parametrize(
    "cfg_over, match",
    [
        ({"num_experts": 8}, r"gate\.lora_B\.weight has shape \(4, 2\), expected \(8, 2\)"),
        ({"hidden_size": 32}, r"gate.lora_A.weight has shape \(2, 16\), expected \(2, 32\)"),
        ({"moe_intermediate_size": 4}, r"lora_B.weight has shape \(16, 8\), expected \(8, 8\)"),
    ],
)
def test_shape_errors_name_key_and_shapes(tmp_path, cfg_over, match):
    path = _write(tmp_path / "a", _fused_files(), target_parameters=["experts.gate_up_proj", "gate.weight"])
    with pytest.raises(ValueError, match=match):
        hf.load_adapter(path, _cfg(**cfg_over), LAYER)


def test_expert_count_error_on_experts(tmp_path):
    files = {k: v for k, v in _fused_files().items() if ".gate." not in k}
    path = _write(tmp_path / "a", files)
    with pytest.raises(ValueError, match=r"experts\.lora_A\.weight has shape \(8, 16\), expected \(16, 16\).*E=8"):
        hf.load_adapter(path, _cfg(num_experts=8), LAYER)


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        hf.load_adapter(tmp_path / "missing", _cfg(), LAYER)
    path = _write(tmp_path / "a", _fused_files())
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    open(os.path.join(path, "adapter_model.bin"), "w").close()
    with pytest.raises(ValueError, match=r"adapter_model\.bin"):
        hf.load_adapter(path, _cfg(), LAYER)
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        hf.load_adapter(path, _cfg(), LAYER)


def test_layer_and_key_errors(tmp_path):
    files = _fused_files()
    path = _write(tmp_path / "a", files)
    with pytest.raises(ValueError, match=r"no weights for layer 0; it has layers \[1\]"):
        hf.load_adapter(path, _cfg(), 0)
    extra = files | {MLP + "experts.lora_magnitude_vector": _rand(2 * I)}
    with pytest.raises(ValueError, match=r"lora_magnitude_vector.*not a lora_A / lora_B"):
        hf.load_adapter(_write(tmp_path / "b", extra), _cfg(), LAYER)
    half = {k: v for k, v in files.items() if "gate.lora_B" not in k}
    with pytest.raises(ValueError, match=r"gate.lora_B.weight is missing"):
        hf.load_adapter(_write(tmp_path / "c", half), _cfg(), LAYER)
    unknown = files | {MLP + "foo.lora_A.weight": _rand(R, H), MLP + "foo.lora_B.weight": _rand(H, R)}
    with pytest.raises(ValueError, match=r"foo\.lora_A\.weight is not a LoRA target"):
        hf.load_adapter(_write(tmp_path / "d", unknown), _cfg(), LAYER)
    shared = files | {MLP + "shared_expert.up_proj.lora_A.weight": _rand(R, H)}
    shared[MLP + "shared_expert.up_proj.lora_B.weight"] = _rand(I, R)
    with pytest.raises(ValueError, match="shared expert, but cfg has none"):
        hf.load_adapter(_write(tmp_path / "e", shared), _cfg(), LAYER)
    attention_only = {k: v for k, v in files.items() if "self_attn" in k}
    assert hf.load_adapter(_write(tmp_path / "f", attention_only), _cfg(), LAYER).pairs() == {}


def test_save_load_round_trip(tmp_path):
    """save_adapter -> load_adapter gives the same ΔW (gate and up with different A: block-diagonal gate_up)."""
    cfg = hf.config_from_hf({**QWEN3, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 12}, LAYER)
    pair = lambda *shape, r, s, seed: lora.LoRAPair(
        jnp.asarray(_rand(*shape[:-2], r, shape[-1], seed=seed)),
        jnp.asarray(_rand(*shape[:-2], shape[-2], r, seed=seed + 1)),
        jnp.float32(s),
    )
    want = lora.LoRAParams(
        router=pair(E, H, r=2, s=0.5, seed=1),
        experts=lora.ExpertLoRA(
            gate=pair(E, I, H, r=3, s=2.0, seed=2),
            up=pair(E, I, H, r=1, s=2.0, seed=3),
            down=pair(E, H, I, r=2, s=1.0, seed=4),
        ),
        shared=lora.SharedLoRA(up=pair(12, H, r=2, s=0.25, seed=5), gate_kernel=pair(1, H, r=1, s=4.0, seed=6)),
    )
    for rslora in (False, True):
        path = tmp_path / f"rs{rslora}"
        hf.save_adapter(want, cfg, LAYER, path, family="qwen2_moe", use_rslora=rslora)
        got = hf.load_adapter(path, cfg, LAYER)
        assert set(got.pairs()) == set(want.pairs())
        for name, p in want.pairs().items():
            q = got.pairs()[name]
            dw = lambda p: float(p.scale) * np.einsum("...or,...ri->...oi", np.asarray(p.b), np.asarray(p.a))
            np.testing.assert_allclose(dw(q), dw(p), rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(NotImplementedError, match="gpt_oss"):
        hf.save_adapter(want, cfg, LAYER, tmp_path / "x", family="gpt_oss")
