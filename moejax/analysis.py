"""Routing statistics, expert load under a placement, and synthetic routing traces.

Statistics of routed expert ids (`Routing.indices`, a trace), on device in jnp, each jitted (`cfg`, window
sizes and placements static) and usable inside a jitted step; they take numpy or jax arrays. `cfg` is a
`MoEConfig` or the number of routed experts E; ids >= E (zero-computation experts) are left out everywhere.

  expert_load      `[E]` pairs per expert            union_size      distinct experts of a batch
  mean_union       mean union over windows of w      union_curve     the same for several w (decode cost curve)
  co_selection     `[E, E]` tokens choosing both     routing_entropy entropy of the load distribution (bits)
  imbalance        max / mean of any load vector     load_imbalance  per expert, or per device for a placement
  slot_load        `[S]` pairs per physical slot     device_load     `[n]` pairs per device, under a placement

Synthetic traces, on the host in numpy (sampling is sequential over tokens): `TraceModel` draws `[T, K]` expert
ids, distinct within a token, with a Zipf skew over experts and a temporal correlation between consecutive
tokens, reproducibly from a seed; `calibrate` fits its skew and correlation to a target union curve.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig
from moejax.placement import Placement

Array = jax.Array


def _num_experts(cfg: MoEConfig | int) -> int:
    return cfg.num_experts if isinstance(cfg, MoEConfig) else int(cfg)


# -- statistics (on device) ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="cfg")
def expert_load(indices: Array, cfg: MoEConfig | int) -> Array:
    """How many (token, slot) pairs chose each routed expert: `[E]` int32 (`indices [..., K]`)."""
    E = _num_experts(cfg)
    ids = jnp.asarray(indices).reshape(-1)
    return jnp.bincount(jnp.where((ids >= 0) & (ids < E), ids, E), length=E + 1)[:-1].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg")
def union_size(indices: Array, cfg: MoEConfig | int) -> Array:
    """Number of distinct routed experts selected by `indices [T, K]` (int32 scalar)."""
    return jnp.sum(expert_load(indices, cfg) > 0)


def _presence(indices: Array, E: int) -> Array:
    """`[T, E]` int32: 1 where token t chose routed expert e (`indices [T, K]`)."""
    ids = jnp.asarray(indices)
    ids = jnp.where((ids >= 0) & (ids < E), ids, E)  # E: not a routed expert, dropped by the scatter
    return jnp.zeros((ids.shape[0], E), jnp.int32).at[jnp.arange(ids.shape[0])[:, None], ids].set(1, mode="drop")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _mean_unions(indices: Array, E: int, windows: Sequence[int]) -> Array:
    ids = jnp.asarray(indices)
    if ids.ndim == 2:
        ids = ids[None]
    if ids.ndim != 3:
        raise ValueError(f"indices must have shape [T, K] or [B, T, K], got {ids.shape}")
    ids = jnp.where((ids >= 0) & (ids < E), ids, E)  # [B, T, K]; E: not a routed expert
    T = ids.shape[1]
    means = []
    for w in windows:
        if w > T:
            means.append(jnp.float32(jnp.nan))
            continue
        # The w·K ids of each window [t, t+w), sorted: its union size is the number of distinct ids < E.
        window = jnp.sort(jnp.concatenate([ids[:, j : T - w + 1 + j] for j in range(w)], axis=-1), axis=-1)
        first = window[..., 0] < E
        new = (window[..., 1:] != window[..., :-1]) & (window[..., 1:] < E)
        means.append(jnp.mean((first + new.sum(-1)).astype(jnp.float32)))
    return jnp.stack(means)


def mean_union(indices: Array, cfg: MoEConfig | int, window: int) -> Array:
    """Mean number of distinct routed experts over all windows of `window` consecutive tokens. float32 scalar.

    Args:
      indices: `[T, K]`, or `[B, T, K]` for B independent sequences (windows never cross sequences).
      cfg: the config or E.
      window: 1 <= w <= T (static); a speculative-decoding verify step over w rows reads this many experts.
    """
    return union_curve(indices, cfg, windows=(window,))[0]


def union_curve(
    indices: Array, cfg: MoEConfig | int, max_window: int = 4, *, windows: Sequence[int] | None = None
) -> Array:
    """Mean union size over windows of w = 1..max_window (or each w of `windows`) consecutive tokens.

    This is the decode cost curve: a step over w rows reads union(w) experts' weights once each. Windows slide
    by one token; each window's w·K ids are sorted (O(B·T·w·K) memory).

    Args:
      indices: `[T, K]`, or `[B, T, K]` for B independent sequences (windows never cross sequences).
      cfg: the config or E.
      max_window: windows 1..max_window when `windows` is None.
      windows: window lengths (static ints >= 1), e.g. `(1, 2, 4, 8)`.
    Returns:
      `[len(windows)]` float32.

    Raises:
      ValueError: a window is < 1 or longer than the T tokens of a sequence.
    """
    windows = tuple(range(1, max_window + 1)) if windows is None else tuple(int(w) for w in windows)
    if not windows or min(windows) < 1:
        raise ValueError(f"windows must be non-empty ints >= 1, got {windows}")
    shape = jnp.shape(indices)
    if len(shape) in (2, 3) and max(windows) > shape[-2]:
        raise ValueError(
            f"a window of {max(windows)} tokens is longer than the T={shape[-2]} tokens of indices.shape={shape};"
            f" pass max_window <= {shape[-2]} or shorter windows"
        )
    return _mean_unions(indices, _num_experts(cfg), windows)


@functools.partial(jax.jit, static_argnames="cfg")
def co_selection(indices: Array, cfg: MoEConfig | int) -> Array:
    """`[E, E]` int32: entry (i, j) counts the tokens that chose both i and j; the diagonal counts the tokens
    that chose i (the load, except for a token that picked i in two slots, counted once). `indices [T, K]`."""
    E = _num_experts(cfg)
    presence = _presence(jnp.asarray(indices).reshape(-1, jnp.shape(indices)[-1]), E)  # [T, E]
    return jnp.dot(presence.T, presence, preferred_element_type=jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg")
def routing_entropy(indices: Array, cfg: MoEConfig | int) -> Array:
    """Shannon entropy in bits of the expert-load distribution (pairs per expert / all pairs). float32 scalar.

    `log2(E)` for a perfectly even load, 0 when every pair goes to one expert; `2**entropy` is the number of
    equally loaded experts with the same entropy.
    """
    load = expert_load(indices, cfg).astype(jnp.float32)
    p = load / jnp.maximum(load.sum(), 1.0)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0))


@jax.jit
def imbalance(load: Array) -> Array:
    """`max(load) / mean(load)` float32: 1 for an even load; NaN for an all-zero load."""
    load = jnp.asarray(load, jnp.float32)
    return jnp.max(load) / jnp.mean(load)


@functools.partial(jax.jit, static_argnames="placement")
def slot_load(indices: Array, placement: Placement) -> Array:
    """`[S]` int32 pairs computed by each physical slot of `placement`, with the replica split of
    `moejax.parallel.moe_forward_ep` (row t of `indices [T, K]` -> replica `t mod count`)."""
    ids = jnp.asarray(indices)
    ids = ids.reshape(-1, ids.shape[-1])
    S = placement.num_slots
    slots = placement.physical_ids(ids, jnp.arange(ids.shape[0]))  # [T, K]; S for zero experts
    return jnp.bincount(slots.reshape(-1), length=S + 1)[:S].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="placement")
def device_load(indices: Array, placement: Placement) -> Array:
    """`[n]` int32 pairs computed by each device of the expert axis under `placement` (`indices [T, K]`); the
    unplaced layout is `Placement.contiguous(E, n)`. Equals `MoEStats.device_load` of the same EP call."""
    return slot_load(indices, placement).reshape(placement.num_devices, -1).sum(1)


@functools.partial(jax.jit, static_argnames=("cfg", "placement"))
def load_imbalance(indices: Array, cfg: MoEConfig | int, placement: Placement | None = None) -> Array:
    """Busiest / mean: over experts (`placement=None`), or over the devices of `placement`. float32 scalar."""
    if placement is None:
        return imbalance(expert_load(indices, cfg))
    if placement.num_experts != _num_experts(cfg):
        raise ValueError(f"placement.num_experts={placement.num_experts} != E={_num_experts(cfg)}")
    return imbalance(device_load(indices, placement))


# -- synthetic traces (host numpy) ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceModel:
    """A synthetic routing trace: K distinct experts per token, Zipf-skewed and temporally correlated.

    num_experts: E.
    top_k: K <= E experts per token, distinct.
    skew: Zipf exponent s >= 0: the expert of popularity rank r (1-based) has weight `r**-s` (0: uniform).
    correlation: in [0, 1], the probability that each of the previous token's K experts is chosen again.
    expert_seed: which experts are hot: ranks are a permutation of the expert ids drawn from this seed, the
      same for every trace of the model (traces with different `seed`s share their hot experts).

    Token t of `sample`:
      1. Each expert of token t-1 is kept, independently, with probability `correlation` (token 0 keeps none).
      2. The other slots are drawn without replacement from the remaining experts in proportion to their
         weights (Gumbel top-k: the K largest of `log w_e + Gumbel noise`, kept experts set to +inf).
    """

    num_experts: int
    top_k: int
    skew: float = 1.0
    correlation: float = 0.0
    expert_seed: int = 0

    def __post_init__(self) -> None:
        for field in ("num_experts", "top_k"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"TraceModel.{field}={value!r}: must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(f"TraceModel.top_k={self.top_k}: must be <= num_experts={self.num_experts}")
        if not (np.isfinite(self.skew) and self.skew >= 0):
            raise ValueError(f"TraceModel.skew={self.skew!r}: must be a finite float >= 0")
        if not 0 <= self.correlation <= 1:
            raise ValueError(f"TraceModel.correlation={self.correlation!r}: must be in [0, 1]")

    @property
    def weights(self) -> np.ndarray:
        """`[E]` float64 selection probabilities of one draw (sum 1): the Zipf weights, permuted."""
        rank = np.empty(self.num_experts)
        rank[np.random.default_rng(self.expert_seed).permutation(self.num_experts)] = np.arange(1, self.num_experts + 1)
        w = rank**-self.skew
        return w / w.sum()

    def sample(self, num_tokens: int, seed: int = 0) -> np.ndarray:
        """`[T, K]` int32 expert ids of `num_tokens` consecutive tokens, reproducible from `seed`."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer) or num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens!r} must be a positive int")
        rng = np.random.default_rng(seed)
        chunks, prev = [], None
        for start in range(0, num_tokens, _CHUNK):  # noise drawn per chunk: memory O(chunk · E) at any T
            length = min(_CHUNK, num_tokens - start)
            gumbel = rng.gumbel(size=(1, length, self.num_experts))
            uniform = rng.random((1, length, self.top_k))
            chunks.append(self._draw(gumbel, uniform, prev))
            prev = chunks[-1][:, -1]
        return np.concatenate(chunks, axis=1)[0]

    def _draw(self, gumbel: np.ndarray, uniform: np.ndarray, prev: np.ndarray | None = None) -> np.ndarray:
        """`[B, L, K]` int32: B independent traces side by side (one numpy step per token) from the noise
        `gumbel [B, L, E]` and `uniform [B, L, K]`, continuing from the tokens `prev [B, K]` if given."""
        B, L, _ = gumbel.shape
        log_w = np.log(self.weights)
        keep = uniform < self.correlation
        rows = np.arange(B)[:, None]
        out = np.empty((B, L, self.top_k), np.int32)
        for t in range(L):
            keys = gumbel[:, t] + log_w  # [B, E]
            if prev is not None:
                keys[rows, prev] = np.where(keep[:, t], np.inf, keys[rows, prev])
            out[:, t] = prev = np.argpartition(-keys, self.top_k - 1, axis=1)[:, : self.top_k]
        return out


