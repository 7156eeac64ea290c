"""Routing statistics: union size, the union-over-consecutive-tokens curve, expert load. On device, jit-able."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig

Array = jax.Array


def union_size(indices: Array, cfg: MoEConfig) -> Array:
    """Number of distinct routed experts (zero-computation experts excluded) selected by `indices [T, K]`."""
    return jnp.sum(expert_load(indices, cfg) > 0)


def expert_load(indices: Array, cfg: MoEConfig) -> Array:
    """How many (token, slot) pairs chose each routed expert: `[E]` int32."""
    ids = indices.reshape(-1)
    return jnp.bincount(jnp.where(ids < cfg.num_experts, ids, cfg.num_experts), length=cfg.num_experts + 1)[:-1]


def union_curve(indices: Array, cfg: MoEConfig, max_window: int = 4) -> Array:
    """Mean union size over windows of w = 1..max_window consecutive tokens: `[max_window]` float32.

    This is the decode cost curve: a step over w rows reads union(w) experts' weights once each.
    """

    def mean_union(w: int) -> Array:
        T = indices.shape[0] - w + 1
        windows = jnp.stack([indices[i : i + T] for i in range(w)], axis=1).reshape(T, -1)  # [T-w+1, w*K]
        return jnp.mean(jax.vmap(lambda ids: union_size(ids[None], cfg))(windows).astype(jnp.float32))

    return jnp.stack([mean_union(w) for w in range(1, max_window + 1)])
