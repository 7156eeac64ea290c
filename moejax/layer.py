"""`MoE`: the flax.nnx module over the functional core. It owns the parameters and calls `moe_forward`.

Trainable weights are `nnx.Param` carrying logical sharding names (`expert`, `embed`, `mlp`; from the arrays'
declaration, `moejax.params.array_specs`); the correction bias and the hash table are `MoEBuffer` variables (not
trainable, not touched by an optimizer that filters on `nnx.Param`). Attribute paths mirror `MoEParams`:
`layer.router.kernel`, `layer.experts.gate` (stacked layout) or `layer.experts[e].gate_up_weight` (per-expert
layout, the default on a CPU backend, see `moejax.weights`), `layer.shared.down`, `layer.expert_norm`.

Under a mesh (`MoE(cfg, rngs=..., mesh=mesh)`), the parameters are created already sharded: their
`PartitionSpec`s come from the Params' logical sharding names through `moejax.sharding.logical_axis_rules`, and
a jitted `init_params` with those output shardings lets each device compute only its own shards. When the mesh
has the expert axis, the layer's dispatch (chosen at construction) is expert-parallel (`moejax.dispatch`), with
the experts laid out by a `moejax.placement.Placement` when one is given.

LoRA adapters (`moejax.lora`): `MoE(cfg, ..., lora=stack)` or `layer.set_lora(stack)` holds an adapter stack
(`moejax.lora.stack`, ids 1..n) as `LoRAParam` variables, `layer.lora.<target>.a` / `.b` (targets as
`LoRAParams.pairs` names them: `router`, `experts.gate`, `shared.down`, ...; the scales alpha/r are `MoEBuffer`s);
`layer(x, adapter_ids=ids)` applies each row's adapter. `nnx.Optimizer(layer, tx, wrt=moejax.LoRAParam)` trains
the adapters only (`nnx.Param` does not match them, so an optimizer over the base weights leaves them alone).
Under a mesh the stack is placed by `moejax.sharding.shard_lora` (each expert's adapters with the expert).

Routing statistics (`moejax.stats.MoEStats`): `layer(x, return_stats=True).stats` (a `moejax.MoEOutput`); with
`collect_stats=True` every call adds them to the layer's `stats` variable (`MoEStatsVariable`, not a parameter),
so under `nnx.jit` and inside jitted loops (`nnx.fori_loop`, `nnx.scan`) they accumulate on device over steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import sharding
from moejax.config import MoEConfig
from moejax.dispatch import EP_MODES, EPMode, expert_parallel
from moejax.forward import IMPLS, MoEOutput, as_output, moe_forward
from moejax.lora import LoRAPair, LoRAParams, check_lora, from_pairs
from moejax.params import BUFFERS, MoEParams, check_params, flatten, init_params, specs_of, unflatten
from moejax.placement import Placement
from moejax.routing import Routing
from moejax.stats import MoEStats
from moejax.weights import LAYOUTS, ExpertFormat, ExpertWeights, Layout, default_layout, format_of, to_layout

Array = jax.Array


@jax.jit
def _accumulate(total: MoEStats, stats: MoEStats) -> MoEStats:
    """`total + stats` as one program (cached), not one eager op per field at every eager call."""
    return total + stats


class MoEBuffer(nnx.Variable):
    """A non-trainable array of the layer (correction bias, token-id table)."""


class LoRAParam(nnx.Variable):
    """A LoRA adapter array of the layer (A or B of one target, a stack `[n+1, ...]`): trainable, but not an
    `nnx.Param`, so optimizers choose between the base weights and the adapters by variable type."""


class MoEStatsVariable(nnx.Variable):
    """The routing statistics a `MoE(..., collect_stats=True)` accumulates (a `MoEStats` value)."""


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
        expert-parallel (`moejax.dispatch.EPPsum` or `EPAllToAll`), else `moe_forward`'s default dispatch.
      expert_axis, tensor_axis, ep_mode: the mesh axes and the mode ("replicated" | "all_to_all") of the EP call.
      fmt: the routed experts' weight format (`moejax.weights`), dense by default.
      layout: "auto" (per-expert on a CPU backend without a mesh, else stacked), "stacked" or "per_expert".
      placement: optional `moejax.placement.Placement` over the mesh's expert axis: the experts are held in its
        slot order (hot experts replicated; `load_params` still takes them in logical order) and calls pass it to
        `moe_forward_ep`. The initial random weights are drawn with the experts replicated over the expert axis,
        then laid out by slot.
      collect_stats: add every call's `MoEStats` to `self.stats` (a `MoEStatsVariable`, starting from zeros).
      lora: optional adapter stack (`moejax.lora.stack`), as `set_lora` takes it.

    `layer(x, token_ids=None, *, adapter_ids=None, return_stats=False, routing=None, return_routing=False)` maps
    `x [..., H]` to `[..., H]` in x's dtype, or to a `moejax.MoEOutput` with `return_stats` and/or
    `return_routing` (as `moe_forward`); `adapter_ids [...]` int32 picks each row's adapter of the layer's stack
    (0: none); works under `nnx.jit`.
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
        ep_mode: EPMode = "replicated",
        fmt: type[ExpertFormat] = ExpertWeights,
        layout: Layout = "auto",
        placement: Placement | None = None,
        collect_stats: bool = False,
        lora: LoRAParams | None = None,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a moejax.MoEConfig, got {type(cfg).__name__}")
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
        if ep_mode not in EP_MODES:
            raise ValueError(f"ep_mode={ep_mode!r} is not one of {EP_MODES}")
        self.cfg = cfg
        self.impl = impl
        self.mesh = mesh
        self.expert_axis = expert_axis if mesh is not None and expert_axis in mesh.shape else None
        self.tensor_axis = tensor_axis
        self.ep_mode = ep_mode
        self.fmt = fmt
        self.layout = "stacked" if mesh is not None else (default_layout() if layout == "auto" else layout)
        self.placement = placement
        self.collect_stats = collect_stats
        # The dispatch of every call: expert-parallel when the mesh has the expert axis, else `moe_forward`'s
        # default (data-parallel rows when the inputs live on a mesh).
        self.dispatch = None
        if self.expert_axis is not None:
            self.dispatch = expert_parallel(
                ep_mode, mesh, expert_axis=self.expert_axis, tensor_axis=tensor_axis, placement=placement
            )
        self.lora = nnx.data(None)  # a pytree of LoRAParam groups once adapters are set
        if collect_stats:
            n = 1 if self.expert_axis is None else mesh.shape[self.expert_axis]
            self.stats = MoEStatsVariable(MoEStats.zeros(cfg.num_experts, n))
        if placement is not None and self.expert_axis is None:
            raise ValueError(f"placement needs a mesh with the expert axis {expert_axis!r} to place the experts over")
        if mesh is None:
            self.load_params(init_params(cfg, rngs.params(), param_dtype, fmt=fmt, layout=self.layout))
        else:
            if self.expert_axis is None:
                if tensor_axis is not None:
                    raise ValueError(f"tensor_axis={tensor_axis!r} needs expert_axis={expert_axis!r} in the mesh")
            else:
                sharding.check_mesh(cfg, mesh, expert_axis, tensor_axis, placement=placement)
            self.load_params(self._init_sharded(rngs.params(), param_dtype))
        if lora is not None:
            self.set_lora(lora)

    def _init_sharded(self, key: Array, param_dtype: jnp.dtype) -> MoEParams:
        """`init_params` jitted with the sharding of every parameter as output sharding: XLA partitions the
        random generation, so no device ever holds the full (unsharded) weights."""
        abstract = nnx.eval_shape(
            lambda: MoE(self.cfg, rngs=nnx.Rngs(params=key), param_dtype=param_dtype, fmt=self.fmt, layout="stacked")
        )
        # With a placement, the logical experts (E need not divide by n) are replicated until laid out by slot.
        expert_axis = None if self.placement is not None else self.expert_axis
        with nnx.logical_axis_rules(sharding.logical_axis_rules(expert_axis, self.tensor_axis)):
            specs = nnx.get_partition_spec(nnx.state(abstract))
        shardings = {}
        for path, spec in nnx.to_flat_state(specs):
            name = ".".join(map(str, path))
            # The router runs on every device (Gemma-4's per-expert scale too, logically `expert`): replicated.
            spec = jax.sharding.PartitionSpec() if sharding.runs_replicated(name) else spec.get_value()
            shardings[name] = jax.sharding.NamedSharding(self.mesh, spec)
        init = jax.jit(
            functools.partial(init_params, self.cfg, dtype=param_dtype, fmt=self.fmt, layout="stacked"),
            out_shardings=unflatten(shardings, self.fmt),
        )
        return init(key)

    def _on_mesh(self, place, value):
        """`value` placed on the layer's mesh by `place` (`shard_params` or `shard_lora`) with the layer's axes."""
        axes = {"expert_axis": self.expert_axis, "tensor_axis": self.tensor_axis, "placement": self.placement}
        return place(value, self.cfg, self.mesh, **axes)

    def load_params(self, params: MoEParams) -> None:
        """Replace every variable by `params` (e.g. from `moejax.hf.params_from_hf`), keeping the metadata.

        `params` must fit the layer's config (checked at once). The routed experts are converted to the layer's
        layout (a copy when they come in the other one); under a mesh the arrays are placed with
        `moejax.sharding.shard_params` (a no-op for placed ones).
        """
        check_params(params, self.cfg)
        if self.mesh is not None:
            params = self._on_mesh(sharding.shard_params, params)
        else:
            params = dataclasses.replace(params, experts=to_layout(params.experts, self.layout))
        self.fmt = format_of(params.experts)
        specs = specs_of(params, self.cfg)
        groups: dict[str, _Group] = {}
        for name, value in flatten(params).items():
            group, _, field = name.rpartition(".")
            if name in BUFFERS:
                variable = MoEBuffer(value)
            else:
                variable = nnx.Param(value, out_sharding=specs[name].axes, eager_sharding=False)
            owner = self if not group else groups.setdefault(group, _Group())
            setattr(owner, field, variable)
        for group in ("router", "shared"):
            setattr(self, group, groups.get(group))
        if self.layout == "per_expert":
            self.experts = nnx.List([groups[f"experts.{e}"] for e in range(self.cfg.num_experts)])
        else:
            self.experts = groups["experts"]

    def set_lora(self, lora: LoRAParams | None) -> None:
        """Hold the adapter stack `lora` (replacing any previous one; None removes them): A and B of each target as
        `LoRAParam` variables, the scales as `MoEBuffer`s. Under a mesh the arrays are placed by
        `moejax.sharding.shard_lora` (same axes and placement as the experts).

        Raises:
          ValueError: `lora` is one adapter rather than a stack, or does not fit the layer's config
            (`moejax.lora.check_lora`).
        """
        if lora is None:
            self.lora = nnx.data(None)
            return
        if not isinstance(lora, LoRAParams):
            raise TypeError(f"lora must be a moejax.lora.LoRAParams stack, got {type(lora).__name__}")
        if not lora.is_stack:
            raise ValueError("lora is one adapter; the layer holds a stack: moejax.lora.stack([adapter, ...])")
        check_lora(lora, self.cfg)
        if self.mesh is not None:
            lora = self._on_mesh(sharding.shard_lora, lora)
        root = _Group()
        for name, pair in lora.pairs().items():
            holder = root
            for part in name.split("."):
                if not hasattr(holder, part):
                    setattr(holder, part, _Group())
                holder = getattr(holder, part)
            holder.a, holder.b, holder.scale = LoRAParam(pair.a), LoRAParam(pair.b), MoEBuffer(pair.scale)
        self.lora = nnx.data(root)

    @property
    def lora_params(self) -> LoRAParams | None:
        """The adapter stack the layer holds (as `moe_forward(..., lora=)` takes it), or None."""
        if self.lora is None:
            return None
        pairs = {}
        for path, holder in nnx.iter_graph(self.lora):
            if isinstance(holder, _Group) and isinstance(getattr(holder, "a", None), LoRAParam):
                pairs[".".join(map(str, path))] = LoRAPair(holder.a[...], holder.b[...], holder.scale[...])
        return from_pairs(pairs)

    @property
    def params(self) -> MoEParams:
        """The current variables as the `MoEParams` pytree `moe_forward` takes."""
        holders = {"router": self.router, "shared": self.shared}
        if self.layout == "per_expert":
            holders |= {f"experts.{e}": part for e, part in enumerate(self.experts)}
        else:
            holders["experts"] = self.experts
        flat = {}
        for group, holder in holders.items():
            if holder is None:
                continue
            for field, variable in vars(holder).items():
                if isinstance(variable, nnx.Variable):
                    flat[f"{group}.{field}"] = variable[...]
        expert_norm = getattr(self, "expert_norm", None)
        if isinstance(expert_norm, nnx.Variable):
            flat["expert_norm"] = expert_norm[...]
        return dataclasses.replace(unflatten(flat, self.fmt), placement=self.placement)  # the experts' slot order

    def __call__(
        self,
        x: Array,
        token_ids: Array | None = None,
        *,
        adapter_ids: Array | None = None,
        return_stats: bool = False,
        routing: Routing | None = None,
        return_routing: bool = False,
    ) -> Array | MoEOutput:
        """`moe_forward` with the layer's parameters, adapters and dispatch: `y [..., H]`, or a `moejax.MoEOutput`
        with `return_stats` and/or `return_routing` (the same rule and keywords as `moe_forward`)."""
        with_stats = return_stats or self.collect_stats
        lora = None
        if adapter_ids is not None:
            if self.lora is None:
                raise ValueError("adapter_ids given, but the layer holds no adapters: MoE(..., lora=) or set_lora")
            lora = self.lora_params
        result = moe_forward(
            self.params,
            x,
            self.cfg,
            token_ids,
            self.impl,
            lora=lora,
            adapter_ids=adapter_ids,
            return_stats=with_stats,
            routing=routing,
            return_routing=return_routing,
            dispatch=self.dispatch,
        )
        if not (with_stats or return_routing):
            return result
        if self.collect_stats:
            self.stats.set_value(_accumulate(self.stats.get_value(), result.stats))
        return as_output(
            result.y, result.stats, result.routing, return_stats=return_stats, return_routing=return_routing
        )
