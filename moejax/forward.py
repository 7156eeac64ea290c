"""`moe_forward`: the one pipeline of the MoE block, used by every entry point: route -> dispatch -> routed experts
-> once-terms (zero experts, shared expert).

Where the rows and experts go is the dispatch mode (`moejax.dispatch`); how the routed experts are computed is
`impl=` (`moejax.backends`, called from `routed_experts` only). Called outside jit, `moe_forward` runs through a
cached `jax.jit` (`moejax.eager`): one compiled program per shape, not one per call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from moejax.backends import BACKENDS, IMPLS, candidates, resolve_impl, run_routed
from moejax.backends.native_ops import LayerOps, layer_ops
from moejax.backends.xla import grouped_block_rows
from moejax.config import MoEConfig, ScalingTarget
from moejax.dispatch import Dispatch, Local, Rows, mesh_of
from moejax.eager import cached_when_eager
from moejax.lora import ExpertLoRA, LoRAParams, SharedLoRA, adapt, as_adapter_ids, check_lora, clamp_ids
from moejax.params import MoEParams, SharedParams, check_params
from moejax.routing import (
    Routing,
    as_routing_indices,
    as_token_ids,
    check_route_inputs,
    check_row_ids,
    replayed_indices,
    rms_normalize,
    route,
    router_logits,
    selectable,
)
from moejax.slots import Slots, expert_activation, shared_expert_ffn, slots_from_routing
from moejax.stats import MoEStats
from moejax.weights import Experts

Array = jax.Array
__all__ = ["IMPLS", "MoEOutput", "checked_moe_forward", "chosen_impl", "moe_forward", "moe_forward_with_checks"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEOutput:
    """What an MoE call returns when extras are asked for (`return_stats=True` and/or `return_routing=True`);
    without them the call returns `y` alone. A pytree: it passes through `jax.jit`, `jax.lax.scan` and
    `jax.tree.map`."""

    y: Array  # [..., H] the block's output, in x's dtype
    stats: MoEStats | None = None  # the call's routing statistics (on device) when return_stats=True, else None
    routing: Routing | None = None  # the routing used ([T, ...] rows) when return_routing=True, else None


def as_output(y: Array, stats: MoEStats | None, routing: Routing | None, *, return_stats: bool, return_routing: bool):
    """The one return rule of every entry point: `y` when no extras are asked for, else a `MoEOutput` holding
    the extras asked for (the others None)."""
    if not (return_stats or return_routing):
        return y
    return MoEOutput(y, stats if return_stats else None, routing if return_routing else None)


def check_inputs(params: MoEParams, x: Array, cfg: MoEConfig, token_ids: Array | None) -> None:
    """Shape and dtype checks at trace time: `ValueError`/`TypeError` naming the argument and both shapes."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a moejax.MoEConfig, got {type(cfg).__name__}")
    check_params(params, cfg)
    check_route_inputs(x, cfg, token_ids)


def _checked_inputs(params, x, cfg, token_ids, lora, adapter_ids, routing=None):
    """The token ids, adapter ids and routing as arrays, after the trace-time checks of every input; host routing
    ids are clipped to [-1, num_selectable] in their own type (out-of-range ids stay out of range for the check)."""
    token_ids = as_token_ids(token_ids, cfg)
    check_inputs(params, x, cfg, token_ids)
    check_routing(routing, x, cfg)
    if routing is not None:
        routing = dataclasses.replace(routing, indices=as_routing_indices(routing.indices, cfg.num_selectable))
    return token_ids, check_lora_inputs(lora, adapter_ids, x, cfg), routing


def check_lora_inputs(lora: LoRAParams | None, adapter_ids, x: Array, cfg: MoEConfig):
    """The adapter ids as an integer array, after trace-time checks: `lora` and `adapter_ids` both or neither,
    `lora` a stack fitting `cfg` (`moejax.lora.check_lora`), ids integer with shape `x.shape[:-1]`. Host ids (a
    list, a numpy array of any integer type) become int32 without wrapping (`moejax.lora.as_adapter_ids`: an id
    outside the stack stays outside, for the clamp and the checked forward). Raises `TypeError`/`ValueError`
    naming the argument and both shapes."""
    if lora is None and adapter_ids is None:
        return None
    if lora is None:
        raise ValueError("adapter_ids given without lora: pass the adapters (lora=moejax.lora.stack([...]))")
    if adapter_ids is None:
        raise ValueError(f"lora given without adapter_ids: pass int32 ids of shape x.shape[:-1]={tuple(x.shape[:-1])}")
    if not isinstance(lora, LoRAParams):
        raise TypeError(f"lora must be a moejax.lora.LoRAParams stack (moejax.lora.stack), got {type(lora).__name__}")
    if not lora.is_stack:
        raise ValueError(
            "lora is one adapter, not a stack: moe_forward takes stacked adapters with per-row ids; "
            "use moejax.lora.stack([adapter]) and adapter_ids=1 for its rows (0 = no adapter)"
        )
    check_lora(lora, cfg)
    adapter_ids = as_adapter_ids(adapter_ids, lora.num_ids)  # host ids: clipped in their own type, never wrapped
    check_row_ids("adapter_ids", adapter_ids, x)
    return adapter_ids


