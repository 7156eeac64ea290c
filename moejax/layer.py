"""`MoE`: the flax.nnx module over the functional core. It owns the parameters and calls `moe_forward`.

Trainable weights are `nnx.Param` carrying logical sharding names (`expert`, `embed`, `mlp`; see
`moejax.params.LOGICAL_AXES`); the correction bias and the hash table are `MoEBuffer` variables (not trainable,
not touched by an optimizer that filters on `nnx.Param`). Attribute paths mirror `MoEParams`:
`layer.router.kernel`, `layer.experts.gate`, `layer.shared.down`, `layer.expert_norm`.

Under a mesh (`MoE(cfg, rngs=..., mesh=mesh)`), the parameters are created already sharded: their
`PartitionSpec`s come from the Params' logical sharding names through `moejax.parallel.logical_axis_rules`, and
a jitted `init_params` with those output shardings lets each device compute only its own shards. When the mesh
has the expert axis, a call runs `moejax.parallel.moe_forward_ep`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import parallel
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
      mesh: optional `jax.sharding.Mesh`: parameters are created sharded on it (experts over `expert_axis`, the
        intermediate dims over `tensor_axis`, the rest replicated); with `expert_axis` in the mesh, calls run
        expert-parallel (`moejax.parallel.moe_forward_ep`), else `moe_forward` on the replicated parameters.
      expert_axis, tensor_axis, ep_mode: the mesh axes and the mode ("replicated" | "all_to_all") of the EP call.

    `layer(x, token_ids=None)` maps `x [..., H]` to `[..., H]` in x's dtype; works under `nnx.jit`.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
        expert_axis: str = "expert",
        tensor_axis: str | None = None,
        ep_mode: parallel.EPMode = "replicated",
    ):
        self.cfg = cfg
        self.impl = impl
        self.mesh = mesh
        self.expert_axis = expert_axis if mesh is not None and expert_axis in mesh.shape else None
        self.tensor_axis = tensor_axis
        self.ep_mode = ep_mode
        if mesh is None:
            self.load_params(init_params(cfg, rngs.params(), param_dtype))
            return
        if ep_mode not in parallel.EP_MODES:
            raise ValueError(f"ep_mode={ep_mode!r} is not one of {parallel.EP_MODES}")
        if self.expert_axis is None:
            if tensor_axis is not None:
                raise ValueError(f"tensor_axis={tensor_axis!r} needs expert_axis={expert_axis!r} in the mesh")
        else:
            parallel.check_mesh(cfg, mesh, expert_axis, tensor_axis)
        self.load_params(self._init_sharded(rngs.params(), param_dtype))

    def _init_sharded(self, key: Array, param_dtype: jnp.dtype) -> MoEParams:
        """`init_params` jitted with the sharding of every parameter as output sharding: XLA partitions the
        random generation, so no device ever holds the full (unsharded) weights."""
        abstract = nnx.eval_shape(lambda: MoE(self.cfg, rngs=nnx.Rngs(params=key), param_dtype=param_dtype))
        with nnx.logical_axis_rules(parallel.logical_axis_rules(self.expert_axis, self.tensor_axis)):
            specs = nnx.get_partition_spec(nnx.state(abstract))
        shardings = {}
        for path, spec in nnx.to_flat_state(specs):
            name = ".".join(map(str, path))
            # The router runs on every device (Gemma-4's per-expert scale too, logically `expert`): replicated.
            spec = jax.sharding.PartitionSpec() if parallel.runs_replicated(name) else spec.get_value()
            shardings[name] = jax.sharding.NamedSharding(self.mesh, spec)
        init = jax.jit(init_params, static_argnums=(0, 2), out_shardings=unflatten(shardings))
        return init(self.cfg, key, param_dtype)

    def load_params(self, params: MoEParams) -> None:
        """Replace every variable by `params` (e.g. from `moejax.hf.params_from_hf`), keeping the metadata.

        Under a mesh the arrays are placed with `moejax.parallel.shard_params` (a no-op for placed ones).
        """
        if self.mesh is not None:
            params = parallel.shard_params(
                params, self.cfg, self.mesh, expert_axis=self.expert_axis, tensor_axis=self.tensor_axis
            )
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
        if self.expert_axis is None:
            return moe_forward(self.params, x, self.cfg, token_ids, impl=self.impl)
        return parallel.moe_forward_ep(
            self.params,
            x,
            self.cfg,
            mesh=self.mesh,
            expert_axis=self.expert_axis,
            tensor_axis=self.tensor_axis,
            mode=self.ep_mode,
            token_ids=token_ids,
            impl=self.impl,
        )
