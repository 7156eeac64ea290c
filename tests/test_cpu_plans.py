"""`moejax.backends.cpu` against a dense per-slot float32 reference, plus batch invariance and read-once checks."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.backends.cpu import decode_row_classes, switch_decode, switch_grouped
from moejax.backends.xla import DECODE_MAX_SLOTS
from moejax.slots import Slots
from moejax.weights import FusedExpertWeights
from pallas_kernels.activations import GatedActivation

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Tolerances follow the float32 error the computation can have, scaled by the magnitudes summed (`_ffn_reference`):
# two evaluation orders of a sum of n terms differ by a random walk of about sqrt(n) roundings (n <= 56 here: ~7.5)
# of that magnitude. A flat atol failed on outputs of magnitude 15. Measured: at most 0.27 eps·magnitude
# over 40 random examples of each property. bfloat16 adds BF16_TOL (`_assert_close`).
ROUNDING_UNITS = 8
BF16_TOL = 2e-2


@functools.cache
def _weights(E, H, I, dtype, seed=0):
    """Per-expert arrays `gate [H, I]`, `up [H, I]`, `down [I, H]` (numpy float32 and device `dtype`)."""
    rng = np.random.default_rng(seed)
    np_w = [
        tuple(rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[0]) for s in ((H, I), (H, I), (I, H)))
        for _ in range(E)
    ]
    return np_w, [tuple(jnp.asarray(a, DTYPES[dtype]) for a in w) for w in np_w]


def _ffn(w, rows):
    """The test expert: SiLU-gated FFN, matmuls in the weight dtype accumulating in float32."""
    gate, up, down = w
    r = rows.astype(gate.dtype)
    g = jnp.dot(r, gate, preferred_element_type=jnp.float32)
    u = jnp.dot(r, up, preferred_element_type=jnp.float32)
    return jnp.dot((jax.nn.silu(g) * u).astype(down.dtype), down, preferred_element_type=jnp.float32)


@functools.cache
def _planned(plan, with_scale):
    """A jitted plan taking the per-expert weights as arguments (cached: one compile per shape)."""

    def run(ws, x, indices, in_scale, out_weight):
        slots = Slots(indices, out_weight, in_scale if with_scale else None)
        return plan([functools.partial(_ffn, w) for w in ws], x, slots)

    return jax.jit(run)


def _run(plan, ws, x, indices, in_scale, out_weight):
    f = _planned(plan, in_scale is not None)
    s = in_scale if in_scale is not None else jnp.zeros(indices.shape, jnp.float32)
    return np.asarray(f(ws, x, jnp.asarray(indices), s, jnp.asarray(out_weight)))


def _ffn_reference(rows, gate, up, down, rnd):
    """The test expert in numpy float32 on rows already in the weight dtype: `(y [R, H], magnitude [R, H])`.

    The magnitude bounds the float32 error of a different evaluation order in units of eps: every reduction
    contributes `Σ|a|·|b|` of its terms (what the rounding errors of its additions scale with), propagated to the
    output to first order (`|silu'| <= 1.1`; the product `silu(g)·u` and its rounding add `|h|`).
    """
    g, u = rows @ gate, rows @ up
    silu = g / (1 + np.exp(-g))
    h = rnd(silu * u)
    h_mag = 1.1 * np.abs(u) * (np.abs(rows) @ np.abs(gate)) + np.abs(silu) * (np.abs(rows) @ np.abs(up)) + np.abs(h)
    return h @ down, h_mag @ np.abs(down)


def _reference(np_w, x, indices, in_scale, out_weight, dtype):
    """Dense float32 reference per slot: `Σ_k w_k E_k(s·x)`, s the summed input scale of the row's slots that
    chose the same expert; the weight dtype rounding points of `_ffn` are reproduced. Returns the output `[T, H]`
    and its magnitude `Σ_k |w_k|·magnitude(E_k)` (`_ffn_reference`), the scale of its float32 error."""
    E = len(np_w)
    rnd = _rounding(dtype)
    x = np.asarray(jnp.asarray(x, jnp.float32))
    T, K = indices.shape
    out = np.zeros((T, x.shape[1]), np.float32)
    mag = np.zeros_like(out)
    for t in range(T):
        for k in range(K):
            e = indices[t, k]
            if not 0 <= e < E or out_weight[t, k] == 0:
                continue
            rows = x[t]
            if in_scale is not None:
                s = in_scale[t][indices[t] == e].sum(dtype=np.float32)
                rows = rnd(s * rows)  # the plan rounds the scaled row to the dtype of x
            y, y_mag = _ffn_reference(rnd(rows)[None], *(rnd(a) for a in np_w[e]), rnd)
            out[t] += out_weight[t, k] * y[0]
            mag[t] += abs(out_weight[t, k]) * y_mag[0]
    return out, mag


def _rounding(dtype):
    """Rounding to the weight dtype, in float32."""
    if dtype == "bfloat16":
        return lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
    return lambda a: np.asarray(a, np.float32)


def _assert_close(got, ref, mag, dtype):
    """`|got - ref| <= ROUNDING_UNITS · eps_f32 · mag` elementwise (`mag`: the magnitude of `_reference`), the
    float32 error of summing in another order; for bfloat16 plus `BF16_TOL · (1 + |ref|)` for a bfloat16 rounding
    point that rounds the other way (the references reproduce the rounding points, not the float32 values rounded).
    """
    tol = ROUNDING_UNITS * np.finfo(np.float32).eps * mag
    if dtype == "bfloat16":
        tol = tol + BF16_TOL * (1 + np.abs(ref))
    err = np.abs(np.asarray(got, np.float32) - ref)
    bad = ~(err <= tol)  # NaN fails too
    if bad.any():
        worst = np.where(bad, err / np.maximum(tol, 1e-30), 0)
        i = np.unravel_index(np.argmax(worst), err.shape)
        raise AssertionError(
            f"{bad.sum()} of {bad.size} elements differ by more than the tolerance; worst at {tuple(map(int, i))}: "
            f"got {got[i]}, reference {ref[i]}, tolerance {tol[i]:.3g} (magnitude {mag[i]:.3g}, {dtype})"
        )


@st.composite
def routings(draw, max_rows, experts=(1, 3, 8)):
    """A routing with skipped ids (>= E), repeated ids within a row, zero weights, and rows on one expert."""
    E = draw(st.sampled_from(experts))
    K = draw(st.integers(1, 8))
    T = draw(st.integers(1, max_rows))
    if max_rows <= 8:
        T = min(T, DECODE_MAX_SLOTS // K)
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    style = draw(st.sampled_from(["random", "one_expert", "few_experts", "skips"]))
    if style == "one_expert":
        indices = np.full((T, K), rng.integers(E), np.int32)
    elif style == "few_experts":
        indices = rng.integers(0, min(E, 3), (T, K)).astype(np.int32)
    else:
        indices = np.stack([rng.permutation(E + 4)[:K] if K <= E + 4 else rng.integers(0, E + 4, K) for _ in range(T)])
        indices = indices.astype(np.int32)
        if style == "skips":
            indices[rng.random((T, K)) < 0.4] = E + rng.integers(0, 1000)
    out_weight = rng.random((T, K)).astype(np.float32)
    out_weight[indices >= E] = 0.0
    out_weight[rng.random((T, K)) < 0.1] = 0.0
    in_scale = rng.uniform(0.5, 1.5, (T, K)).astype(np.float32) if draw(st.booleans()) else None
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    return E, T, indices, in_scale, out_weight, dtype, seed


def _check(plan, case, H=40, I=56):
    E, T, indices, in_scale, out_weight, dtype, seed = case
    np_w, ws = _weights(E, H, I, dtype)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((T, H)), DTYPES[dtype])
    got = _run(plan, ws, x, indices, in_scale, out_weight)
    ref, mag = _reference(np_w, x, indices, in_scale, out_weight, dtype)
    _assert_close(got, ref, mag, dtype)


@settings(max_examples=10)
@given(routings(max_rows=8))
def test_decode_equals_reference(case):
    _check(switch_decode, case)


@settings(max_examples=6)
@given(routings(max_rows=300, experts=(1, 5, 8)))
def test_grouped_equals_reference(case):
    _check(switch_grouped, case)


@pytest.mark.parametrize(("plan", "T", "K"), [(switch_decode, 2, 8), (switch_grouped, 64, 8)])
def test_256_experts(plan, T, K):
    """E = 256 (four switch groups, two streams) with tiny experts, some slots skipped."""
    E, H, I = 256, 24, 40
    rng = np.random.default_rng(E + T)
    indices = np.stack([rng.permutation(E + 8)[:K] for _ in range(T)]).astype(np.int32)
    out_weight = np.where(indices < E, rng.random((T, K)), 0.0).astype(np.float32)
    in_scale = rng.uniform(0.5, 1.5, (T, K)).astype(np.float32)
    _check(plan, (E, T, indices, in_scale, out_weight, "float32", T), H=H, I=I)


@pytest.mark.parametrize("plan", [switch_decode, switch_grouped])
def test_zero_weight_slots_contribute_exact_zero(plan):
    """An expert whose output is NaN contributes nothing through a slot of weight 0; skipped ids are ignored."""
    E, H, I, T = 4, 24, 40, 3
    np_w, ws = _weights(E, H, I, "float32")
    bad = (ws[1][0] * jnp.nan, *ws[1][1:])
    ws = [ws[0], bad, *ws[2:]]
    indices = np.array([[1, 0], [2, 1], [7, 3]], np.int32)
    out_weight = np.array([[0.0, 0.5], [0.3, 0.0], [0.9, 0.2]], np.float32)  # id 7 skipped despite its weight
    x = jnp.asarray(np.random.default_rng(0).standard_normal((T, H)), jnp.float32)
    got = _run(plan, ws, x, indices, None, out_weight)
    assert np.isfinite(got).all()
    ref, mag = _reference(np_w, x, np.where(indices == 1, 99, indices), None, out_weight, "float32")
    _assert_close(got, ref, mag, "float32")


def _neighbour_routings(E, T, K, rng):
    """Row 0 fixed; the other rows random, all on row 0's experts, all on row 0's first expert, or skipped."""
    row0 = rng.permutation(E)[:K]
    out = []
    for style in ("random", "same_experts", "one_expert", "skipped", "random"):
        if style == "random":
            rest = np.stack([rng.permutation(E)[:K] for _ in range(T - 1)])
        elif style == "same_experts":
            rest = np.stack([rng.permutation(row0) for _ in range(T - 1)])
        elif style == "one_expert":
            rest = np.full((T - 1, K), row0[0])
        else:
            rest = np.full((T - 1, K), E)
        out.append(np.concatenate([row0[None], rest.reshape(T - 1, K)]).astype(np.int32))
    return out


@pytest.mark.parametrize(
    ("plan", "T", "dtype", "with_scale"),
    [
        (switch_decode, 2, "float32", False),
        (switch_decode, 5, "float32", True),
        (switch_decode, 8, "float32", False),
        (switch_decode, 8, "bfloat16", True),
        (switch_decode, 3, "bfloat16", False),
        (switch_grouped, 37, "float32", True),
        (switch_grouped, 37, "bfloat16", False),
    ],
)
def test_batch_invariance(plan, T, dtype, with_scale):
    """For a fixed T, row 0's output bits do not depend on the other rows of the batch."""
    E, K, H, I = 16, 4, 40, 56
    _, ws = _weights(E, H, I, dtype)
    rng = np.random.default_rng(T)
    x0 = rng.standard_normal(H)
    s0 = rng.uniform(0.5, 1.5, K).astype(np.float32)
    w0 = rng.random(K).astype(np.float32)
    results = []
    for indices in _neighbour_routings(E, T, K, rng):
        x = np.concatenate([x0[None], rng.standard_normal((T - 1, H))])
        if rng.random() < 0.5:
            x[1:] = x0  # neighbours equal to row 0
        scale = np.concatenate([s0[None], rng.uniform(0.5, 1.5, (T - 1, K))]).astype(np.float32)
        weight = np.concatenate([w0[None], rng.random((T - 1, K))]).astype(np.float32)
        got = _run(plan, ws, jnp.asarray(x, DTYPES[dtype]), indices, scale if with_scale else None, weight)
        results.append(got[0])
    for r in results[1:]:
        assert np.array_equal(r, results[0])


