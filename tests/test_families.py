"""Every family's MoE block against an independent float64 numpy model written from FAMILIES.md.

The numpy models below read only the parameter arrays (moejax layout: `x @ W`, gate and up apart) and follow
the numbered steps of each FAMILIES.md section; they never call moejax's routing or expert code. Each family's
special features are switched off one at a time in the numpy model ("ablations"), and a test asserts that the
ablated output is clearly different from moejax's, so a test fails if moejax drops the feature.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracles import assert_close, gelu_tanh, sigmoid, silu, softmax, softplus

import moejax
from moejax import MoEConfig
from moejax.params import flatten, with_experts_layout

FAMILIES = moejax.FAMILIES
T = 5  # tokens per test input: the decode plans for impl="xla" and "cpu" (their every-family check; test_plans.py)
VOCAB = 64  # rows of the DeepSeek-V4 hash table in the hash-routing case
IMPLS = ("reference", "xla", "cpu")  # "cpu" runs on the per-expert layout
CASES = (*FAMILIES, "deepseek_v4_hash")
TOL = 2e-5  # moejax float32 vs numpy float64, relative to max(1, max |out|)
MIN_SEP = 1e-3  # an ablation must move the output by at least this (relative), i.e. >> TOL


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _moejax_jit(params, x, token_ids, cfg, impl):
    # one compiled program per (config, impl) for the output and the routing: compiles dominate the run time
    return moejax.moe_forward(params, x, cfg, token_ids, impl=impl), moejax.route(params, x, cfg, token_ids)


def _moejax(params, x, cfg, token_ids=None, impl="reference"):
    """moejax's block output `[T, H]` and its `Routing` (the CPU plans on the per-expert layout of `params`)."""
    if impl == "cpu":
        params = with_experts_layout(params, "per_expert")
    return _moejax_jit(params, x, token_ids, cfg=cfg, impl=impl)


# --------------------------------------------------------------------------------------------------------------
# numpy math (FAMILIES.md §0.1)
# --------------------------------------------------------------------------------------------------------------


_erf = np.vectorize(math.erf)


def _gelu_erf(z):
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def _sqrtsoftplus(z):
    return np.sqrt(softplus(z))


def _rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _topk(v, k, margins=None):
    """Indices of the k largest entries per row; records the gap between the k-th and (k+1)-th in `margins`."""
    order = np.argsort(-v, axis=-1, kind="stable")
    if margins is not None and k < v.shape[-1]:
        s = np.take_along_axis(v, order, -1)
        margins.append(float(np.min(s[..., k - 1] - s[..., k])))
    return order[..., :k]


def _take(v, idx):
    return np.take_along_axis(v, idx, -1)


ACTS = {"silu": silu, "gelu_tanh": gelu_tanh, "gelu_erf": _gelu_erf}


def _swiglu(x, gate_w, up_w, down_w, act="silu", limit=None, clamp="before", clamp_up=True):
    """§0.2 expert `down · (act(gate) ⊙ up)` with the clamped variants of §10 (after) and §12 (before)."""
    gate = x @ gate_w
    up = x @ up_w
    f = ACTS[act]
    if limit is not None and clamp_up:
        up = np.clip(up, -limit, limit)
    if limit is None:
        h = f(gate) * up
    elif clamp == "before":  # DeepSeek-V4: silu(min(gate, L))
        h = f(np.minimum(gate, limit)) * up
    else:  # Step-3.7: min(silu(gate), L)
        h = np.minimum(f(gate), limit) * up
    return h @ down_w


@dataclasses.dataclass
class NP:
    out: np.ndarray  # [T, H]
    idx: np.ndarray  # [T, K] selected ids (N-space: ids >= E are zero experts)
    w: np.ndarray  # [T, K] routing weight of each slot (what moejax.route reports)
    info: dict = dataclasses.field(default_factory=dict)