@cached_when_eager(
    static_argnames=("cfg", "impl", "return_stats", "return_routing", "dispatch"),
    host_id_args=("token_ids", "adapter_ids"),
)
def moe_forward(
    params: MoEParams,
    x: Array,
    cfg: MoEConfig,
    token_ids: Array | None = None,
    impl: str = "auto",
    *,
    lora: LoRAParams | None = None,
    adapter_ids: Array | None = None,
    return_stats: bool = False,
    routing: Routing | None = None,
    return_routing: bool = False,
    dispatch: Dispatch | None = None,
) -> Array | MoEOutput:
    """The MoE block: `x [..., H]` -> `[..., H]` in x's dtype. Pure and jit-able (`cfg`, `impl`, `dispatch` static).

    1. Route (`moejax.route`), or take the given `routing`.  2. Routed sum `Σ_k w_k·E_k(x_e)` (x_e = x, or
    Gemma-4's expert pre-norm) by `impl` (`moejax.backends`), float32, on the devices `dispatch` puts the rows and
    experts on.  3. `× routed_scaling_factor` when it scales the output (Step-3.7).  4. `+ Σ zero-expert weights ·
    x_e` (LongCat).  5. `+ shared(x_e)`, sigmoid-gated where the family gates it.  6. Cast to x's dtype. The routed
    experts may be in either layout (`moejax.weights`): stacked or per-expert.

    Returns `y [..., H]`; with `return_stats=True` and/or `return_routing=True`, a `MoEOutput` instead: `.y`,
    `.stats` (the call's `MoEStats`, on device) and `.routing` (the `Routing` used), each extra None unless asked
    for.

    Routing replay: `routing` (a `moejax.Routing` as `route` or `return_routing=True` returns it: `indices [T, K]`
    integer, `weights [T, K]` float, `zero_weight [T]` for families with zero experts, else None; T = rows of x;
    `logits` is not read) skips the router: forward with the returned routing equals the original bit for bit.
    Gradients then reach x and the experts through the routing weights held constant, never the router (its
    LoRA adapters included: with `routing`, the router adapters are not applied). A routing whose `weights` (and
    `zero_weight`) are None replays the selection only: the router runs, and the weights are its scores of the
    given ids, computed as for its own selection (`route(..., indices=)`), so gradients reach the router and its
    adapters too (what RL trainers replaying a rollout's experts use); `return_routing` then returns those
    weights.

    LoRA: `lora` is a stack of adapters (`moejax.lora.stack`; id 0 = no adapter) and `adapter_ids` (integer,
    shape `x.shape[:-1]`) names each row's adapter; both are traced, so any mix of adapters is one compiled
    program. The router delta is added to the logits before the selection, the expert and shared-expert deltas
    to their projections (`moejax.lora`); rows with id 0 get the base output bit for bit. Ids outside [0, n]
    are clamped to 0 (no adapter) inside jit; `checked_moe_forward` raises for them instead. The Pallas kernels
    do not apply adapters: with `lora`, impl="auto" runs the native CPU kernels (which do) or the XLA/CPU plans.
    Differentiable under `jax.jit` (`jax.grad` w.r.t. the adapters, x and the parameters) through every XLA/CPU
    plan and the native path (`moejax.backends`).

    Dispatch (`moejax.dispatch`): `Local` (one device), `Rows` (x's rows split over a mesh: the default when x or
    params live on several devices, Explicit or Auto axes; the statistics are summed over the row shards),
    `EPPsum` / `EPAllToAll` (experts split over a mesh axis, `moejax.parallel.moe_forward_ep`). An empty batch (no
    rows) gives an empty output.
    """
    token_ids = as_token_ids(token_ids, cfg)
    if dispatch is not None and not isinstance(dispatch, Dispatch):
        raise TypeError(f"dispatch must be a moejax.dispatch.Dispatch (e.g. Local()), got {type(dispatch).__name__}")
    checking = Local() if dispatch is None else dispatch
    operands, views = checking.check((params, lora), cfg, impl)
    check_inputs(views[0], x, cfg, token_ids)
    adapter_ids = check_lora_inputs(views[1], adapter_ids, x, cfg)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    check_routing(routing, x, cfg)
    if dispatch is None:
        dispatch = Rows(mesh) if (mesh := mesh_of(operands, x, token_ids)) is not None else Local()
    T = math.prod(x.shape[:-1])
    if T == 0:
        stats = dataclasses.replace(MoEStats.zeros(cfg.num_experts, dispatch.num_devices), calls=jnp.int32(1))
        replayed = routing is not None and routing.weights is not None
        outputs, used = {"y": jnp.zeros_like(x)}, routing if replayed else _empty_routing(x, cfg)
    else:
        rows = {"x": x}
        if token_ids is not None:
            rows["token_ids"] = token_ids
        if lora is not None:
            rows["adapter"] = clamp_ids(adapter_ids, lora.num_ids)
        if routing is not None:
            rows["routing"] = _routing_rows(routing, x.shape[:-1], cfg)
        body = functools.partial(
            _pipeline,
            cfg=cfg,
            impl=impl,
            dispatch=dispatch,
            num_tokens=T,
            with_stats=return_stats,
            with_routing=return_routing and (routing is None or routing.weights is None),
        )
        outputs, stats = dispatch.run(body, operands, rows, cfg=cfg, with_stats=return_stats)
        held = routing is not None and routing.weights is not None
        used = routing if held else _flat_routing(outputs.get("routing"), x.shape[:-1])
    return as_output(outputs["y"], stats, used, return_stats=return_stats, return_routing=return_routing)