def _counting_fns(ws, calls, lock):
    """Expert fns that record (expert, rows) each time XLA executes them (lax.switch traces every branch)."""

    def make(e, w):
        def fn(rows):
            def record(_):
                with lock:
                    calls.append((e, rows.shape[0]))

            jax.debug.callback(record, rows[0, 0])
            return _ffn(w, rows)

        return fn

    return [make(e, w) for e, w in enumerate(ws)]


@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_reads_each_union_expert_once(T):
    """Each distinct chosen expert runs exactly once per call, on the smallest row class that holds its distinct
    rows (rows with identical inputs are computed once); unchosen and skipped experts never run."""
    E, K, H, I = 32, 4, 24, 40
    _, ws = _weights(E, H, I, "float32")
    calls, lock = [], threading.Lock()
    f = jax.jit(lambda ws, x, i, w: switch_decode(_counting_fns(ws, calls, lock), x, Slots(i, w)))
    rng = np.random.default_rng(T)
    classes = decode_row_classes(T, E, jnp.float32)
    for trial in range(5):
        indices = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
        x = rng.standard_normal((T, H)).astype(np.float32)
        if trial == 1:
            indices[:, 0] = 5  # one expert chosen by every row
        if trial == 2:
            indices[:, -1] = E + 3  # skipped slots
        if trial == 3:
            indices[:] = indices[0]  # one token repeated: one distinct row per expert
            x[:] = x[0]
        calls.clear()
        jax.block_until_ready(f(ws, jnp.asarray(x), jnp.asarray(indices), jnp.asarray(rng.random((T, K)))))
        jax.effects_barrier()
        experts = np.unique(indices[indices < E])
        distinct_rows = {e: len({x[t].tobytes() for t in range(T) if e in indices[t]}) for e in experts}
        assert sorted(e for e, _ in calls) == sorted(experts.tolist())
        for e, r in calls:
            assert r == min(c for c in classes if c >= distinct_rows[e])
    assert f._cache_size() == 1  # one program for every routing


