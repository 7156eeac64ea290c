"""`MoE`: the flax.nnx module over the functional core. It owns the parameters and calls `moe_forward`.

Trainable weights are `nnx.Param` carrying logical sharding names (`expert`, `embed`, `mlp`; see
`moejax.params.LOGICAL_AXES`); the correction bias and the hash table are `MoEBuffer` variables (not trainable,
not touched by an optimizer that filters on `nnx.Param`). Attribute paths mirror `MoEParams`:
`layer.router.kernel`, `layer.experts.gate`, `layer.shared.down`, `layer.expert_norm`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import MoEConfig
from moejax.forward import moe_forward
from moejax.params import BUFFERS, LOGICAL_AXES, MoEParams, flatten, init_params, unflatten

Array = jax.Array


class MoEBuffer(nnx.Variable):
    """A non-trainable array of the layer (correction bias, token-id table)."""


class _Group(nnx.Module):
    """A named group of variables (router, experts, shared)."""


class MoE(nnx.Module):
    """A Mixture-of-Experts block for one model family (see `MoEConfig`).

    Args:
      cfg: the block's math.
      rngs: random streams; `rngs.params()` seeds the weights (`moejax.init_params`).
      param_dtype: dtype of the weights (buffers keep float32 / int32).
      impl: implementation of the routed experts passed to `moe_forward` ("auto", "xla", "reference", ...).

    `layer(x, token_ids=None)` maps `x [..., H]` to `[..., H]` in x's dtype; works under `nnx.jit`.
    """

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs, param_dtype: jnp.dtype = jnp.float32, impl: str = "auto"):
        self.cfg = cfg
        self.impl = impl
        self.load_params(init_params(cfg, rngs.params(), param_dtype))

    def load_params(self, params: MoEParams) -> None:
        """Replace every variable by `params` (e.g. from `moejax.hf.params_from_hf`), keeping the metadata."""
        groups: dict[str, _Group] = {}
        for name, value in flatten(params).items():
            group, _, field = name.rpartition(".")
            if name in BUFFERS:
                variable = MoEBuffer(value)
            else:
                variable = nnx.Param(value, out_sharding=LOGICAL_AXES[name], eager_sharding=False)
            owner = self if not group else groups.setdefault(group, _Group())
            setattr(owner, field, variable)
        for group in ("router", "experts", "shared"):
            setattr(self, group, groups.get(group))

    @property
    def params(self) -> MoEParams:
        """The current variables as the `MoEParams` pytree `moe_forward` takes."""
        flat = {}
        for group in ("router", "experts", "shared"):
            holder = getattr(self, group)
            if holder is None:
                continue
            for field, variable in vars(holder).items():
                if isinstance(variable, nnx.Variable):
                    flat[f"{group}.{field}"] = variable[...]
        expert_norm = getattr(self, "expert_norm", None)
        if isinstance(expert_norm, nnx.Variable):
            flat["expert_norm"] = expert_norm[...]
        return unflatten(flat)

    def __call__(self, x: Array, token_ids: Array | None = None) -> Array:
        return moe_forward(self.params, x, self.cfg, token_ids, impl=self.impl)