def _pipeline(operands, rows, *, cfg, impl, dispatch, num_tokens, with_stats, with_routing):
    """The pipeline on the rows one device holds (every leaf of `rows` leads with x's leading dims): route ->
    expert input -> slots -> `dispatch.routed_sum` (around the expert step) -> once-terms -> x's dtype."""
    params, lora = operands
    x = rows["x"]
    lead = x.shape[:-1]
    flat = {name: value.reshape(-1, *value.shape[len(lead) :]) for name, value in rows.items() if name != "routing"}
    given = jax.tree.map(lambda a: a.reshape(-1, *a.shape[len(lead) :]), rows.get("routing"))
    ops = layer_ops(impl)  # the router's and shared expert's matmuls natively on CPU (batch-invariant)
    routing, x_e, slots = _expert_operands(params, lora, flat, given, cfg, ops)
    adapter = flat.get("adapter")
    step = ExpertStep(impl, params.experts, cfg, None if lora is None else lora.experts)
    routed, stats = dispatch.routed_sum(step, x_e, slots, routing, cfg=cfg, num_tokens=num_tokens)
    out = add_once_terms(
        routed,
        x_e,
        routing,
        params.shared,
        cfg,
        float32=impl == "reference",
        reduce_shared=dispatch.reduce_shared,
        lora=None if lora is None else lora.shared,
        adapter=adapter,
        ops=ops,
    )
    outputs = {"y": out.astype(x.dtype).reshape(x.shape)}
    if with_routing:
        outputs["routing"] = jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), routing)
    return outputs, stats if with_stats else None


@dataclasses.dataclass(frozen=True)
class ExpertStep:
    """The pipeline's expert step over the experts one device holds: `step(x_e [R, H], slots [R, K]) -> [R, H]`
    float32 (`routed_experts`). Dispatch modes call it on the rows and slots they choose."""

    impl: str
    experts: Experts
    cfg: MoEConfig
    adapters: ExpertLoRA | None = None

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def __call__(self, x_e: Array, slots: Slots, *, num_pairs: int | None = None) -> Array:
        return routed_experts(self.impl, self.experts, x_e, slots, self.cfg, lora=self.adapters, num_pairs=num_pairs)