def _routed_sum(p, x, idx, w, num_experts, zero="identity", x_in=None, **expert_kw):
    """`Σ_j w_j · y_{idx_j}(x)`; ids >= num_experts are LongCat zero experts (`y = x`). `x_in` scales inputs
    instead (Llama-4: `Σ_j Expert_{idx_j}(s_j · x)`, w ignored)."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= num_experts:
                if zero == "identity":
                    out[t] += w[t, j] * x[t]
                continue
            xi = x[t : t + 1] if x_in is None else x_in[t : t + 1, j]
            y = _swiglu(xi, p["experts.gate"][e], p["experts.up"][e], p["experts.down"][e], **expert_kw)[0]
            out[t] += (1.0 if x_in is not None else w[t, j]) * y
    return out


def _shared_mlp(p, x, **kw):
    return _swiglu(x, p["shared.gate"], p["shared.up"], p["shared.down"], **kw)


# --------------------------------------------------------------------------------------------------------------
# numpy models, one per family (section numbers of FAMILIES.md)
# --------------------------------------------------------------------------------------------------------------
def np_softmax_topk(p, x, cfg, *, renorm, shared, margins=None):
    """§1 Mixtral, §2 Qwen2-MoE, §3 Qwen3-MoE, §4 Qwen3-Next, §5 Qwen3.5-MoE, §16 OLMoE.

    softmax over E → top-k of probs → `v/Σv` iff renorm (no eps); shared: None | "gated" (`sigmoid(x·w_sg)·s`) |
    "ungated"."""
    prob = softmax(x @ p["router.kernel"])
    idx = _topk(prob, cfg.top_k, margins)
    w = _take(prob, idx)
    if renorm:
        w = w / w.sum(-1, keepdims=True)
    out = _routed_sum(p, x, idx, w, cfg.num_experts)
    if shared == "gated":
        out = out + sigmoid(x @ p["shared.gate_kernel"]) * _shared_mlp(p, x)
    elif shared == "ungated":
        out = out + _shared_mlp(p, x)
    return NP(out, idx, w)


def np_mixtral(p, x, cfg, token_ids=None, margins=None, renorm=True):
    """§1: always renormalised."""
    return np_softmax_topk(p, x, cfg, renorm=renorm, shared=None, margins=margins)


def np_qwen2_moe(p, x, cfg, token_ids=None, margins=None, renorm=None, shared="gated"):
    """§2: renorm iff norm_topk_prob (= cfg.normalize); sigmoid-gated shared expert. §4 Qwen3-Next: identical."""
    renorm = cfg.normalize if renorm is None else renorm
    return np_softmax_topk(p, x, cfg, renorm=renorm, shared=shared, margins=margins)


def np_qwen3_moe(p, x, cfg, token_ids=None, margins=None, renorm=None):
    """§3 (and §16 OLMoE): renorm iff norm_topk_prob, no shared expert."""
    renorm = cfg.normalize if renorm is None else renorm
    return np_softmax_topk(p, x, cfg, renorm=renorm, shared=None, margins=margins)


def np_qwen3_5_moe(p, x, cfg, token_ids=None, margins=None, renorm=True, shared="gated"):
    """§5: always renormalised, sigmoid-gated shared expert."""
    return np_softmax_topk(p, x, cfg, renorm=renorm, shared=shared, margins=margins)


def np_deepseek_v3(
    p,
    x,
    cfg,
    token_ids=None,
    margins=None,
    bias=True,
    groups=True,
    fill=-np.inf,
    group_score="top2",
    renorm=None,
    eps=1e-20,
    rsf=None,
    shared=True,
):
    """§6 (and §7 GLM-4.5, §8 GLM-5): sigmoid, bias for selection only, group-limited top-k (top-2 sum per group,
    -inf mask), `w = s[idx]`, `/(Σ+1e-20)` iff norm_topk_prob, `× routed_scaling_factor`, ungated shared."""
    s = sigmoid(x @ p["router.kernel"])
    c = s + p["router.correction_bias"] if bias else s.copy()
    G, kg = cfg.n_group, cfg.topk_group
    info = {"biased": c.copy()}
    if groups and G > 1:
        grouped = c.reshape(c.shape[0], G, -1)
        if group_score == "top2":
            gs = np.sort(grouped, -1)[..., -2:].sum(-1)
        elif group_score == "max":
            gs = grouped.max(-1)
        else:
            gs = grouped.sum(-1)
        kept = _topk(gs, kg, margins)
        keep = np.zeros(gs.shape, bool)
        np.put_along_axis(keep, kept, True, -1)
        c = np.where(keep[:, :, None], grouped, fill).reshape(c.shape)
        info["keep"] = keep
    idx = _topk(c, cfg.top_k, margins)
    w = _take(s, idx)
    if cfg.normalize if renorm is None else renorm:
        w = w / (w.sum(-1, keepdims=True) + eps)
    w = w * (cfg.routed_scaling_factor if rsf is None else rsf)
    out = _routed_sum(p, x, idx, w, cfg.num_experts)
    if shared:
        out = out + _shared_mlp(p, x)
    return NP(out, idx, w, info)


def np_minimax_m2(p, x, cfg, token_ids=None, margins=None, bias=True, renorm=True):
    """§9: sigmoid, top-k of s+b (selection only), `w = s[idx]/Σ` (no eps, no scaling), no groups, no shared."""
    s = sigmoid(x @ p["router.kernel"])
    idx = _topk(s + p["router.correction_bias"] if bias else s, cfg.top_k, margins)
    w = _take(s, idx)
    if renorm:
        w = w / w.sum(-1, keepdims=True)
    return NP(_routed_sum(p, x, idx, w, cfg.num_experts), idx, w)


def np_step3p7(
    p,
    x,
    cfg,
    token_ids=None,
    margins=None,
    bias=True,
    renorm=True,
    clamp="after",
    limit=...,
    shared_limit=...,
    rsf=None,
):
    """§10: MiniMax router; experts `min(silu(g), L) ⊙ clamp(u, ±L)`; `out = routed · rsf + shared(x)` with the
    shared expert's own limit. The scaling is on the routed sum: the weights stay `s[idx]/Σ`."""
    limit = cfg.swiglu_limit if limit is ... else limit
    shared_limit = cfg.shared_swiglu_limit if shared_limit is ... else shared_limit
    s = sigmoid(x @ p["router.kernel"])
    idx = _topk(s + p["router.correction_bias"] if bias else s, cfg.top_k, margins)
    w = _take(s, idx)
    if renorm:
        w = w / w.sum(-1, keepdims=True)
    routed = _routed_sum(p, x, idx, w, cfg.num_experts, limit=limit, clamp=clamp)
    rsf = cfg.routed_scaling_factor if rsf is None else rsf
    out = routed * rsf + _shared_mlp(p, x, limit=shared_limit, clamp="after")
    return NP(out, idx, w)


def np_longcat_flash(
    p, x, cfg, token_ids=None, margins=None, bias=True, zero="identity", renorm=False, rsf_on_zero=True
):
    """§11: softmax over E + Z, top-k of p+b, `w = p[idx] · rsf` (no renorm); zero experts give `w · x`."""
    prob = softmax(x @ p["router.kernel"])
    idx = _topk(prob + p["router.correction_bias"] if bias else prob, cfg.top_k, margins)
    w = _take(prob, idx)
    if renorm:
        w = w / w.sum(-1, keepdims=True)
    rsf = cfg.routed_scaling_factor
    if rsf_on_zero:
        w = w * rsf
        out = _routed_sum(p, x, idx, w, cfg.num_experts, zero=zero)
    else:  # scaling applied to the real experts' sum only (wrong)
        real = idx < cfg.num_experts
        out = _routed_sum(p, x, idx, np.where(real, w * rsf, w), cfg.num_experts, zero=zero)
    return NP(out, idx, w)


def np_deepseek_v4(
    p,
    x,
    cfg,
    token_ids=None,
    margins=None,
    scoring="sqrtsoftplus",
    bias=True,
    renorm=True,
    clamp="before",
    clamp_up=True,
    shared_clamp=True,
    limit=...,
    rsf=None,
):
    """§12: `s = sqrt(softplus(logits))`; TopK: top-k of s+b; Hash: `idx = tid2eid[token_ids]`;
    `w = s[idx]/(Σ+1e-20) · rsf`; experts and the (ungated) shared expert clamp `min(gate, L)` before silu and
    `clamp(up, ±L)`."""
    limit = cfg.swiglu_limit if limit is ... else limit
    logits = x @ p["router.kernel"]
    s = {"sqrtsoftplus": _sqrtsoftplus, "sigmoid": sigmoid, "softplus": softplus}[scoring](logits)
    if cfg.hash_routing:
        idx = p["router.tid2eid"][np.asarray(token_ids)].astype(np.int64)
    else:
        idx = _topk(s + p["router.correction_bias"] if bias else s, cfg.top_k, margins)
    w = _take(s, idx)
    if renorm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * (cfg.routed_scaling_factor if rsf is None else rsf)
    kw = {"limit": limit, "clamp": clamp, "clamp_up": clamp_up}
    out = _routed_sum(p, x, idx, w, cfg.num_experts, **kw)
    out = out + _shared_mlp(p, x, **(kw if shared_clamp else {}))
    return NP(out, idx, w)


