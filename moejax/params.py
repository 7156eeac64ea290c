"""The parameter pytrees of an MoE block, their shapes, logical sharding axes and random initialisation.

One layout for every backend and every family, so a checkpoint never depends on the backend:
weights are stored `[in, out]` (applied as `x @ W`), gate and up apart (so the intermediate axis I can be
split over a tensor axis without separating a gate from its up), experts stacked on a leading E axis.
`moejax.hf` converts the Hugging Face layouts (fused, transposed, interleaved) into this one.

`ExpertWeights` is the one place a weight format lives: plans and kernels read an expert's matrices only
through `ExpertWeights.expert(e)`, so a quantized format is added here and every plan reads it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig, SharedExpert

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
class ExpertWeights:
    """Routed experts in dense format (float32 / bfloat16 / float16)."""

    gate: Array  # [E, H, I]
    up: Array  # [E, H, I]
    down: Array  # [E, I, H]
    gate_bias: Array | None = None  # [E, I]
    up_bias: Array | None = None  # [E, I]
    down_bias: Array | None = None  # [E, H]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def expert(self, e: Array | int) -> ExpertWeights:
        """Expert `e`'s matrices (leading axis dropped); `e` may be traced. The single weight-read point."""
        return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False), self)


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
    experts: ExpertWeights
    shared: SharedParams | None = None
    expert_norm: Array | None = None  # [H] weight of the experts' pre-norm (Gemma-4)


# Logical axis names for sharding (flax.nnx `sharding` metadata and `moejax.parallel`).
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "router.kernel": ("embed", None),
    "router.bias": (None,),
    "router.correction_bias": (None,),
    "router.scale": ("embed",),
    "router.per_expert_scale": ("expert",),
    "router.tid2eid": (None, None),
    "experts.gate": ("expert", "embed", "mlp"),
    "experts.up": ("expert", "embed", "mlp"),
    "experts.down": ("expert", "mlp", "embed"),
    "experts.gate_bias": ("expert", "mlp"),
    "experts.up_bias": ("expert", "mlp"),
    "experts.down_bias": ("expert", "embed"),
    "shared.gate": ("embed", "mlp"),
    "shared.up": ("embed", "mlp"),
    "shared.down": ("mlp", "embed"),
    "shared.gate_kernel": ("embed", None),
    "expert_norm": ("embed",),
}
BUFFERS = frozenset({"router.correction_bias", "router.tid2eid"})  # not trainable


def expected_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter `cfg` needs, by dotted name, with its shape."""
    H, E, N, I, K = cfg.hidden_size, cfg.num_experts, cfg.num_selectable, cfg.intermediate_size, cfg.top_k
    shapes: dict[str, tuple[int, ...]] = {"router.kernel": (H, N)}
    if cfg.router_bias:
        shapes["router.bias"] = (N,)
    if cfg.correction_bias:
        shapes["router.correction_bias"] = (N,)
    if cfg.router_prenorm:
        shapes["router.scale"] = (H,)
    if cfg.per_expert_scale:
        shapes["router.per_expert_scale"] = (E,)
    if cfg.hash_routing:
        shapes["router.tid2eid"] = (cfg.vocab_size, K)
    shapes |= {"experts.gate": (E, H, I), "experts.up": (E, H, I), "experts.down": (E, I, H)}
    if cfg.expert_bias:
        shapes |= {"experts.gate_bias": (E, I), "experts.up_bias": (E, I), "experts.down_bias": (E, H)}
    if cfg.shared_expert is not SharedExpert.NONE:
        Is = cfg.shared_intermediate_size
        shapes |= {"shared.gate": (H, Is), "shared.up": (H, Is), "shared.down": (Is, H)}
        if cfg.shared_expert is SharedExpert.SIGMOID_GATED:
            shapes["shared.gate_kernel"] = (H, 1)
    if cfg.expert_prenorm:
        shapes["expert_norm"] = (H,)
    return shapes


def flatten(params: MoEParams) -> dict[str, Array]:
    """`MoEParams` -> {dotted name: array}, None fields left out."""
    flat = {}
    for group in ("router", "experts", "shared"):
        sub = getattr(params, group)
        if sub is None:
            continue
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            if value is not None:
                flat[f"{group}.{f.name}"] = value
    if params.expert_norm is not None:
        flat["expert_norm"] = params.expert_norm
    return flat


def unflatten(flat: dict[str, Array]) -> MoEParams:
    """{dotted name: array} -> `MoEParams` (the inverse of `flatten`)."""
    groups: dict[str, dict[str, Array]] = {"router": {}, "experts": {}, "shared": {}}
    for name, value in flat.items():
        if name == "expert_norm":
            continue
        group, field = name.split(".", 1)
        groups[group][field] = value
    return MoEParams(
        router=RouterParams(**groups["router"]),
        experts=ExpertWeights(**groups["experts"]),
        shared=SharedParams(**groups["shared"]) if groups["shared"] else None,
        expert_norm=flat.get("expert_norm"),
    )


def check_params(params: MoEParams, cfg: MoEConfig) -> None:
    """Raise `ValueError` naming the parameter, expected and actual shape, for any missing/extra/mis-shaped one.

    Shape-only: safe on tracers, called by `moe_forward` at trace time.
    """
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be moejax.MoEParams, got {type(params).__name__}")
    expected = expected_shapes(cfg)
    actual = {name: tuple(jnp.shape(v)) for name, v in flatten(params).items()}
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


def init_params(cfg: MoEConfig, key: Array, dtype: jnp.dtype = jnp.float32) -> MoEParams:
    """Random parameters for experiments and tests, in `dtype` (buffers: correction bias float32, table int32).

    Matrices ~ N(0, 1/fan_in). Unlike a fresh Hugging Face model, the buffers and scales are random too
    (correction bias ~ N(0, 0.1²), scales ~ 1 + N(0, 0.1²), a random hash table) so that every routing feature
    of the config changes the output.
    """
    shapes = expected_shapes(cfg)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes)), strict=True))
    flat = {}
    for name, shape in shapes.items():
        k = keys[name]
        if name == "router.tid2eid":
            flat[name] = jax.random.randint(k, shape, 0, cfg.num_selectable, dtype=jnp.int32)
        elif name == "router.correction_bias":
            flat[name] = 0.1 * jax.random.normal(k, shape, jnp.float32)
        elif name in ("router.scale", "router.per_expert_scale", "expert_norm"):
            flat[name] = (1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        elif name.endswith("bias"):
            flat[name] = (0.1 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        else:
            fan_in = shape[-2]
            flat[name] = (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
    return unflatten(flat)