def routed_experts(
    impl: str,
    experts: Experts,
    x_e: Array,
    slots: Slots,
    cfg: MoEConfig,
    *,
    lora: ExpertLoRA | None = None,
    num_pairs: int | None = None,
) -> Array:
    """The routed sum `[R, H]` float32 of `experts` over `slots` by `impl` (the one call of the backends).

    `num_pairs`: the global number of (token, slot) pairs when these rows are a part of them (expert
    parallelism); sizes the grouped plan's blocks for the expected load per expert rather than for the R·K slots
    seen here, most of which are not local."""
    block_rows = None if num_pairs is None else grouped_block_rows(num_pairs, cfg.num_experts)
    return run_routed(impl, adapt(experts, lora), x_e, slots, expert_activation(cfg), block_rows=block_rows)


def check_routing(routing: Routing | None, x: Array, cfg: MoEConfig) -> None:
    """Trace-time checks of a given routing: `ValueError` naming the field and both shapes (or the dtype)."""
    if routing is None:
        return
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a moejax.Routing, got {type(routing).__name__}")
    T, K = math.prod(x.shape[:-1]), cfg.top_k
    expected = {"indices": (T, K), "weights": (T, K), "zero_weight": (T,) if cfg.num_zero_experts else None}
    if routing.weights is None:  # the selection alone: the router computes the weights
        if routing.zero_weight is not None:
            raise ValueError("routing.zero_weight must be None when routing.weights is None (both are recomputed)")
        expected = {"indices": (T, K)}
    for field, shape in expected.items():
        value = getattr(routing, field)
        if shape is None:
            if value is not None:
                raise ValueError("routing.zero_weight must be None: the config has no zero experts")
            continue
        if value is None or not hasattr(value, "shape"):
            raise ValueError(f"routing.{field} must be an array of shape {shape}, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(
                f"routing.{field} must have shape {shape} (T={T} rows of x, K={K}), got {tuple(value.shape)}"
            )
        kind = jnp.integer if field == "indices" else jnp.floating
        if not jnp.issubdtype(value.dtype, kind):
            raise ValueError(f"routing.{field} must be {kind.__name__} (shape {shape}), got dtype {value.dtype}")


def _routing_rows(routing: Routing, lead: tuple[int, ...], cfg: MoEConfig) -> Routing:
    """The given routing as per-row operands (leading dims those of x), without the logits (not read); ids
    outside [0, num_selectable) become num_selectable, which every backend and dispatch mode skips
    (`moejax.routing.replayed_indices`)."""
    rows = lambda a: None if a is None else a.reshape(*lead, *a.shape[1:])
    indices = replayed_indices(routing.indices, cfg.num_selectable)
    return Routing(rows(indices), rows(routing.weights), None, rows(routing.zero_weight))


def _flat_routing(routing: Routing | None, lead: tuple[int, ...]) -> Routing | None:
    """The routing the pipeline returned (leading dims those of x), back to `[T, ...]` rows."""
    T = math.prod(lead)
    return None if routing is None else jax.tree.map(lambda a: a.reshape(T, *a.shape[len(lead) :]), routing)


def _empty_routing(x: Array, cfg: MoEConfig) -> Routing:
    """The routing of no rows."""
    K, N = cfg.top_k, cfg.num_selectable
    zero_weight = jnp.zeros((0,), jnp.float32) if cfg.num_zero_experts else None
    return Routing(
        jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K), jnp.float32), jnp.zeros((0, N), jnp.float32), zero_weight
    )


def _expert_operands(params, lora, rows: dict[str, Array], routing: Routing | None, cfg: MoEConfig, ops=None):
    """Steps 1-2 of the pipeline on flat rows `[T, ...]`: the routing (the given one, else the router's, with the
    router adapters of the rows' ids), the expert input `[T, H]` and the slots `[T, K]` (carrying the ids).
    `ops`: the native layer ops (`layer_ops`) or None."""
    adapter = rows.get("adapter")
    if routing is None or routing.weights is None:  # the router's, or its weights of a replayed selection
        adapters = {} if lora is None else {"lora": lora.router, "adapter": adapter}
        native = {} if ops is None else {"matmul": ops.matmul, "scores": ops.scores, "lora_delta": ops.lora_delta}
        indices = None if routing is None else routing.indices
        routing = route(params, rows["x"], cfg, rows.get("token_ids"), **adapters, **native, indices=indices)
    return routing, expert_input(params, rows["x"], cfg), slots_from_routing(routing, cfg, adapter)