def np_gemma4(
    p,
    x,
    cfg,
    token_ids=None,
    margins=None,
    router_prenorm=True,
    inv_sqrt_h=True,
    per_expert_scale=True,
    expert_prenorm=True,
    renorm=True,
    act="gelu_tanh",
):
    """§13: router input `rmsnorm(r) ⊙ scale · H^-1/2`; softmax; top-k; `/Σ`; `× per_expert_scale[idx]`;
    experts see `rmsnorm(r) ⊙ w` (weight used directly); gelu-tanh SwiGLU."""
    eps = 1e-6  # rms_norm_eps
    n = _rms(x, eps)
    z = n * p["router.scale"] if router_prenorm else x
    if router_prenorm and inv_sqrt_h:
        z = z * x.shape[-1] ** -0.5
    prob = softmax(z @ p["router.kernel"])
    idx = _topk(prob, cfg.top_k, margins)
    w = _take(prob, idx)
    if renorm:
        w = w / w.sum(-1, keepdims=True)
    if per_expert_scale:
        w = w * p["router.per_expert_scale"][idx]
    x_e = n * p["expert_norm"] if expert_prenorm else x
    return NP(_routed_sum(p, x_e, idx, w, cfg.num_experts, act=act), idx, w)


def _gpt_oss_expert(p, e, x, limit, alpha, up_plus_one):
    gate = x @ p["experts.gate"][e] + p["experts.gate_bias"][e]
    up = x @ p["experts.up"][e] + p["experts.up_bias"][e]
    if limit is not None:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    glu = gate * sigmoid(alpha * gate)
    h = (up + 1.0) * glu if up_plus_one else up * glu
    return h @ p["experts.down"][e] + p["experts.down_bias"][e]


def np_gpt_oss(
    p,
    x,
    cfg,
    token_ids=None,
    margins=None,
    router_bias=True,
    softmax_after=True,
    limit=...,
    alpha=...,
    up_plus_one=True,
):
    """§14: logits = x·W + b; top-k of the raw logits; softmax over the k selected; experts with biases,
    `(clamp(up, ±L) + 1) · g · sigmoid(alpha · g)`, `g = min(gate, L)`."""
    limit = cfg.swiglu_limit if limit is ... else limit
    alpha = cfg.swiglu_alpha if alpha is ... else alpha
    logits = x @ p["router.kernel"] + (p["router.bias"] if router_bias else 0.0)
    if softmax_after:
        idx = _topk(logits, cfg.top_k, margins)
        w = softmax(_take(logits, idx))
    else:  # softmax over all E before top-k (wrong)
        prob = softmax(logits)
        idx = _topk(prob, cfg.top_k)
        w = _take(prob, idx)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            out[t] += w[t, j] * _gpt_oss_expert(p, int(idx[t, j]), x[t : t + 1], limit, alpha, up_plus_one)[0]
    return NP(out, idx, w)


def np_llama4(p, x, cfg, token_ids=None, margins=None, weight_on="input", shared=True):
    """§15: top-k of raw logits; `S = sigmoid(v)` multiplies the expert *input*; ungated shared expert."""
    logits = x @ p["router.kernel"]
    idx = _topk(logits, cfg.top_k, margins)
    sc = sigmoid(_take(logits, idx))
    if weight_on == "input":
        out = _routed_sum(p, x, idx, sc, cfg.num_experts, x_in=sc[:, :, None] * x[:, None, :])
    else:
        out = _routed_sum(p, x, idx, sc, cfg.num_experts)
    if shared:
        out = out + _shared_mlp(p, x)
    return NP(out, idx, sc)


NUMPY = {
    "mixtral": np_mixtral,
    "qwen2_moe": np_qwen2_moe,
    "qwen3_moe": np_qwen3_moe,
    "qwen3_next": np_qwen2_moe,
    "qwen3_5_moe": np_qwen3_5_moe,
    "deepseek_v3": np_deepseek_v3,
    "glm4_moe": np_deepseek_v3,
    "glm_moe_dsa": np_deepseek_v3,
    "minimax_m2": np_minimax_m2,
    "step3p7": np_step3p7,
    "longcat_flash": np_longcat_flash,
    "deepseek_v4": np_deepseek_v4,
    "deepseek_v4_hash": np_deepseek_v4,
    "gemma4": np_gemma4,
    "gpt_oss": np_gpt_oss,
    "llama4": np_llama4,
    "olmoe": np_qwen3_moe,
}
assert set(NUMPY) == set(CASES)


# --------------------------------------------------------------------------------------------------------------
# inputs and comparisons
# --------------------------------------------------------------------------------------------------------------
def _cfg(case: str, **overrides) -> MoEConfig:
    if case == "deepseek_v4_hash":
        # Hash layers have no correction bias (§12 1b).
        overrides = {"hash_routing": True, "vocab_size": VOCAB, "correction_bias": False, **overrides}
        case = "deepseek_v4"
    return MoEConfig.preset(case, **overrides)


def _np_params(params) -> dict[str, np.ndarray]:
    out = {}
    for name, value in flatten(params).items():
        a = np.asarray(value)
        out[name] = a if np.issubdtype(a.dtype, np.integer) else a.astype(np.float64)
    return out


def _inputs(cfg: MoEConfig, seed: int, x_scale: float = 1.0):
    # rbg keys: threefry's random-bits programs take seconds to compile on CPU for each new shape
    kp, kx, kt = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    params = moejax.init_params(cfg, kp, layout="stacked")
    x = x_scale * jax.random.normal(kx, (T, cfg.hidden_size), jnp.float32)
    tids = jax.random.randint(kt, (T,), 0, cfg.vocab_size, dtype=jnp.int32) if cfg.hash_routing else None
    return params, x, tids


def _replace(params, group: str, **changes):
    return dataclasses.replace(params, **{group: dataclasses.replace(getattr(params, group), **changes)})


