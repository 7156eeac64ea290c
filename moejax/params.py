"""The parameter pytree of an MoE block (`MoEParams`), every array's shape, logical sharding axes and initialiser.

Weights are stored `[in, out]` (applied as `x @ W`), gate and up apart (so the intermediate axis I can be split
over a tensor axis without separating a gate from its up). `moejax.hf` converts the Hugging Face layouts (fused,
transposed, interleaved) into this one. The routed experts (`MoEParams.experts`) are owned by `moejax.weights`:
their format declares its arrays, and this module adds the router, the shared expert and the pre-norm around it.
Every consumer (checks, init, flatten/unflatten, the nnx variables, `sharding.shard_params`, the loaders) reads
`array_specs`, so a new weight format changes nothing here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig, SharedExpert
from moejax.draws import as_array, standard_normal
from moejax.placement import Placement
from moejax.weights import (
    ArraySpec,
    ExpertFormat,
    Experts,
    ExpertWeights,
    Layout,
    PerExpert,
    check_experts,
    expert_fields,
    format_of,
    from_fields,
    small_normal,
    to_layout,
)

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterParams:
    kernel: Array  # [H, N] N = experts + zero experts
    bias: Array | None = None  # [N] added to the logits (gpt-oss)
    correction_bias: Array | None = None  # [N] float32, selection only
    scale: Array | None = None  # [H] Gemma-4 router pre-norm scale
    per_expert_scale: Array | None = None  # [E] Gemma-4
    tid2eid: Array | None = None  # [V, K] int32 hash-routing table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedParams:
    gate: Array  # [H, Is]
    up: Array  # [H, Is]
    down: Array  # [Is, H]
    gate_kernel: Array | None = None  # [H, 1] sigmoid gate of the shared expert


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    router: RouterParams
    experts: Experts  # an ExpertFormat (stacked [E, ...]) or PerExpert (the CPU layout)
    shared: SharedParams | None = None
    expert_norm: Array | None = None  # [H] weight of the experts' pre-norm (Gemma-4)
    # The placement whose slot order the experts are in (`moejax.sharding.shard_params(..., placement=)`: `[S, ...]`),
    # None for the logical order `[E, ...]`. Static pytree metadata, so it travels with the arrays through jit,
    # tree maps and checkpoint restores, and `moe_forward_ep` checks it against its `placement=` at trace time.
    placement: Placement | None = dataclasses.field(default=None, metadata={"static": True})


BUFFERS = frozenset({"router.correction_bias", "router.tid2eid"})  # not trainable


def _ones_ish(key: Array, shape: tuple[int, ...], dtype) -> Array:
    """`1 + N(0, 0.1²)`: scales that visibly change the output."""
    return as_array(1.0 + 0.1 * standard_normal(key, shape), dtype)


def _correction_bias(key: Array, shape: tuple[int, ...], dtype) -> Array:
    return as_array(0.1 * standard_normal(key, shape), jnp.float32)


def _hash_table(num_selectable: int):
    def init(key: Array, shape: tuple[int, ...], dtype) -> Array:
        return jax.random.randint(key, shape, 0, num_selectable, dtype=jnp.int32)

    return init


def array_specs(
    cfg: MoEConfig, fmt: type[ExpertFormat] = ExpertWeights, *, per_expert: bool = False
) -> dict[str, ArraySpec]:
    """Every array of `cfg`'s block by dotted name (`router.kernel`, `experts.gate`, `shared.down`, ...).

    The routed experts come from `fmt.declare(cfg)`; with `per_expert`, as `experts.{e}.{field}` of
    `fmt.part_format()` without the expert axis. Shapes, logical axes, dtypes (None: the float parameter dtype)
    and initialisers in one table.
    """
    H, E, N, K = cfg.hidden_size, cfg.num_experts, cfg.num_selectable, cfg.top_k
    specs = {"router.kernel": ArraySpec((H, N), ("embed", None))}
    if cfg.router_bias:
        specs["router.bias"] = ArraySpec((N,), (None,), init=small_normal)
    if cfg.correction_bias:
        specs["router.correction_bias"] = ArraySpec((N,), (None,), "float32", _correction_bias)
    if cfg.router_prenorm:
        specs["router.scale"] = ArraySpec((H,), ("embed",), init=_ones_ish)
    if cfg.per_expert_scale:
        specs["router.per_expert_scale"] = ArraySpec((E,), ("expert",), init=_ones_ish)
    if cfg.hash_routing:
        specs["router.tid2eid"] = ArraySpec((cfg.vocab_size, K), (None, None), "int32", _hash_table(N))
    if per_expert:
        for name, spec in fmt.part_format().declare(cfg).items():
            one = dataclasses.replace(spec, shape=spec.shape[1:], axes=spec.axes[1:])
            specs |= {f"experts.{e}.{name}": one for e in range(E)}
    else:
        specs |= {f"experts.{name}": spec for name, spec in fmt.declare(cfg).items()}
    if cfg.shared_expert is not SharedExpert.NONE:
        Is = cfg.shared_intermediate_size
        specs |= {
            "shared.gate": ArraySpec((H, Is), ("embed", "mlp")),
            "shared.up": ArraySpec((H, Is), ("embed", "mlp")),
            "shared.down": ArraySpec((Is, H), ("mlp", "embed")),
        }
        if cfg.shared_expert is SharedExpert.SIGMOID_GATED:
            specs["shared.gate_kernel"] = ArraySpec((H, 1), ("embed", None))
    if cfg.expert_prenorm:
        specs["expert_norm"] = ArraySpec((H,), ("embed",), init=_ones_ish)
    return specs


def specs_of(params: MoEParams, cfg: MoEConfig) -> dict[str, ArraySpec]:
    """`array_specs` for the format and layout `params` holds."""
    return array_specs(cfg, format_of(params.experts), per_expert=isinstance(params.experts, PerExpert))


def expected_shapes(cfg: MoEConfig, fmt: type[ExpertFormat] = ExpertWeights) -> dict[str, tuple[int, ...]]:
    """Every parameter `cfg` needs (stacked layout), by dotted name, with its shape."""
    return {name: spec.shape for name, spec in array_specs(cfg, fmt).items()}


def flatten(params: MoEParams) -> dict[str, Array]:
    """`MoEParams` -> {dotted name: array}, None fields left out (per-expert weights as `experts.{e}.{field}`).
    The arrays only: `placement` is not an array (`unflatten` gives None; restore it with `dataclasses.replace`)."""
    flat = {}
    for group in ("router", "shared"):
        sub = getattr(params, group)
        if sub is not None:
            flat |= {f"{group}.{f.name}": getattr(sub, f.name) for f in dataclasses.fields(sub)}
    flat |= {f"experts.{name}": value for name, value in expert_fields(params.experts).items()}
    flat["expert_norm"] = params.expert_norm
    return {name: value for name, value in flat.items() if value is not None}


def unflatten(
    flat: dict[str, Array], fmt: type[ExpertFormat] = ExpertWeights, *, experts: Experts | None = None
) -> MoEParams:
    """{dotted name: array} -> `MoEParams` (the inverse of `flatten`); the experts in format `fmt`, or `experts`
    as given (then `flat` holds the other arrays only)."""
    groups: dict[str, dict[str, Array]] = {"router": {}, "experts": {}, "shared": {}}
    for name, value in flat.items():
        if name == "expert_norm":
            continue
        group, field = name.split(".", 1)
        groups[group][field] = value
    return MoEParams(
        router=RouterParams(**groups["router"]),
        experts=from_fields(groups["experts"], fmt) if experts is None else experts,
        shared=SharedParams(**groups["shared"]) if groups["shared"] else None,
        expert_norm=flat.get("expert_norm"),
    )


def check_params(params: MoEParams, cfg: MoEConfig) -> None:
    """Raise `ValueError`/`TypeError` naming the parameter, expected and actual shape (or dtype), for any
    missing, extra or mis-shaped one, and for experts laid out by a placement (`MoEParams.placement`: only the EP
    forward runs those). Shape-only: safe on tracers, called by `moe_forward` at trace time."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be moejax.MoEParams, got {type(params).__name__}")
    if params.placement is not None:
        raise ValueError(
            f"params hold their experts in the slot order of {params.placement.describe()} (laid out by "
            "moejax.sharding.shard_params(..., placement=)): only moejax.parallel.moe_forward_ep(..., placement=) "
            "runs them; this takes the experts in logical order"
        )
    expected = {name: s.shape for name, s in array_specs(cfg).items() if not name.startswith("experts.")}
    actual = {name: tuple(jnp.shape(v)) for name, v in flatten(params).items() if not name.startswith("experts.")}
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing:
        raise ValueError(f"params missing {missing} (expected shapes {[expected[m] for m in missing]}) for {cfg}")
    if extra:
        raise ValueError(f"params has {extra} which this config does not use (shapes {[actual[e] for e in extra]})")
    for name, shape in expected.items():
        if actual[name] != shape:
            raise ValueError(f"params {name}: expected shape {shape}, got {actual[name]}")
    tid2eid = params.router.tid2eid
    if tid2eid is not None and not jnp.issubdtype(tid2eid.dtype, jnp.integer):
        raise TypeError(f"params router.tid2eid must be an integer array, got dtype {tid2eid.dtype}")
    check_experts(params.experts, cfg)