def chosen_impl(params, x, cfg, token_ids=None, impl="auto", *, lora=None, platform: str | None = None) -> str:
    """The routed-expert backend `moe_forward(params, x, cfg, token_ids, impl, lora=lora)` runs in a program
    lowered for `platform` ("cpu", "cuda", "rocm", "tpu"; default: JAX's default backend), e.g. "native",
    "cpu_grouped", "xla_decode", "ragged", "pallas_grouped" (`moejax.IMPLS` lists them).

    Nothing is computed: the call is traced abstractly (params and x may be `jax.ShapeDtypeStruct`s), and the
    choices "auto" makes while lowering (the native kernels on CPU, `ragged_dot` on TPU/GPU, the Pallas kernels on
    validated devices) are lowered for `platform` alone. Expert parallelism runs the same choice on each device's
    rows. Raises `NotImplementedError` when no backend serves the call, as the forward would.
    """
    platform = platform or jax.default_backend()

    def inputs(params, x, token_ids):
        rows = {"x": x.reshape(-1, cfg.hidden_size)}
        if token_ids is not None:
            rows["token_ids"] = token_ids.reshape(-1)
        if lora is not None:
            rows["adapter"] = jnp.zeros(rows["x"].shape[:1], jnp.int32)
        return _expert_operands(params, lora, rows, None, cfg)[1:]

    x_e, slots = jax.eval_shape(inputs, params, x, token_ids)
    experts = adapt(params.experts, None if lora is None else lora.experts)
    act = expert_activation(cfg)
    first = resolve_impl(impl, experts, x_e, slots, act)
    if impl != "auto":
        return first
    names = candidates(impl, *slots.indices.shape)
    for name in names[names.index(first) :]:
        try:
            resolve_impl(name, experts, x_e, slots, act)
        except NotImplementedError:
            continue
        chooser = BACKENDS[name].chooser
        if chooser is None or _chosen_when_lowered(chooser, (experts, x_e, slots), platform):
            return name
    raise NotImplementedError(f"impl={impl!r}: no implementation serves this call on {platform}")


def _chosen_when_lowered(chooser, operands, platform: str) -> bool:
    """Whether `chooser(run, fallback, *operands)` keeps `run` in a program lowered for `platform` (each branch
    replaced by a constant that marks it in the lowered text)."""
    run, fallback = 7_340_033, 5_242_883
    pick = lambda *ops: chooser(lambda *_: jnp.int32(run), lambda *_: jnp.int32(fallback), *ops)
    text = jax.jit(pick).trace(*operands).lower(lowering_platforms=(platform,)).as_text()
    return f"dense<{run}>" in text


def expert_input(params: MoEParams, x: Array, cfg: MoEConfig) -> Array:
    """What the experts see: x, or `rmsnorm(x) · w` (Gemma-4's pre_feedforward_layernorm_2)."""
    if not cfg.expert_prenorm:
        return x
    xf = rms_normalize(x.astype(jnp.float32), cfg.rms_norm_eps)
    return (xf * params.expert_norm.astype(jnp.float32)).astype(x.dtype)


def add_once_terms(
    routed: Array,
    x_e: Array,
    routing: Routing,
    shared: SharedParams | None,
    cfg: MoEConfig,
    *,
    float32: bool = False,
    reduce_shared: Callable[[Array], Array] | None = None,
    lora: SharedLoRA | None = None,
    adapter: Array | None = None,
    ops: LayerOps | None = None,
) -> Array:
    """Steps 3-5 of `moe_forward`: the terms added exactly once to the (fully reduced) routed sum `[T, H]`.

    Output scaling (Step-3.7), `+ zero_weight · x_e` (LongCat), `+ shared(x_e)` with its sigmoid gate (in float32
    with `float32=True`, the reference). `reduce_shared` reduces the shared expert's partial sums when its
    intermediate axis is split (expert parallelism passes a psum; the gate multiplies each partial, exact because
    the reduction is linear). `lora`/`adapter`: the shared expert's adapters and the rows' ids
    (`shared_expert_ffn`). `ops`: the native layer ops for the shared expert (`layer_ops`), or None.
    """
    out = routed
    if cfg.scaling_target is ScalingTarget.OUTPUT and cfg.routed_scaling_factor != 1.0:
        out = out * cfg.routed_scaling_factor
    if routing.zero_weight is not None:
        out = out + routing.zero_weight[:, None] * x_e.astype(jnp.float32)
    if shared is not None:
        y = shared_expert_ffn(x_e, shared, cfg, float32=float32, lora=lora, adapter=adapter, ops=ops)  # [T, H]
        out = out + (y if reduce_shared is None else reduce_shared(y))
    return out


