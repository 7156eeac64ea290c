"""`moe_forward`: route, run the routed experts through an implementation, add the zero-expert and shared terms.

Implementations (`impl=`), resolved in one place (`resolve_impl`):
  "reference"   dense float32: every expert on every token, masked. The oracle.
  "xla_decode"  union-of-experts decode plan (T <= 8, T·K <= 64).
  "xla_grouped" grouped plan over pairs sorted by expert (any T).
  "xla"         xla_decode where it fits, else xla_grouped.
  "pallas_decode", "pallas_grouped", "pallas"
                the Pallas (Mosaic GPU) kernels, the same split as "xla"; on a CPU backend they run in interpret
                mode (slow, for tests). An explicit opt-in until validated on the GPU in use.
  "auto"        "pallas" on a GPU for each kernel that `pallas_kernels/validated.json` lists as validated on this
                device kind and JAX version, else "xla"; a config a kernel cannot serve (NotImplementedError)
                falls back to "xla".
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import checkify

import pallas_kernels
from moejax.config import MoEConfig, ScalingTarget
from moejax.experts import reference_routed, shared_expert_ffn
from moejax.kernel_plans import pallas_decode, pallas_grouped
from moejax.params import ExpertWeights, MoEParams, SharedParams, check_params
from moejax.plans import decode_fits, decode_plan, grouped_plan
from moejax.routing import Routing, rms_normalize, route, router_logits

Array = jax.Array
RoutedImpl = Callable[[ExpertWeights, Array, Routing, MoEConfig], Array]

_ROUTED_IMPLS: dict[str, RoutedImpl] = {
    "reference": reference_routed,
    "xla_decode": decode_plan,
    "xla_grouped": grouped_plan,
    "pallas_decode": pallas_decode,
    "pallas_grouped": pallas_grouped,
}
IMPLS = ("auto", "xla", "pallas", *_ROUTED_IMPLS)
# Each kernel implementation: the pallas_kernels kernel it runs, and the XLA plan that replaces it under "auto".
_KERNELS = {"pallas_decode": ("moe_decode", "xla_decode"), "pallas_grouped": ("moe_grouped", "xla_grouped")}
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def resolve_impl(impl: str, num_rows: int, cfg: MoEConfig) -> str:
    """The concrete routed-expert implementation for `impl` at `num_rows` rows (static: shapes only)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    fits = decode_fits(num_rows, cfg.top_k)
    if impl == "xla":
        return "xla_decode" if fits else "xla_grouped"
    if impl == "pallas":
        return "pallas_decode" if fits else "pallas_grouped"
    if impl == "auto":
        kernel = "pallas_decode" if fits else "pallas_grouped"
        return kernel if kernel_validated(kernel) else _KERNELS[kernel][1]
    if impl in ("xla_decode", "pallas_decode") and not fits:
        raise ValueError(f"impl={impl!r} serves at most 8 rows and 64 slots, got T={num_rows}, K={cfg.top_k}")
    return impl


def kernel_validated(impl: str) -> bool:
    """Whether kernel implementation `impl` may run by default: on a GPU backend, and listed in
    `pallas_kernels/validated.json` for this device kind and JAX version (checked by benchmarks/gpu_bench.py)."""
    if jax.default_backend() != "gpu":
        return False
    device_kind = jax.devices()[0].device_kind
    return pallas_kernels.is_validated(_KERNELS[impl][0], device_kind, jax.__version__)


def routed_implementation(impl: str, num_rows: int, cfg: MoEConfig) -> RoutedImpl:
    """The routed-expert function for `impl`; under "auto" a kernel that raises `NotImplementedError` for this
    config (at trace time) is replaced by its XLA plan."""
    name = resolve_impl(impl, num_rows, cfg)
    routed = _ROUTED_IMPLS[name]
    if impl != "auto" or name not in _KERNELS:
        return routed
    fallback = _ROUTED_IMPLS[_KERNELS[name][1]]

    def kernel_or_fallback(experts: ExpertWeights, x: Array, routing: Routing, cfg: MoEConfig) -> Array:
        try:
            return routed(experts, x, routing, cfg)
        except NotImplementedError:
            return fallback(experts, x, routing, cfg)

    return kernel_or_fallback


