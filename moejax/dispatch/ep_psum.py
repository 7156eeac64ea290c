"""`EPPsum` ("replicated" EP, decode and small batches): every device holds all T rows and routes them; it
computes the pairs of its own experts, and one psum over the expert (and tensor) axis completes the routed sum.

A slot whose expert lives elsewhere gets the sentinel id E/n, which every plan treats like a zero-computation
expert (weight 0, never computed, its weights never read).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.analysis import expert_load
from moejax.dispatch.ep import ExpertParallel
from moejax.slots import Slots
from moejax.stats import MoEStats

Array = jax.Array


def localize(slots: Slots, first: Array, num_local: int) -> Slots:
    """Slots restricted to experts `[first, first + num_local)`, renumbered from 0.

    Other slots (remote experts and zero-computation experts) get the id `num_local` and output weight 0: every
    plan skips ids >= the number of experts it holds, so they are never computed or read.
    """
    local = slots.indices - first
    mine = (local >= 0) & (local < num_local)
    return dataclasses.replace(
        slots, indices=jnp.where(mine, local, num_local), out_weight=jnp.where(mine, slots.out_weight, 0.0)
    )


@dataclasses.dataclass(frozen=True)
class EPPsum(ExpertParallel):
    """Rows replicated over the expert axis; the routed sum reduced by one psum (see the module docstring)."""

    def routed_sum(self, step, x_e, slots, routing, *, cfg, num_tokens):
        T = x_e.shape[0]
        num_local = step.num_experts
        me = jax.lax.axis_index(self.expert_axis)
        if self.placement is not None:  # each pair to one replica of its expert: physical slot ids from here on
            slots = dataclasses.replace(slots, indices=self.placement.physical_ids(slots.indices, jnp.arange(T)))
        local = localize(slots, me * num_local, num_local)
        partial = self.tensor_step(step)(x_e, local, num_pairs=T * cfg.top_k)
        axes = self.expert_axis if self.tensor_axis is None else (self.expert_axis, self.tensor_axis)
        routed = jax.lax.psum(partial, axes)
        load = expert_load(routing.indices, cfg)
        if self.placement is None:
            mine = jax.lax.dynamic_slice_in_dim(load, me * num_local, num_local).sum(keepdims=True)
        else:
            mine = (local.indices < num_local).sum(dtype=jnp.int32)[None]
        stats = MoEStats.all_local(load, tokens=num_tokens, top_k=cfg.top_k, computed=mine)
        return routed, stats