def checked_moe_forward(
    params, x, cfg, token_ids=None, impl="auto", *, lora=None, adapter_ids=None, routing=None
) -> Array:
    """`moe_forward` (its arguments and types) that raises on what the unchecked forward defines away inside jit.
    Call it outside jit.

    Raises `checkify.JaxRuntimeError` when any router logit is not finite, (hash routing) a token id is
    outside [0, vocab_size) or a table entry outside [0, num_experts + num_zero_experts), (LoRA) an adapter
    id is outside [0, n] for a stack of n adapters, or (routing replay) an id of `routing.indices` is outside
    [0, num_experts + num_zero_experts). With `routing` the router is not run, so its checks are skipped.
    Jitted with `jax.experimental.checkify`; without `routing` costs one extra router matmul (shared with the
    forward by XLA's CSE).

    Inside your own `jax.jit` a check cannot raise: use `moe_forward_with_checks` there, and functionalize the
    checks of the whole step with `checkify.checkify(jax.jit(step))` (see its docstring).
    """
    token_ids, adapter_ids, routing = _checked_inputs(params, x, cfg, token_ids, lora, adapter_ids, routing)
    operands = (x, token_ids, adapter_ids, *jax.tree.leaves((params, lora, routing)))
    if any(isinstance(a, jax.core.Tracer) for a in operands):
        raise TypeError(
            "checked_moe_forward raises, so it runs outside jit; inside a traced function call "
            "moejax.forward.moe_forward_with_checks and wrap the step: checkify.checkify(jax.jit(step))"
        )
    err, y = _checked_forward(params, x, token_ids, lora, adapter_ids, routing, cfg, impl)
    err.throw()
    return y


def moe_forward_with_checks(
    params, x, cfg, token_ids=None, impl="auto", *, lora=None, adapter_ids=None, routing=None
) -> Array:
    """`moe_forward` plus the `checkify.check`s of `checked_moe_forward` (same arguments, same types), for use
    inside the caller's own jit.

    The checks are left for the caller to functionalize, together with any checks of its own:

        step = jax.jit(lambda p, x: model(p, x))  # model calls moe_forward_with_checks
        err, y = checkify.checkify(step)(params, x)
        err.throw()  # or inspect err.get()

    Called with no enclosing `checkify.checkify`, tracing fails ("Cannot abstractly evaluate a checkify.check
    which was not functionalized"). Outside jit, `checked_moe_forward` does both steps for you.
    """
    token_ids, adapter_ids, routing = _checked_inputs(params, x, cfg, token_ids, lora, adapter_ids, routing)
    if lora is not None:
        n = lora.num_ids - 1
        in_range = (adapter_ids >= 0) & (adapter_ids <= n)
        checkify.check(jnp.all(in_range), f"moejax: adapter_ids outside [0, {n}] (the stack's adapters, 0 = none)")
    if routing is not None:
        N = cfg.num_selectable
        in_range = selectable(routing.indices, N)
        checkify.check(jnp.all(in_range), f"moejax: routing.indices outside [0, num_selectable={N})")
    else:
        router_lora = None if lora is None else lora.router
        adapter = None if lora is None else clamp_ids(adapter_ids, lora.num_ids).reshape(-1)
        logits = router_logits(params.router, x.reshape(-1, cfg.hidden_size), cfg, router_lora, adapter)
        checkify.check(jnp.all(jnp.isfinite(logits)), "moejax: non-finite router logits")
        if cfg.hash_routing:
            in_range = (token_ids >= 0) & (token_ids < cfg.vocab_size)
            checkify.check(jnp.all(in_range), f"moejax: token_ids outside [0, vocab_size={cfg.vocab_size})")
            table = params.router.tid2eid
            ok_table = (table >= 0) & (table < cfg.num_selectable)
            checkify.check(jnp.all(ok_table), f"moejax: tid2eid entries outside [0, {cfg.num_selectable})")
    return moe_forward(params, x, cfg, token_ids, impl, lora=lora, adapter_ids=adapter_ids, routing=routing)


_checked_forward = jax.jit(
    checkify.checkify(
        lambda params, x, token_ids, lora, adapter_ids, routing, cfg, impl: moe_forward_with_checks(
            params, x, cfg, token_ids, impl, lora=lora, adapter_ids=adapter_ids, routing=routing
        )
    ),
    static_argnums=(6, 7),
)
