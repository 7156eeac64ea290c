"""Inputs of the native CPU backend's tests (tests/test_native_cpu.py, tests/test_native_lora.py): the activations
the kernels implement, random dense experts, rows and slots drawn on the host with numpy (no eager jax op per
shape)."""

import jax.numpy as jnp
import numpy as np

from moejax.slots import Slots
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation

ACTIVATIONS = {
    "silu": GatedActivation("silu"),
    "gelu_tanh": GatedActivation("gelu_tanh"),
    "silu_clamp_before": GatedActivation("silu", limit=0.3, clamp_order="before_activation"),
    "silu_clamp_after": GatedActivation("silu", limit=0.05, clamp_order="after_activation"),
    "gpt_oss": GatedActivation("gpt_oss", limit=0.4, alpha=1.702),
}


def normal(rng: np.random.Generator, shape: tuple[int, ...], fan: int) -> jnp.ndarray:
    """Standard normal float32 values divided by sqrt(fan)."""
    return jnp.asarray((rng.standard_normal(shape) / np.sqrt(fan)).astype(np.float32))


def dense(E: int, H: int, I: int, dtype="float32", bias: bool = False, seed: int = 0) -> ExpertWeights:
    """Random dense experts, `[in, out]` stacked: gate, up [E, H, I], down [E, I, H] (biases [E, I], [E, H])."""
    rng = np.random.default_rng(seed)
    n = lambda shape, fan: normal(rng, shape, fan).astype(dtype)
    biases = {}
    if bias:
        biases = {"gate_bias": n((E, I), 10), "up_bias": n((E, I), 10), "down_bias": n((E, H), 10)}
    return ExpertWeights(n((E, H, I), H), n((E, H, I), H), n((E, I, H), I), **biases)


def rows(T: int, H: int, seed: int = 1, dtype="float32") -> jnp.ndarray:
    """[T, H] standard normal rows."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, H)).astype(np.float32)).astype(dtype)


def slots(T: int, K: int, E: int, seed: int, *, in_scale: bool = False, skipped: bool = True, beyond: int = 3) -> Slots:
    """Random [T, K] slots: ids in [-1, E + beyond) when `skipped` (ids < 0 or >= E: zero / remote experts, never
    computed, weight 0), else in [0, E); a tenth of the weights 0 (they contribute exactly 0); `in_scale` in
    [0.5, 1.5) when asked."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(-1 if skipped else 0, E + beyond if skipped else E, (T, K)).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    w[rng.random((T, K)) < 0.1] = 0.0
    w[(idx < 0) | (idx >= E)] = 0.0
    scale = rng.uniform(0.5, 1.5, (T, K)).astype(np.float32) if in_scale else None
    return Slots(jnp.asarray(idx), jnp.asarray(w), None if scale is None else jnp.asarray(scale))