def test_grouped_runs_each_expert_once_when_it_fits():
    """Prefill: an expert whose pairs fit one block runs once; experts without pairs never run."""
    E, K, H, I, T = 16, 2, 24, 40, 40
    _, ws = _weights(E, H, I, "float32")
    calls, lock = [], threading.Lock()
    f = jax.jit(lambda ws, x, i, w: switch_grouped(_counting_fns(ws, calls, lock), x, Slots(i, w)))
    rng = np.random.default_rng(0)
    indices = np.stack([rng.permutation(8)[:K] for _ in range(T)]).astype(np.int32)  # experts 0..7 only
    jax.block_until_ready(f(ws, jnp.ones((T, H)), jnp.asarray(indices), jnp.ones((T, K))))
    jax.effects_barrier()
    pairs = np.bincount(indices.ravel(), minlength=E)
    assert sorted(e for e, _ in calls) == [e for e in range(E) if pairs[e]]
    assert all(r >= pairs[e] for e, r in calls)


def _fused_fn(gate_up, down):
    """`FusedExpertWeights` expert e as the plans call it."""
    return functools.partial(FusedExpertWeights(gate_up, down).ffn, act=GatedActivation("silu"))


def _dense_reference(gate_up, down, rows, dtype):
    """`FusedExpertWeights.ffn` in numpy float32 (weights and the activation rounded to the weight dtype): the
    output and its magnitude (`_ffn_reference`)."""
    rnd = _rounding(dtype)
    I = down.shape[1]
    gate_up = rnd(gate_up)
    return _ffn_reference(rnd(rows), gate_up[:I].T, gate_up[I:].T, rnd(down).T, rnd)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("R", [1, 2, 5, 8, 13])