def with_experts_layout(params: MoEParams, layout: Layout = "auto") -> MoEParams:
    """`params` with the routed experts in `layout` (see `moejax.weights.to_layout`); other arrays untouched."""
    return dataclasses.replace(params, experts=to_layout(params.experts, layout))


def init_params(
    cfg: MoEConfig,
    key: Array,
    dtype: jnp.dtype = jnp.float32,
    *,
    fmt: type[ExpertFormat] = ExpertWeights,
    layout: Layout = "auto",
) -> MoEParams:
    """Random parameters for experiments and tests, float arrays in `dtype` (buffers: float32 / int32).

    Matrices ~ N(0, 1/fan_in). Unlike a fresh Hugging Face model, the buffers and scales are random too
    (correction bias ~ N(0, 0.1²), scales ~ 1 + N(0, 0.1²), a random hash table) so that every routing feature
    of the config changes the output. The routed experts come in format `fmt` and `layout` ("auto": per-expert
    on a CPU backend, where XLA reads them in place; stacked elsewhere).
    """
    specs = {name: s for name, s in array_specs(cfg).items() if not name.startswith("experts.")}
    key, experts_key = jax.random.split(key)
    keys = jax.random.split(key, len(specs))
    flat = {
        name: spec.init(k, spec.shape, dtype if spec.dtype is None else spec.dtype)
        for k, (name, spec) in zip(keys, specs.items(), strict=True)
    }
    return unflatten(flat, experts=to_layout(fmt.init(cfg, experts_key, dtype), layout))