_CHUNK = 1024


def calibrate(
    target: Sequence[float],
    *,
    num_experts: int,
    top_k: int,
    expert_seed: int = 0,
    seed: int = 0,
    num_chains: int = 32,
    chain_length: int = 128,
) -> TraceModel:
    """Fit a `TraceModel`'s skew and correlation to a target union curve.

    `target[w-1]` is the mean union over w = 1..W consecutive tokens (e.g. 8.00 / 13.74 / 18.76 / 23.35 measured
    on a 256-expert top-8 model). Minimises the sum over w of the squared relative error of the model's curve,
    measured on `num_chains` independent traces of `chain_length` tokens drawn from the same noise (`seed`) for
    every candidate, so the objective changes smoothly with the parameters:
      1. A coarse grid: skew 0, 0.5, ..., 3 by correlation 0, 0.15, ..., 0.9.
      2. Compass search from the best grid point: try a step up and down in each parameter, move to the best
         improvement, halve the steps when none improves; stop when the skew step falls below 0.004.
    Check the fit on a long trace of the result (`union_curve(model.sample(T), E, len(target))`): the curve of
    a finite trace varies with its seed by a few tenths of a percent at T = 4096.

    Raises:
      ValueError: an empty target, a non-positive entry, or more windows than `chain_length`.
    """
    target = np.asarray(target, np.float64)
    if target.ndim != 1 or target.size == 0 or not np.all(target > 0):
        raise ValueError(f"target must be a non-empty curve of positive values, got {target!r}")
    if target.size > chain_length:
        raise ValueError(f"target has {target.size} windows, more than chain_length={chain_length}")
    TraceModel(num_experts, top_k, expert_seed=expert_seed)  # validates the sizes
    rng = np.random.default_rng(seed)
    gumbel = rng.gumbel(size=(num_chains, chain_length, num_experts))
    uniform = rng.random((num_chains, chain_length, top_k))
    windows = tuple(range(1, target.size + 1))
    losses: dict[tuple[float, float], float] = {}

    def loss(point: tuple[float, float]) -> float:
        point = (max(point[0], 0.0), min(max(point[1], 0.0), 1.0))
        if point not in losses:
            model = TraceModel(num_experts, top_k, *point, expert_seed=expert_seed)
            curve = np.asarray(_mean_unions(model._draw(gumbel, uniform), num_experts, windows))
            losses[point] = float(np.sum((curve / target - 1.0) ** 2))
        return losses[point]

    grid = itertools.product(np.linspace(0.0, 3.0, 7), np.linspace(0.0, 0.9, 7))
    best = min(((float(s), float(c)) for s, c in grid), key=loss)
    step = np.array([0.25, 0.075])
    while step[0] >= 0.004:
        moves = [best + sign * step * axis for axis in np.eye(2) for sign in (-1, 1)]
        candidate = min((tuple(float(v) for v in m) for m in moves), key=loss)
        if loss(candidate) < loss(best):
            best = candidate
        else:
            step = step / 2
    skew, correlation = max(best[0], 0.0), min(max(best[1], 0.0), 1.0)
    return TraceModel(num_experts, top_k, skew, correlation, expert_seed)
