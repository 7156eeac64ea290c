"""Routing: router logits -> `Routing(indices, weights, zero_weight, logits)`.

The order of operations, for every family (docs/FAMILIES.md §17):

1. Router input: `x`, or Gemma-4's `rmsnorm(x) * scale / sqrt(H)` (router_prenorm).
2. Logits `[T, N]` (N = E + zero experts) in float32 or the input dtype (`router_dtype`), plus the logit bias.
3. score_order=BEFORE_TOPK: scores = softmax | sigmoid | sqrt-softplus (float32); selection scores = scores
   + correction bias (selection only), group-limited (-inf outside the kept groups); indices = top-k of the
   selection scores, or the hash table row of the token id; weights = the *unbiased* scores of the selected.
   Renormalise (`/ (sum + eps)`) if `normalize`.
   score_order=AFTER_TOPK: indices = top-k of the raw logits; weights = softmax (gpt-oss) or sigmoid
   (Llama-4) of the k selected logits.
4. `* routed_scaling_factor` (scaling_target=WEIGHTS), `* per_expert_scale[idx]`, rounding to `weights_dtype`.

Inside jit, bad values cannot raise; the behaviour is defined instead (see `moejax.checked_moe_forward` for a
variant that raises):
* non-finite logits: indices stay valid ids in [0, N) (top-k always returns positions), and the weights of that
  row become NaN, so the row's output is NaN; other rows are unaffected.
* out-of-range token ids for hash routing are clamped into [0, vocab_size) (in their own integer type, so ids
  >= 2**31 of a uint32 array, or of a host int64 array, clamp to vocab_size - 1), and table entries into [0, N).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig, ScalingTarget, ScoreOrder, Scoring
from moejax.eager import cached_when_eager
from moejax.ids import HOST_IDS, clip_host_ids
from moejax.lora import LoRAPair, add_delta, pair_delta
from moejax.params import RouterParams

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    indices: Array  # [T, K] int32 in [0, N); ids >= E are zero-computation experts
    weights: Array  # [T, K] float32, the weight of each slot
    logits: Array  # [T, N] float32 router logits
    zero_weight: Array | None = None  # [T] float32, summed weight of the zero experts (LongCat) else None


def rms_normalize(x: Array, eps: float) -> Array:
    """`x * rsqrt(mean(x²) + eps)` computed in float32 and cast back to x's dtype (every family's RMSNorm); the
    sum by `row_sum`'s fixed tree, so a row's norm does not depend on the rows beside it."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(row_sum(xf * xf) / x.shape[-1] + eps)).astype(x.dtype)