def _gain(params, experts: float = 1.0, shared: float = 1.0):
    """Scale gate/up projections so the clamps become active."""
    ex = params.experts
    params = _replace(params, "experts", gate=ex.gate * experts, up=ex.up * experts)
    if params.shared is not None:
        sh = params.shared
        params = _replace(params, "shared", gate=sh.gate * shared, up=sh.up * shared)
    return params


def _run(case, cfg, params, x, tids, margins=None, **ablation):
    """The numpy spec model of `case` (with `ablation`: features switched off) on moejax's parameters."""
    return NUMPY[case](_np_params(params), np.asarray(x, np.float64), cfg, tids, margins=margins, **ablation)


def _maxabs(a):
    return float(np.max(np.abs(a)))


def _scale(out):
    return max(1.0, _maxabs(out))


def _sets(idx):
    return [tuple(sorted(int(i) for i in row)) for row in np.asarray(idx)]


def _weights_by_expert(idx, w):
    rows = []
    for ir, wr in zip(np.asarray(idx), np.asarray(w, np.float64), strict=True):
        d: dict[int, float] = {}
        for i, v in zip(ir, wr, strict=True):
            d[int(i)] = d.get(int(i), 0.0) + float(v)
        rows.append(d)
    return rows


def _assert_same_routing(routing, want: NP):
    assert _sets(routing.indices) == _sets(want.idx)
    got_w = _weights_by_expert(routing.indices, routing.weights)
    want_w = _weights_by_expert(want.idx, want.w)
    for g, w in zip(got_w, want_w, strict=True):
        assert g.keys() == w.keys()
        for e in w:
            assert abs(g[e] - w[e]) <= 1e-5 * max(1.0, abs(w[e])), (e, g[e], w[e])


def _assert_feature(got, full: NP, ablated: NP, min_sep=MIN_SEP):
    """moejax equals the full numpy model, and the ablated model is clearly different from both."""
    got = np.asarray(got, np.float64)
    scale = _scale(full.out)
    err = _maxabs(got - full.out)
    sep = _maxabs(ablated.out - full.out)
    assert err <= TOL * scale, f"moejax differs from the spec model: {err:.3g} (scale {scale:.3g})"
    assert sep >= min_sep * scale, f"ablation barely changes the output: {sep:.3g} (scale {scale:.3g})"
    assert sep >= 20 * err, f"ablation {sep:.3g} is not well beyond the moejax error {err:.3g}"
    assert _maxabs(got - ablated.out) > max(10 * err, 0.5 * min_sep * scale), "moejax matches the ablated model"


def _find(case, predicate, cfg=None, mutate=None, x_scale=1.0, seeds=range(40)):
    """The first seed whose inputs satisfy `predicate(numpy_params, x, token_ids)` (numpy only, cheap)."""
    cfg = cfg or _cfg(case)
    for seed in seeds:
        params, x, tids = _inputs(cfg, seed, x_scale)
        if mutate is not None:
            params = mutate(params)
        if predicate(_np_params(params), np.asarray(x, np.float64), tids):
            return cfg, params, x, tids
    raise AssertionError(f"no seed in {seeds} satisfies the predicate for {case}")


def _differs(sets_a, sets_b):
    return any(a != b for a, b in zip(_sets(sets_a), _sets(sets_b), strict=True))


# --------------------------------------------------------------------------------------------------------------
# 1. every family: moejax (reference and xla) == numpy spec model, and the same routing
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
@settings(max_examples=3)
@given(seed=st.integers(0, 2**20))
def test_family_matches_numpy(case, impl, seed):
    cfg = _cfg(case)
    params, x, tids = _inputs(cfg, seed)
    margins: list[float] = []
    want = _run(case, cfg, params, x, tids, margins=margins)
    assume(min(margins, default=math.inf) > 1e-5)  # no near-ties between float32 and float64 selection
    got = _moejax(params, x, cfg, tids, impl)[0]
    assert_close(got, want.out, TOL)
    if impl == "reference":
        _assert_same_routing(_moejax(params, x, cfg, tids)[1], want)


@pytest.mark.parametrize(
    ("case", "normalize"),
    [("qwen2_moe", True), ("qwen3_moe", False), ("qwen3_next", False), ("olmoe", True), ("deepseek_v3", False)],
)
def test_norm_topk_prob_flag(case, normalize):
    """The families with a `norm_topk_prob` config field follow it either way."""
    cfg = _cfg(case, normalize=normalize)
    params, x, tids = _inputs(cfg, 7)
    want = _run(case, cfg, params, x, tids)
    _assert_feature(
        _moejax(params, x, cfg, tids, "reference")[0],
        want,
        _run(case, cfg, params, x, tids, renorm=not normalize),
    )
    _assert_same_routing(_moejax(params, x, cfg, tids)[1], want)


# --------------------------------------------------------------------------------------------------------------
# 2. routing features
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case", ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "minimax_m2", "step3p7", "longcat_flash", "deepseek_v4"]
)
def test_correction_bias_changes_selection(case):
    """The correction bias is used for selection only: it changes the chosen set, not the weights' formula."""

    def bias_matters(p, x, tids):
        return _differs(NUMPY[case](p, x, cfg, tids).idx, NUMPY[case](p, x, cfg, tids, bias=False).idx)

    cfg = _cfg(case)
    cfg, params, x, tids = _find(case, bias_matters, cfg=cfg)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, bias=False)
    routing = _moejax(params, x, cfg, tids)[1]
    _assert_same_routing(routing, full)
    assert _differs(routing.indices, ablated.idx)
    _assert_feature(_moejax(params, x, cfg, tids, "reference")[0], full, ablated)


def test_group_limited_selection_masks_plain_topk_choices():
    """DeepSeek-V3: experts outside the `topk_group` best groups are not selectable, even if plain top-k of the
    biased scores would choose them."""
    case = "deepseek_v3"
    cfg = _cfg(case)
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group

    def groups_matter(p, x, tids):
        return _differs(np_deepseek_v3(p, x, cfg).idx, np_deepseek_v3(p, x, cfg, groups=False).idx)

    cfg, params, x, tids = _find(case, groups_matter, cfg=cfg)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, groups=False)
    routing = _moejax(params, x, cfg)[1]
    _assert_same_routing(routing, full)
    # every selected expert lies in a kept group
    group_of = np.asarray(routing.indices) // (cfg.num_experts // cfg.n_group)
    assert np.take_along_axis(full.info["keep"], group_of, -1).all()
    _assert_feature(_moejax(params, x, cfg, impl="reference")[0], full, ablated)