def test_fused_expert_equals_reference(R, dtype):
    """One row (GEMV), 2..8 rows (padded multiply-reduce or dot), more rows (dot)."""
    H, I = 40, 28
    rng = np.random.default_rng(R)
    gate_up = rng.standard_normal((2 * I, H), dtype=np.float32) / np.sqrt(H)
    down = rng.standard_normal((H, I), dtype=np.float32) / np.sqrt(I)
    rows = rng.standard_normal((R, H), dtype=np.float32)
    fn = _fused_fn(jnp.asarray(gate_up, DTYPES[dtype]), jnp.asarray(down, DTYPES[dtype]))
    got = np.asarray(jax.jit(fn)(jnp.asarray(rows, DTYPES[dtype])))
    ref, mag = _dense_reference(gate_up, down, np.asarray(jnp.asarray(rows, DTYPES[dtype]), np.float32), dtype)
    _assert_close(got, ref, mag, dtype)


@pytest.mark.parametrize(("plan", "T"), [(switch_decode, 6), (switch_grouped, 45)])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fused_expert_plans_batch_invariant(plan, T, dtype):
    """The plans with `FusedExpertWeights` experts: reference values, and row 0's bits independent of its neighbours."""
    E, K, H, I = 12, 3, 36, 20
    rng = np.random.default_rng(T)
    np_w = [
        (rng.standard_normal((2 * I, H), dtype=np.float32) / 6, rng.standard_normal((H, I), dtype=np.float32) / 4)
        for _ in range(E)
    ]
    ws = [tuple(jnp.asarray(a, DTYPES[dtype]) for a in w) for w in np_w]
    padded = FusedExpertWeights(*ws[0]).padded_rows
    f = jax.jit(lambda ws, x, i, w: plan([_fused_fn(*wi) for wi in ws], x, Slots(i, w), padded_rows=padded))
    x0, w0 = rng.standard_normal(H), rng.random(K)
    rows0 = []
    for indices in _neighbour_routings(E, T, K, rng):
        x = jnp.asarray(np.concatenate([x0[None], rng.standard_normal((T - 1, H))]), DTYPES[dtype])
        weight = np.concatenate([w0[None], rng.random((T - 1, K))]).astype(np.float32)
        got = np.asarray(f(ws, x, jnp.asarray(indices), jnp.asarray(weight)))
        xr = np.asarray(jnp.asarray(x, jnp.float32))
        ref, mag = np.zeros_like(got), np.zeros_like(got)
        for t, k in zip(*np.nonzero(indices < E), strict=True):
            y, y_mag = _dense_reference(*np_w[indices[t, k]], xr[t : t + 1], dtype)
            ref[t] += weight[t, k] * y[0]
            mag[t] += abs(weight[t, k]) * y_mag[0]
        _assert_close(got, ref, mag, dtype)
        rows0.append(got[0])
    assert all(np.array_equal(r, rows0[0]) for r in rows0[1:])
