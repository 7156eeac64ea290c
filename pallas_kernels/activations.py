"""The gated activations of MoE experts, written once: the kernels' epilogues, the references and moejax's plans.

`GatedActivation` is a frozen description (hashable, so it can be a static argument) that is also the function:
`act(gate, up)` returns `h` in float32. The expressions use only products, `tanh`, `exp` (through `sigmoid`),
`minimum` and `clip`, which lower both in XLA and inside Mosaic GPU kernels (no `integer_pow`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

Array = jax.Array

ACTIVATIONS = ("silu", "gelu_tanh", "gpt_oss")
CLAMP_ORDERS = ("before_activation", "after_activation")


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """`h = f(gate, up)` of a gated FFN.

    kind:
      "silu": `silu(g) · u`; "gelu_tanh": `gelu_tanh(g) · u`; with a `limit`, `u` is clamped to ±limit and the
      gate side is `act(min(g, L))` (clamp_order="before_activation", DeepSeek-V4) or `min(act(g), L)`
      ("after_activation", Step-3.7).
      "gpt_oss": `(clamp(u, ±L) + 1) · g' · sigmoid(alpha · g')`, `g' = min(g, L)`; needs a limit.
    """

    kind: str = "silu"
    limit: float | None = None
    clamp_order: str = "before_activation"
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"GatedActivation.kind={self.kind!r} is not one of {ACTIVATIONS}")
        if self.clamp_order not in CLAMP_ORDERS:
            raise ValueError(f"GatedActivation.clamp_order={self.clamp_order!r} is not one of {CLAMP_ORDERS}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"GatedActivation.limit={self.limit!r} must be None (no clamp) or > 0")
        if self.kind == "gpt_oss" and self.limit is None:
            raise ValueError("GatedActivation.kind='gpt_oss' needs a limit (7.0 in gpt-oss)")
        if not math.isfinite(self.alpha):
            raise ValueError(f"GatedActivation.alpha={self.alpha!r} must be finite")

    def __call__(self, gate: Array, up: Array) -> Array:
        """`h` float32 of `gate`, `up` (any float dtype, same shape)."""
        g = gate.astype(jnp.float32)
        u = up.astype(jnp.float32)
        limit = self.limit
        if self.kind == "gpt_oss":
            g = jnp.minimum(g, limit)
            u = jnp.clip(u, -limit, limit)
            return (u + 1.0) * (g * jax.nn.sigmoid(self.alpha * g))
        act = silu if self.kind == "silu" else gelu_tanh
        if limit is None:
            return act(g) * u
        u = jnp.clip(u, -limit, limit)
        if self.clamp_order == "before_activation":
            return act(jnp.minimum(g, limit)) * u
        return jnp.minimum(act(g), limit) * u


def silu(z: Array) -> Array:
    return z * jax.nn.sigmoid(z)


def gelu_tanh(z: Array) -> Array:
    """`jax.nn.gelu(z, approximate=True)` written with products (no integer_pow inside a kernel)."""
    return z * (0.5 * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * (z * z * z)))))