def test_group_mask_is_minus_inf_not_zero():
    """With negative biased scores in the kept groups, a 0.0 fill would let masked experts win; -inf does not."""
    case = "deepseek_v3"
    cfg = _cfg(case)

    def negative_bias(params):
        b = params.router.correction_bias
        return _replace(params, "router", correction_bias=b - 3.0)

    cfg, params, x, tids = _find(case, lambda p, x, t: True, cfg=cfg, mutate=negative_bias)
    full = _run(case, cfg, params, x, tids)
    zero_fill = _run(case, cfg, params, x, tids, fill=0.0)
    assert (full.info["biased"] < 0).all()
    assert _differs(full.idx, zero_fill.idx)
    routing = _moejax(params, x, cfg)[1]
    _assert_same_routing(routing, full)
    _assert_feature(_moejax(params, x, cfg, impl="reference")[0], full, zero_fill)


@pytest.mark.parametrize("group_score", ["max", "sum"])
def test_group_score_is_sum_of_top2(group_score):
    case = "deepseek_v3"
    cfg = _cfg(case)

    def score_matters(p, x, tids):
        return _differs(np_deepseek_v3(p, x, cfg).idx, np_deepseek_v3(p, x, cfg, group_score=group_score).idx)

    cfg, params, x, tids = _find(case, score_matters, cfg=cfg)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, group_score=group_score)
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    _assert_feature(_moejax(params, x, cfg, impl="reference")[0], full, ablated)


def test_renormalisation_epsilon_in_denominator():
    """`w / (Σ w + eps)`: with a visible epsilon (override) moejax puts it in the denominator."""
    case = "deepseek_v3"
    cfg = _cfg(case, norm_epsilon=1.0)
    params, x, tids = _inputs(cfg, 3)
    full = _run(case, cfg, params, x, tids, eps=1.0)
    ablated = _run(case, cfg, params, x, tids, eps=0.0)
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    _assert_feature(_moejax(params, x, cfg, impl="reference")[0], full, ablated)


@pytest.mark.parametrize(
    ("case", "renorm"),
    [
        ("mixtral", True),
        ("qwen2_moe", False),
        ("qwen3_5_moe", True),
        ("olmoe", False),
        ("deepseek_v3", True),
        ("minimax_m2", True),
        ("step3p7", True),
        ("longcat_flash", False),
        ("deepseek_v4", True),
        ("gemma4", True),
    ],
)
def test_renormalisation(case, renorm):
    """Which families renormalise the k weights (Mixtral and Qwen3.5 always, Qwen2 default not, LongCat never)."""
    cfg = _cfg(case)
    params, x, tids = _inputs(cfg, 11)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, renorm=not renorm)
    routing = _moejax(params, x, cfg, tids)[1]
    _assert_same_routing(routing, full)
    _assert_feature(_moejax(params, x, cfg, tids, "reference")[0], full, ablated)
    sums = np.asarray(routing.weights, np.float64).sum(-1)
    if case in ("mixtral", "qwen3_5_moe", "minimax_m2", "step3p7"):
        np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
    if case in ("qwen2_moe", "olmoe"):
        assert (sums < 1 - 1e-3).all(), sums  # raw softmax probabilities of k < E experts


@pytest.mark.parametrize(("case", "weight_sum"), [("deepseek_v3", "rsf"), ("deepseek_v4", "rsf"), ("step3p7", 1.0)])
def test_routed_scaling_on_weights_vs_on_output(case, weight_sum):
    """DeepSeek-V3/V4 (and LongCat, see its tests) scale the routing weights, so normalised weights sum to the
    factor; Step-3.7 scales the routed sum instead and its weights sum to 1."""
    cfg = _cfg(case)
    assert cfg.routed_scaling_factor != 1.0
    params, x, tids = _inputs(cfg, 5)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, rsf=1.0)
    routing = _moejax(params, x, cfg)[1]
    want_sum = cfg.routed_scaling_factor if weight_sum == "rsf" else weight_sum
    np.testing.assert_allclose(np.asarray(routing.weights, np.float64).sum(-1), want_sum, rtol=1e-5)
    _assert_same_routing(routing, full)
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated)


# --------------------------------------------------------------------------------------------------------------
# 3. LongCat zero-computation experts
# --------------------------------------------------------------------------------------------------------------
def _longcat_case():
    case = "longcat_flash"
    cfg = _cfg(case)

    def picks_zero_and_real(p, x, tids):
        idx = np_longcat_flash(p, x, cfg).idx
        zero = idx >= cfg.num_experts
        return zero.any() and (~zero).any(1).all() and (~zero.any(1)).any()

    return case, *_find(case, picks_zero_and_real, cfg=cfg)


@pytest.mark.parametrize(
    "ablation",
    [{"zero": "none"}, {"renorm": True}, {"rsf_on_zero": False}],
    ids=["zero_experts_identity", "no_renorm", "rsf_on_zero_weights"],
)
def test_longcat_zero_experts(ablation):
    case, cfg, params, x, tids = _longcat_case()
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, **ablation)
    routing = _moejax(params, x, cfg)[1]
    _assert_same_routing(routing, full)
    zero_w = np.where(full.idx >= cfg.num_experts, full.w, 0.0).sum(-1)
    assert (zero_w > 0).any()
    np.testing.assert_allclose(np.asarray(routing.zero_weight), zero_w, rtol=1e-5, atol=1e-7)
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated)


# --------------------------------------------------------------------------------------------------------------
# 4. DeepSeek-V4: hash routing, sqrt-softplus, clamp before silu; Step-3.7: clamp after silu
# --------------------------------------------------------------------------------------------------------------
def test_deepseek_v4_hash_routing_follows_token_ids():
    case = "deepseek_v4_hash"
    cfg = _cfg(case)
    params, x, _ = _inputs(cfg, 13)
    table = np.asarray(params.router.tid2eid)
    t1 = jnp.arange(T, dtype=jnp.int32)
    t2 = jnp.arange(T, dtype=jnp.int32) + 17
    assert all(_sets(table[np.asarray(t1)])[t] != _sets(table[np.asarray(t2)])[t] for t in range(T))
    outs = []
    for tids in (t1, t2):
        want = _run(case, cfg, params, x, tids)
        routing = _moejax(params, x, cfg, tids)[1]
        np.testing.assert_array_equal(np.sort(np.asarray(routing.indices), -1), np.sort(table[np.asarray(tids)], -1))
        _assert_same_routing(routing, want)
        for impl in IMPLS:
            got = _moejax(params, x, cfg, tids, impl)[0]
            assert_close(got, want.out, TOL)
        outs.append(want)
    _assert_feature(_moejax(params, x, cfg, t1, "reference")[0], outs[0], outs[1])