def check_inputs(params: MoEParams, x: Array, cfg: MoEConfig, token_ids: Array | None) -> None:
    """Shape and dtype checks at trace time: `ValueError`/`TypeError` naming the argument and both shapes."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a moejax.MoEConfig, got {type(cfg).__name__}")
    check_params(params, cfg)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x must have shape [..., H={cfg.hidden_size}], got x.shape={tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got x.dtype={x.dtype}")
    if cfg.hash_routing and token_ids is None:
        raise ValueError(
            f"this config routes by token id (hash_routing=True): pass token_ids with shape {tuple(x.shape[:-1])}"
        )
    if token_ids is not None:
        if tuple(token_ids.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"token_ids must have shape x.shape[:-1]={tuple(x.shape[:-1])}, got {tuple(token_ids.shape)}"
            )
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise TypeError(f"token_ids must be integers, got dtype {token_ids.dtype}")


def moe_forward(
    params: MoEParams, x: Array, cfg: MoEConfig, token_ids: Array | None = None, impl: str = "auto"
) -> Array:
    """The MoE block: `x [..., H]` -> `[..., H]` in x's dtype. Pure and jit-able (`cfg`, `impl` static).

    1. Route (`moejax.route`).  2. Routed sum `Σ_k w_k·E_k(x_e)` (x_e = x, or Gemma-4's expert pre-norm) by
    `impl`, float32.  3. `× routed_scaling_factor` when it scales the output (Step-3.7).  4. `+ Σ zero-expert
    weights · x_e` (LongCat).  5. `+ shared(x_e)`, sigmoid-gated where the family gates it.  6. Cast to x's dtype.
    """
    check_inputs(params, x, cfg, token_ids)
    flat = x.reshape(-1, cfg.hidden_size)  # [T, H]
    routing = route(params, flat, cfg, token_ids)
    routed_impl = routed_implementation(impl, flat.shape[0], cfg)
    out = combine(params, flat, routing, cfg, routed_impl)
    return out.astype(x.dtype).reshape(x.shape)


def expert_input(params: MoEParams, x: Array, cfg: MoEConfig) -> Array:
    """What the experts see: x, or `rmsnorm(x) · w` (Gemma-4's pre_feedforward_layernorm_2)."""
    if not cfg.expert_prenorm:
        return x
    xf = rms_normalize(x.astype(jnp.float32), cfg.rms_norm_eps)
    return (xf * params.expert_norm.astype(jnp.float32)).astype(x.dtype)


def combine(params: MoEParams, x: Array, routing: Routing, cfg: MoEConfig, routed_impl: RoutedImpl) -> Array:
    """Steps 2-5 of `moe_forward` on flat `x [T, H]`; float32 `[T, H]`."""
    x_e = expert_input(params, x, cfg)
    reference = routed_impl is reference_routed
    experts = jax.tree.map(lambda w: w.astype(jnp.float32), params.experts) if reference else params.experts
    routed = routed_impl(experts, x_e, routing, cfg)
    return add_once_terms(routed, x_e, routing, params.shared, cfg, reference=reference)


def add_once_terms(
    routed: Array,
    x_e: Array,
    routing: Routing,
    shared: SharedParams | None,
    cfg: MoEConfig,
    *,
    reference: bool = False,
    reduce_shared: Callable[[Array], Array] | None = None,
) -> Array:
    """Steps 3-5 of `moe_forward`: the terms added exactly once to the (fully reduced) routed sum `[T, H]`.

    Output scaling (Step-3.7), `+ zero_weight · x_e` (LongCat), `+ shared(x_e)` with its sigmoid gate.
    `reduce_shared` reduces the shared expert's partial sums when its intermediate axis is split (expert
    parallelism passes a psum; the gate multiplies each partial, exact because the reduction is linear).
    """
    out = routed
    if cfg.scaling_target is ScalingTarget.OUTPUT and cfg.routed_scaling_factor != 1.0:
        out = out * cfg.routed_scaling_factor
    if routing.zero_weight is not None:
        out = out + routing.zero_weight[:, None] * x_e.astype(jnp.float32)
    if shared is not None:
        if reference:
            shared = jax.tree.map(lambda w: w.astype(jnp.float32), shared)
        y = shared_expert_ffn(x_e, shared, cfg)  # [T, H]
        out = out + (y if reduce_shared is None else reduce_shared(y))
    return out


def checked_moe_forward(
    params: MoEParams, x: Array, cfg: MoEConfig, token_ids: Array | None = None, impl: str = "auto"
) -> Array:
    """`moe_forward` that raises on what the unchecked forward defines away inside jit.

    Raises `checkify.JaxRuntimeError` when any router logit is not finite, or (hash routing) a token id is
    outside [0, vocab_size) or a table entry outside [0, num_experts + num_zero_experts). Jitted with
    `jax.experimental.checkify`; costs one extra router matmul (shared with the forward by XLA's CSE).
    """
    check_inputs(params, x, cfg, token_ids)
    err, y = _checked_forward(params, x, token_ids, cfg, impl)
    err.throw()
    return y


def _forward_with_checks(params, x, token_ids, cfg, impl):
    logits = router_logits(params.router, x.reshape(-1, cfg.hidden_size), cfg)
    checkify.check(jnp.all(jnp.isfinite(logits)), "moejax: non-finite router logits")
    if cfg.hash_routing:
        in_range = (token_ids >= 0) & (token_ids < cfg.vocab_size)
        checkify.check(jnp.all(in_range), f"moejax: token_ids outside [0, vocab_size={cfg.vocab_size})")
        table = params.router.tid2eid
        ok_table = (table >= 0) & (table < cfg.num_selectable)
        checkify.check(jnp.all(ok_table), f"moejax: tid2eid entries outside [0, {cfg.num_selectable})")
    return moe_forward(params, x, cfg, token_ids, impl)


_checked_forward = jax.jit(checkify.checkify(_forward_with_checks), static_argnums=(3, 4))
