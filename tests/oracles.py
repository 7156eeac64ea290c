"""The suite's numpy oracles and comparisons, one home for each: the scalar functions of FAMILIES.md §0.1, the
gated activations, the routed sum over dequantized weights, random inputs and the closeness checks.

Oracles compute in float64 from the spec's formulas, never through moejax, so a test that compares against them
checks moejax's math rather than its consistency with itself.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from pallas_kernels.activations import GatedActivation

# -- scalar functions (FAMILIES.md §0.1) --------------------------------------------------------------------------


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def softmax(z, axis: int = -1):
    e = np.exp(z - z.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def silu(z):
    return z * sigmoid(z)


def gelu_tanh(z):
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def softplus(z):
    """torch's softplus (beta=1, threshold=20): z itself above 20."""
    return np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20.0))))


def gated(act: GatedActivation, g, u):
    """`act(g, u)` of every gated activation moejax serves: silu / gelu_tanh times up, with the optional clamp
    before or after the activation, and gpt-oss's clamped SwiGLU `(u + 1) · g · σ(alpha · g)`."""
    if act.kind == "gpt_oss":
        g, u = np.minimum(g, act.limit), np.clip(u, -act.limit, act.limit)
        return (u + 1) * g * sigmoid(act.alpha * g)
    f = {"silu": silu, "gelu_tanh": gelu_tanh}[act.kind]
    if act.limit is None:
        return f(g) * u
    u = np.clip(u, -act.limit, act.limit)
    if act.clamp_order == "before_activation":
        return f(np.minimum(g, act.limit)) * u
    return np.minimum(f(g), act.limit) * u


def routed_sum(experts, x, slots, act: GatedActivation) -> np.ndarray:
    """float64 `Σ_k out_w[t, k] · E_e(in_scale[t, k] · x[t])` over the experts' dequantized weights (`[in, out]`
    matrices, optional biases); ids outside [0, E) skipped."""
    d = jax.tree.map(lambda a: np.asarray(a, np.float64), experts.dequantize())
    x = np.asarray(x, np.float64)
    idx = np.asarray(slots.indices)
    w = np.asarray(slots.out_weight, np.float64)
    s = None if slots.in_scale is None else np.asarray(slots.in_scale, np.float64)
    out = np.zeros_like(x)
    for e in range(d.gate.shape[0]):
        hit = idx == e
        rows = hit.any(1)
        if not rows.any():
            continue
        xe = x[rows] if s is None else x[rows] * (s * hit).sum(1)[rows, None]
        g, u = xe @ d.gate[e], xe @ d.up[e]
        if d.gate_bias is not None:
            g, u = g + d.gate_bias[e], u + d.up_bias[e]
        y = gated(act, g, u) @ d.down[e]
        if d.down_bias is not None:
            y = y + d.down_bias[e]
        out[rows] += (w * hit).sum(1)[rows, None] * y
    return out


# -- inputs -------------------------------------------------------------------------------------------------------


def normal(rng: np.random.Generator, *shape: int, scale: float = 0.5) -> np.ndarray:
    """float32 normal values times `scale` (never zeros: a test on zeros checks nothing)."""
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# -- comparisons --------------------------------------------------------------------------------------------------


def max_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max()) if got.size else 0.0


def assert_close(got, want, tol: float = 3e-5, what: str = "", floor: float = 1.0) -> None:
    """`max |got - want| <= tol · max(floor, max |want|)` over every leaf of two matching pytrees: the float32 error
    of another summation order, relative to the leaf's scale (NaN fails)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), f"{what}: {len(got_leaves)} leaves, expected {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{what} leaf {i}: shape {g.shape}, expected {w.shape}"
        scale = max(floor, float(np.abs(w).max())) if w.size else floor
        err = max_error(g, w)
        assert err <= tol * scale, f"{what} leaf {i}: max error {err:.3g} > {tol:g} x scale {scale:.3g}"