@pytest.mark.parametrize("case", ["deepseek_v4", "deepseek_v4_hash"])
@pytest.mark.parametrize("scoring", ["sigmoid", "softplus"])
def test_deepseek_v4_sqrt_softplus_scoring(case, scoring):
    cfg = _cfg(case)
    params, x, tids = _inputs(cfg, 17)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, scoring=scoring)
    _assert_same_routing(_moejax(params, x, cfg, tids)[1], full)
    _assert_feature(_moejax(params, x, cfg, tids, "reference")[0], full, ablated)


def _clamp_active(p, x, limit, after: bool, shared_limit=None):
    """Some expert/shared gate pre-activation passes the limit (silu(gate) for the after-activation form), and some
    |up| too."""
    gate = np.einsum("th,ehi->tei", x, p["experts.gate"])
    up = np.einsum("th,ehi->tei", x, p["experts.up"])
    g = silu(gate) if after else gate
    ok = (g > limit).any() and (np.abs(up) > limit).any()
    if shared_limit is not None:
        sg = x @ p["shared.gate"]
        sg = silu(sg) if after else sg
        ok = ok and (sg > shared_limit).any()
    return ok


@pytest.mark.parametrize(
    "ablation",
    [{"limit": None}, {"clamp": "after"}, {"clamp_up": False}, {"shared_clamp": False}],
    ids=["no_clamp", "clamp_after_silu", "no_up_clamp", "shared_unclamped"],
)
def test_deepseek_v4_clamp_before_silu(ablation):
    case = "deepseek_v4"
    cfg = _cfg(case)
    if ablation.get("clamp") == "after":
        # silu(10) = 9.9995: at L = 10 the two orders differ by 5e-4 only; a small limit separates them.
        cfg = cfg.replace(swiglu_limit=2.0, shared_swiglu_limit=2.0)
    L = cfg.swiglu_limit
    cfg, params, x, tids = _find(
        case,
        lambda p, x, t: _clamp_active(p, x, L, after=False, shared_limit=L),
        cfg=cfg,
        mutate=lambda prm: _gain(prm, 8.0, 8.0),
    )
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, **ablation)
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated)


@pytest.mark.parametrize(
    "ablation",
    [{"limit": None}, {"clamp": "before"}, {"shared_limit": None}],
    ids=["no_clamp", "clamp_before_silu", "shared_unclamped"],
)
def test_step3p7_clamp_after_silu(ablation):
    case = "step3p7"
    cfg = _cfg(case)
    if ablation.get("clamp") == "before":
        cfg = cfg.replace(swiglu_limit=2.0)  # silu(7) = 6.994: a small limit separates the two orders clearly
    cfg, params, x, tids = _find(
        case,
        lambda p, x, t: _clamp_active(p, x, cfg.swiglu_limit, after=True, shared_limit=cfg.shared_swiglu_limit),
        cfg=cfg,
        mutate=lambda prm: _gain(prm, 8.0, 12.0),
    )
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, **ablation)
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated)


# --------------------------------------------------------------------------------------------------------------
# 5. shared experts: sigmoid-gated (Qwen2 / Qwen3-Next / Qwen3.5) vs ungated (DeepSeek, GLM, Step, V4, Llama-4)
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("shared", ["ungated", None])
def test_sigmoid_gated_shared_expert(case, shared):
    cfg = _cfg(case)
    params, x, tids = _inputs(cfg, 19)
    assert params.shared is not None and params.shared.gate_kernel is not None
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, shared=shared)
    _assert_feature(_moejax(params, x, cfg, impl="reference")[0], full, ablated)


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "llama4"])
def test_ungated_shared_expert(case):
    cfg = _cfg(case)
    params, x, tids = _inputs(cfg, 23)
    assert params.shared is not None and params.shared.gate_kernel is None
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, shared=False)
    _assert_feature(_moejax(params, x, cfg, impl="reference")[0], full, ablated)


def test_ungated_shared_expert_sizes():
    """Shared widths: DeepSeek-V3 `n_shared × moe_intermediate`, V4 and Llama-4 the expert width."""
    for case in ("deepseek_v3", "deepseek_v4", "llama4"):
        cfg = _cfg(case)
        assert cfg.shared_intermediate_size == cfg.intermediate_size, case


# --------------------------------------------------------------------------------------------------------------
# 6. Gemma-4: router pre-norm, per-expert scale, expert pre-norm, gelu-tanh
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ablation",
    [
        {"router_prenorm": False},
        {"inv_sqrt_h": False},
        {"per_expert_scale": False},
        {"expert_prenorm": False},
        {"act": "silu"},
        {"act": "gelu_erf"},
    ],
    ids=["router_prenorm", "router_inv_sqrt_h", "per_expert_scale", "expert_prenorm", "gelu_not_silu", "gelu_tanh"],
)
def test_gemma4_features(ablation):
    case = "gemma4"
    cfg = _cfg(case)
    # an un-normalised residual (scale 3) so that both pre-norms matter
    params, x, tids = _inputs(cfg, 29, x_scale=3.0)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, **ablation)
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    # tanh-approximate vs exact gelu differ by < 2e-4 relative here, still 500x the float32 error
    min_sep = 1e-4 if ablation.get("act") == "gelu_erf" else MIN_SEP
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated, min_sep=min_sep)