def round_to(values: Array, dtype: jnp.dtype) -> Array:
    """Round float32 `values` to the precision of `dtype`, keeping float32.

    `lax.reduce_precision` rather than a pair of casts: XLA may drop a float32->bf16->float32 round trip under
    jit (excess precision), which would make jitted routing differ from eager and from the model.
    """
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return values
    return jax.lax.reduce_precision(values, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def policy_dtype(policy: str, x: Array) -> jnp.dtype:
    return jnp.dtype(jnp.float32) if policy == "float32" else x.dtype


def router_logits(
    router: RouterParams,
    x: Array,
    cfg: MoEConfig,
    lora: LoRAPair | None = None,
    adapter: Array | None = None,
    *,
    matmul: Callable[[Array, Array], Array] | None = None,
    lora_delta: Callable[[LoRAPair, Array, Array], Array] | None = None,
) -> Array:
    """Router logits `[T, N]` float32: accumulated in float32, bias added, rounded once to `cfg.router_dtype`
    (a bf16 Linear in the model dtype rounds its output once, after the bias).

    `matmul(x, w) -> [T, N]` float32 computes `x @ W_router` (the pipeline passes the native, batch-invariant one
    on CPU: `moejax.backends.native_ops`); None: `jnp.dot` accumulating in float32. `lora_delta(lora, x,
    adapter) -> [T, N]` likewise computes the adapters' deltas; None: `moejax.lora.pair_delta`.

    `lora` (a stack's router target, `a [n+1, r, H]`) and `adapter [T]` (the rows' clamped ids): each row's
    delta `s·(x·Aᵀ)·Bᵀ` (float32) is added to the float32 logits before the bias and the rounding, so before
    scores, correction bias, groups and top-k; with Gemma-4's pre-norm, to the pre-normed router input (a LoRA on
    the router's Linear)."""
    if cfg.router_prenorm:
        # Gemma-4: weightless RMSNorm, learned scale, and 1/sqrt(H) (a python float), in the input dtype.
        x = rms_normalize(x, cfg.rms_norm_eps) * router.scale.astype(x.dtype) * cfg.hidden_size**-0.5
    dtype = policy_dtype(cfg.router_dtype, x)
    kernel = router.kernel
    if matmul is None:
        logits = jnp.dot(x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
    else:  # a bfloat16 / float16 kernel read as stored: the native matmul widens it exactly (no float32 copy)
        widen = dtype == jnp.float32 and kernel.dtype in (jnp.bfloat16, jnp.float16)
        logits = matmul(x.astype(dtype), kernel if widen else kernel.astype(dtype))
    if lora is not None:
        delta = (pair_delta if lora_delta is None else lora_delta)(lora, x, adapter)
        logits = add_delta(logits, delta, adapter)
    if router.bias is not None:
        logits = logits + router.bias.astype(dtype).astype(jnp.float32)
    return round_to(logits, dtype)


def row_sum(values: Array) -> Array:
    """`values.sum(-1, keepdims=True)` `[..., 1]` by one fixed tree of elementwise adds over the last axis (halves
    added pairwise, an odd last column carried), so a row's sum does not depend on the rows around it: XLA's
    reduce picks its loop order by the whole array's shape, and a row alone and the same row inside 300 rows got
    sums one ulp apart (so routing weights, so the layer's output, changed with the batch)."""
    while values.shape[-1] > 1:
        half = values.shape[-1] // 2
        pairs = values[..., :half] + values[..., half : 2 * half]
        values = jnp.concatenate([pairs, values[..., 2 * half :]], axis=-1)
    return values


def softmax(logits: Array) -> Array:
    """`jax.nn.softmax(logits, axis=-1)` with the row's sum by `row_sum` (a row's bits independent of its batch)."""
    exp = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    return exp / row_sum(exp)


XLA_SCORES: dict[str, Callable[[Array], Array]] = {
    "softmax": softmax,
    "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus,
}


def xla_scores(kind: str, logits: Array) -> Array:
    """`kind` ("softmax" over the last axis, "sigmoid", "softplus") of float32 `logits` by XLA."""
    return XLA_SCORES[kind](logits)


def scores_from_logits(
    logits: Array, scoring: Scoring, dtype: jnp.dtype = jnp.float32, scores: Callable[[str, Array], Array] | None = None
) -> Array:
    """Scores `[T, N]` float32, rounded to `dtype` after each op as a model running in `dtype` does. `scores(kind,
    logits)` computes softmax / sigmoid / softplus (`xla_scores` when None; the pipeline passes the native,
    batch-invariant one on CPU)."""
    scores = xla_scores if scores is None else scores
    if scoring is Scoring.SOFTMAX:
        return round_to(scores("softmax", logits), dtype)
    if scoring is Scoring.SIGMOID:
        return round_to(scores("sigmoid", logits), dtype)
    return round_to(jnp.sqrt(round_to(scores("softplus", logits), dtype)), dtype)


def limit_to_groups(selection: Array, n_group: int, topk_group: int) -> Array:
    """DeepSeek-V3 group-limited selection: keep the `topk_group` groups with the largest sum of their top-2
    selection scores, and set every other expert to -inf (not 0: a 0 would beat kept negative scores)."""
    T, N = selection.shape
    grouped = selection.reshape(T, n_group, N // n_group)  # [T, G, N/G]
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
    _, kept = jax.lax.top_k(group_score, topk_group)  # [T, topk_group]
    keep = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], kept].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(T, N)


_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def as_token_ids(token_ids, cfg: MoEConfig):
    """`token_ids` as an integer array; host values (a list, a numpy array) are first clipped to [-1, vocab_size]
    (with hash routing; else to int32's range) on the host, in their own integer type, so a host int64 id >= 2**31
    is not wrapped by the int32 cast (and an out-of-range id stays out of range for `checked_moe_forward`):
    `moejax.ids.clip_host_ids`."""
    if not isinstance(token_ids, HOST_IDS):
        return token_ids  # None, a device array, a tracer or another array type: checked by `check_route_inputs`
    low, high = (-1, cfg.vocab_size) if cfg.hash_routing else (np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    return jnp.asarray(clip_host_ids("token_ids", token_ids, int(low), int(high)))


def check_route_inputs(x, cfg: MoEConfig, token_ids) -> None:
    """Shape and dtype checks of `route`/`moe_forward` at trace time: `ValueError`/`TypeError` naming the argument
    and both shapes."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a moejax.MoEConfig, got {type(cfg).__name__}")
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
        check_row_ids("token_ids", token_ids, x)


def check_row_ids(name: str, ids, x) -> None:
    """`TypeError`/`ValueError` naming `name` and both shapes unless `ids` is an integer array of shape
    `x.shape[:-1]` (one id per row)."""
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
        raise TypeError(f"{name} must be an integer array or a list of ints, got {type(ids).__name__}")
    if tuple(ids.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name} must have shape x.shape[:-1]={tuple(x.shape[:-1])}, got {tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got dtype {ids.dtype}")


def selectable(indices, num_selectable: int) -> Array:
    """Whether each id of `indices` lies in [0, num_selectable), compared in the ids' own integer type (a uint32
    id >= 2**31 is large, not negative; no int8 id reaches 128)."""
    info = jnp.iinfo(indices.dtype)
    inside = indices >= 0 if info.min < 0 else jnp.ones(indices.shape, bool)
    return inside & (indices < num_selectable) if num_selectable <= info.max else inside


def as_routing_indices(indices, num_selectable: int):
    """A given routing's ids: host arrays (numpy, any integer type) as int32, clipped to [-1, num_selectable] in
    their own type first (`clip_host_ids`: an int64 2**32 + 1 stays out of range instead of wrapping to 1);
    device arrays and tracers unchanged."""
    if isinstance(indices, np.ndarray | np.integer):
        return jnp.asarray(clip_host_ids("routing.indices", indices, -1, num_selectable))
    return indices


def replayed_indices(indices, num_selectable: int) -> Array:
    """A given routing's ids as int32, each id outside [0, N) replaced by N (N = `num_selectable`): an id no plan
    computes (ids >= E are skipped) and no dispatch mode sends, so its slot contributes nothing on every backend.
    Host ids first go through `as_routing_indices`."""
    indices = as_routing_indices(indices, num_selectable)
    return jnp.where(selectable(indices, num_selectable), indices.astype(jnp.int32), jnp.int32(num_selectable))


def hash_indices(tid2eid: Array, token_ids: Array, cfg: MoEConfig) -> Array:
    """Expert ids `[T, K]` from the token-id table; ids out of range are clamped (documented above).

    The clamp runs in the ids' own integer type before the int32 cast (a uint32 id >= 2**31 is large, not
    negative)."""
    rows = jnp.clip(token_ids, 0, cfg.vocab_size - 1).astype(jnp.int32)
    return jnp.clip(tid2eid[rows].astype(jnp.int32), 0, cfg.num_selectable - 1)


@cached_when_eager(static_argnames=("cfg", "matmul", "scores"), host_id_args=("token_ids", "adapter"))
def route(
    params,
    x: Array,
    cfg: MoEConfig,
    token_ids: Array | None = None,
    *,
    lora: LoRAPair | None = None,
    adapter: Array | None = None,
    matmul: Callable[[Array, Array], Array] | None = None,
    scores: Callable[[str, Array], Array] | None = None,
    lora_delta: Callable[[LoRAPair, Array, Array], Array] | None = None,
    indices: Array | None = None,
) -> Routing:
    """Route tokens `x [T, H]` (or `[..., H]`, flattened) to `cfg.top_k` experts each.

    Args:
      params: `MoEParams` (only `params.router` is read) or a `RouterParams`.
      x: `[..., H]` block input.
      token_ids: `[...]` integer token ids (an array or a list), required with hash routing, ignored otherwise.
      lora: the router target of a LoRA stack (`LoRAParams.router`), or None; its delta is added to the logits
        (`router_logits`), so it changes the selection.
      adapter: `[...]` int32 adapter ids of the rows (in range: `moejax.lora.clamp_ids`), with `lora`.
      matmul: computes the logits' `x @ W_router` (`router_logits`); None: `jnp.dot`.
      scores: `scores(kind, logits)` computes the softmax / sigmoid / softplus of float32 logits
        (`scores_from_logits`); None: `xla_scores`.
      lora_delta: computes the adapters' deltas `lora_delta(lora, x, adapter) -> [T, N]` (`router_logits`);
        None: `moejax.lora.pair_delta`.
      indices: `[T, K]` integer expert ids to use instead of the router's selection (routing replay that keeps
        the router learning: the weights are the router's scores of these ids, computed as for its own
        selection, so they are differentiable w.r.t. the router). Ids outside [0, N) get weight 0.
    Returns:
      `Routing` with `indices [T, K] int32`, `weights [T, K] float32`, `logits [T, N] float32`, and
      `zero_weight [T]` when the config has zero-computation experts.
    """
    token_ids = as_token_ids(token_ids, cfg)
    check_route_inputs(x, cfg, token_ids)
    router = params if isinstance(params, RouterParams) else params.router
    x = x.reshape(-1, x.shape[-1])
    if lora is not None:
        if adapter is None:
            raise ValueError("route: lora given without adapter (the rows' adapter ids)")
        adapter = adapter.reshape(-1)
    logits = router_logits(router, x, cfg, lora, adapter, matmul=matmul, lora_delta=lora_delta)
    scores = xla_scores if scores is None else scores
    K = cfg.top_k
    given = indices is not None
    if given:
        indices = indices.reshape(-1, K)
        valid = (indices >= 0) & (indices < cfg.num_selectable)
        indices = jnp.where(valid, indices, 0).astype(jnp.int32)  # gathered at a valid id, weight zeroed below
    if cfg.score_order is ScoreOrder.AFTER_TOPK:
        if given:
            selected_logits = jnp.where(valid, jnp.take_along_axis(logits, indices, axis=-1), -jnp.inf)
        else:
            selected_logits, indices = jax.lax.top_k(logits, K)
        # gpt-oss: softmax over the k selected logits; Llama-4: sigmoid of each. Float32, rounded below.
        kind = "softmax" if cfg.scoring is Scoring.SOFTMAX else "sigmoid"
        weights = scores(kind, selected_logits)
    else:
        probs = scores_from_logits(logits, cfg.scoring, policy_dtype(cfg.score_dtype, x), scores)  # [T, N]
        if not given:
            indices = _selection(probs, router, token_ids, cfg)
        weights = jnp.take_along_axis(probs, indices, axis=-1)
        if given:
            weights = jnp.where(valid, weights, 0.0)
        if cfg.normalize:
            weights = weights / (row_sum(weights) + cfg.norm_epsilon)
    if cfg.scaling_target is ScalingTarget.WEIGHTS and cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    if cfg.per_expert_scale:
        weights = weights * router.per_expert_scale.astype(jnp.float32)[indices]
    weights = round_to(weights, policy_dtype(cfg.weights_dtype, x))
    indices = indices.astype(jnp.int32)
    if given:  # an invalid id: weight 0 (also after the AFTER_TOPK scores), and an id every backend skips
        weights = jnp.where(valid, weights, 0.0)
        indices = jnp.where(valid, indices, cfg.num_selectable)
    zero_weight = None
    if cfg.num_zero_experts:
        zero = (indices >= cfg.num_experts) & (indices < cfg.num_selectable)
        zero_weight = row_sum(jnp.where(zero, weights, 0.0))[:, 0]
    return Routing(indices=indices, weights=weights, logits=logits, zero_weight=zero_weight)


def _selection(probs: Array, router: RouterParams, token_ids: Array | None, cfg: MoEConfig) -> Array:
    """The experts `[T, K]` a BEFORE_TOPK router selects from its scores `probs [T, N]`: the hash table row of the
    token id, or the top-k of the scores plus the correction bias, group-limited."""
    if cfg.hash_routing:
        return hash_indices(router.tid2eid, token_ids.reshape(-1), cfg)
    selection = probs
    if cfg.correction_bias:
        selection = selection + router.correction_bias.astype(jnp.float32)
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        selection = limit_to_groups(selection, cfg.n_group, cfg.topk_group)
    return jax.lax.top_k(selection, cfg.top_k)[1]