# --------------------------------------------------------------------------------------------------------------
# 7. gpt-oss and Llama-4
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ablation",
    [{"router_bias": False}, {"softmax_after": False}, {"limit": None}, {"alpha": 1.0}, {"up_plus_one": False}],
    ids=["router_bias", "softmax_after_topk", "clamp", "alpha", "up_plus_one"],
)
def test_gpt_oss_features(ablation):
    case = "gpt_oss"
    cfg = _cfg(case)
    L = cfg.swiglu_limit

    def clamp_active(p, x, tids):
        gate = np.einsum("th,ehi->tei", x, p["experts.gate"]) + p["experts.gate_bias"]
        up = np.einsum("th,ehi->tei", x, p["experts.up"]) + p["experts.up_bias"]
        return (gate > L).any() and (np.abs(up) > L).any()

    cfg, params, x, tids = _find(case, clamp_active, cfg=cfg, mutate=lambda prm: _gain(prm, 8.0))
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, **ablation)
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated)


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_score_scales_expert_input(top_k):
    case = "llama4"
    cfg = _cfg(case, top_k=top_k)
    params, x, tids = _inputs(cfg, 31, x_scale=2.0)
    full, ablated = _run(case, cfg, params, x, tids), _run(case, cfg, params, x, tids, weight_on="output")
    _assert_same_routing(_moejax(params, x, cfg)[1], full)
    for impl in IMPLS:
        _assert_feature(_moejax(params, x, cfg, impl=impl)[0], full, ablated)


# --------------------------------------------------------------------------------------------------------------
# 8. bf16 router dtype flow (FAMILIES.md §0.4): the precision of the scores decides the selected set
# --------------------------------------------------------------------------------------------------------------
_route_jit = jax.jit(moejax.route, static_argnames=("cfg",))


def _bf16(a):
    return np.asarray(np.asarray(a, np.float32).astype(jnp.bfloat16), np.float64)


def _bf16_selection(case, logits, bias, k, scores_in_bf16):
    """Top-k of `scores + bias` from bf16 logits: scores either in float32 (MiniMax-M2: sigmoid of float32(logits))
    or in bf16 (DeepSeek-V4: `softplus(logits).sqrt()` on a bf16 tensor, each op rounding to bf16)."""
    if case == "minimax_m2":
        s = _bf16(sigmoid(logits)) if scores_in_bf16 else sigmoid(logits)
    else:
        s = _bf16(np.sqrt(_bf16(softplus(logits)))) if scores_in_bf16 else _sqrtsoftplus(logits)
    margins: list[float] = []
    return _topk(s + bias, k, margins), min(margins)


@pytest.mark.parametrize(("case", "scores_in_bf16"), [("minimax_m2", False), ("deepseek_v4", True)])
def test_bf16_router_score_precision(case, scores_in_bf16):
    """In a bf16 model MiniMax-M2 takes the sigmoid of the bf16 logits in float32, while DeepSeek-V4 computes
    sqrt-softplus in bf16 (no fp32 cast, §12 1a step 2) and adds the float32 bias to the rounded scores.
    The rounding (2^-9 relative) flips the selected set of a few tokens in 64."""
    cfg = _cfg(case)
    for seed in range(20):
        kp, kx = jax.random.split(jax.random.key(seed, impl="rbg"))
        params = moejax.init_params(cfg, kp, jnp.bfloat16)
        bias = np.asarray(params.router.correction_bias, np.float64)
        if case == "minimax_m2":  # MiniMax-M2's bias is not kept in float32: a bf16 buffer in a bf16 model
            bias = _bf16(bias)
            params = _replace(params, "router", correction_bias=jnp.asarray(bias, jnp.float32))
        x = jax.random.normal(kx, (64, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
        routing = _route_jit(params, x, cfg=cfg)
        logits = np.asarray(routing.logits, np.float64)  # bf16 router logits (checked below)
        want_logits = _bf16(np.asarray(x, np.float64) @ np.asarray(params.router.kernel, np.float64))
        np.testing.assert_allclose(logits, want_logits, rtol=2**-8, atol=1e-6)
        want, margin = _bf16_selection(case, logits, bias, cfg.top_k, scores_in_bf16)
        other, _ = _bf16_selection(case, logits, bias, cfg.top_k, not scores_in_bf16)
        if margin > 1e-5 and _differs(want, other):
            break
    else:
        raise AssertionError("no seed where the score precision changes the selection")
    got = _sets(routing.indices)
    wrong = [t for t, (g, w) in enumerate(zip(got, _sets(want), strict=True)) if g != w]
    assert not wrong, f"{case}: tokens {wrong} select {[got[t] for t in wrong]}, spec {[_sets(want)[t] for t in wrong]}"


def _bf16_ulp(v):
    return 2.0 ** (np.floor(np.log2(np.abs(v))) - 7)


def test_gpt_oss_bf16_router():
    """gpt-oss in bf16 (§14.1, §0.4): `logits = x·Wᵀ + b` is one bf16 Linear (rounded once, after the bias); top-k
    runs on those bf16 logits; the softmax over the k values returns bf16 (torch accumulates it in float32 and
    rounds once). Checked on the jitted router, as models run it."""
    cfg = _cfg("gpt_oss")
    kp, kx = jax.random.split(jax.random.key(0, impl="rbg"))
    params = moejax.init_params(cfg, kp, jnp.bfloat16)
    x = (3.0 * jax.random.normal(kx, (64, cfg.hidden_size), jnp.float32)).astype(jnp.bfloat16)
    routing = _route_jit(params, x, cfg=cfg)
    logits = np.asarray(routing.logits, np.float64)
    xw_b = np.asarray(x, np.float64) @ np.asarray(params.router.kernel, np.float64)
    xw_b = xw_b + np.asarray(params.router.bias, np.float64)
    problems = []
    not_bf16 = int(np.sum(logits != _bf16(logits)))
    if not_bf16:
        problems.append(f"{not_bf16} of {logits.size} router logits are not bf16 values")
    ulps = np.abs(logits - _bf16(xw_b)) / _bf16_ulp(_bf16(xw_b))
    if ulps.max() > 1.0:
        problems.append(f"logits differ from bf16(x·W + b) by up to {ulps.max():.1f} bf16 ulps")
    selected = np.take_along_axis(logits, np.asarray(routing.indices), -1)
    want = _bf16(softmax(selected))  # of moejax's own selected logits: checks the softmax alone
    ulps = np.abs(np.asarray(routing.weights, np.float64) - want) / _bf16_ulp(want)
    if ulps.max() > 1.0:
        problems.append(f"weights differ from bf16(softmax(selected logits)) by up to {ulps.max():.1f} bf16 ulps")
    assert not problems, "; ".join(problems)


# --------------------------------------------------------------------------------------------------------------
# 9. presets carry each family's semantics (FAMILIES.md §17 and §6 "Config" defaults)
# --------------------------------------------------------------------------------------------------------------
_S, _O = moejax.Scoring, moejax.ScoreOrder
_SE, _A, _C = moejax.SharedExpert, moejax.Activation, moejax.ClampOrder
_QWEN_SPEC = {"scoring": _S.SOFTMAX, "score_order": _O.BEFORE_TOPK, "correction_bias": False, "n_group": 1}
_DSV3_SPEC = {
    "scoring": _S.SIGMOID,
    "correction_bias": True,
    "norm_epsilon": 1e-20,
    "scaling_target": moejax.ScalingTarget.WEIGHTS,
    "shared_expert": _SE.UNGATED,
    "activation": _A.SILU,
    "swiglu_limit": None,
}
PRESET_SPEC = {
    "mixtral": {**_QWEN_SPEC, "normalize": True, "norm_epsilon": 0.0, "shared_expert": _SE.NONE},
    "qwen2_moe": {**_QWEN_SPEC, "normalize": False, "shared_expert": _SE.SIGMOID_GATED},
    "qwen3_moe": {**_QWEN_SPEC, "normalize": False, "shared_expert": _SE.NONE},  # HF default norm_topk_prob=False
    "qwen3_next": {**_QWEN_SPEC, "normalize": True, "norm_epsilon": 0.0, "shared_expert": _SE.SIGMOID_GATED},
    "qwen3_5_moe": {**_QWEN_SPEC, "normalize": True, "norm_epsilon": 0.0, "shared_expert": _SE.SIGMOID_GATED},
    "deepseek_v3": {**_DSV3_SPEC, "normalize": True, "routed_scaling_factor": 2.5},
    "glm4_moe": {**_DSV3_SPEC, "normalize": True, "routed_scaling_factor": 1.0},  # HF default 1.0
    "glm_moe_dsa": {**_DSV3_SPEC, "normalize": True, "routed_scaling_factor": 2.5},
    "minimax_m2": {
        "scoring": _S.SIGMOID,
        "correction_bias": True,
        "normalize": True,
        "norm_epsilon": 0.0,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "shared_expert": _SE.NONE,
    },
    "step3p7": {
        "scoring": _S.SIGMOID,
        "correction_bias": True,
        "normalize": True,
        "norm_epsilon": 0.0,
        "scaling_target": moejax.ScalingTarget.OUTPUT,
        "clamp_order": _C.AFTER_ACTIVATION,
        "shared_expert": _SE.UNGATED,
        "activation": _A.SILU,
    },
    "longcat_flash": {
        "scoring": _S.SOFTMAX,
        "correction_bias": True,
        "router_bias": False,
        "normalize": False,
        "scaling_target": moejax.ScalingTarget.WEIGHTS,
        "shared_expert": _SE.NONE,
    },
    "deepseek_v4": {
        "scoring": _S.SQRT_SOFTPLUS,
        "correction_bias": True,
        "normalize": True,
        "norm_epsilon": 1e-20,
        "n_group": 1,
        "routed_scaling_factor": 1.5,
        "scaling_target": moejax.ScalingTarget.WEIGHTS,
        "swiglu_limit": 10.0,
        "shared_swiglu_limit": 10.0,
        "clamp_order": _C.BEFORE_ACTIVATION,
        "shared_expert": _SE.UNGATED,
    },
    "gemma4": {
        "scoring": _S.SOFTMAX,
        "normalize": True,
        "norm_epsilon": 0.0,
        "per_expert_scale": True,
        "router_prenorm": True,
        "expert_prenorm": True,
        "rms_norm_eps": 1e-6,
        "activation": _A.GELU_TANH,
        "shared_expert": _SE.NONE,
    },
    "gpt_oss": {
        "score_order": _O.AFTER_TOPK,
        "scoring": _S.SOFTMAX,
        "router_bias": True,
        "normalize": False,
        "activation": _A.GPT_OSS,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "expert_bias": True,
        "shared_expert": _SE.NONE,
    },
    "llama4": {
        "score_order": _O.AFTER_TOPK,
        "scoring": _S.SIGMOID,
        "normalize": False,
        "weights_on_input": True,
        "shared_expert": _SE.UNGATED,
        "activation": _A.SILU,
    },
    "olmoe": {**_QWEN_SPEC, "normalize": False, "shared_expert": _SE.NONE},
}
assert set(PRESET_SPEC) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_preset_semantics(family):
    cfg = MoEConfig.preset(family)
    wrong = {f: (getattr(cfg, f), v) for f, v in PRESET_SPEC[family].items() if getattr(cfg, f) != v}
    assert not wrong, f"{family}: (preset, FAMILIES.md) = {wrong}"


# --------------------------------------------------------------------------------------------------------------
# 10. MoEConfig validation
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("family", "overrides", "field"),
    [
        ("mixtral", {"top_k": 9}, "top_k"),
        ("qwen3_moe", {"top_k": 17}, "top_k"),
        ("longcat_flash", {"top_k": 17}, "top_k"),  # > routed + zero experts
        ("deepseek_v3", {"n_group": 5}, "n_group"),
        ("deepseek_v3", {"n_group": 3}, "n_group"),
        ("deepseek_v3", {"topk_group": 5}, "topk_group"),
        ("glm4_moe", {"n_group": 2, "topk_group": 3}, "topk_group"),
        ("mixtral", {"scoring": "softmax2"}, "scoring"),
        ("mixtral", {"score_order": "sideways"}, "score_order"),
        ("mixtral", {"activation": "relu"}, "activation"),
        ("step3p7", {"clamp_order": "during"}, "clamp_order"),
        ("qwen2_moe", {"shared_expert": "gated"}, "shared_expert"),
        ("step3p7", {"scaling_target": "input"}, "scaling_target"),
        ("mixtral", {"router_dtype": "bfloat16"}, "router_dtype"),
        ("mixtral", {"weights_dtype": "bf16"}, "weights_dtype"),
    ],
)
def test_config_validation_names_the_field(family, overrides, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        MoEConfig.preset(family, **overrides)


def test_config_validation_accepts_zero_experts_in_top_k():
    cfg = MoEConfig.preset("longcat_flash", top_k=14)  # 12 routed + 4 zero experts
    assert cfg.num_selectable == 16


def test_unknown_family_raises():
    with pytest.raises(ValueError, match="unknown family"):
        MoEConfig.preset("mixtral2")
