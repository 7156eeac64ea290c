"""LoRA adapters on the MoE block: the one owner of their arrays and of the delta math.

An adapter adds `ΔW = s · B · A` to a weight `W` (PEFT's convention: `A [r, in]`, `B [out, r]`, s = alpha / r, or
alpha / √r with rsLoRA), so a projection of rows x becomes `x·W + s · (x·Aᵀ)·Bᵀ`. Targets:

* the router (`LoRAParams.router`): `A [r, H]`, `B [N, r]` (N = experts + zero experts). Its delta is added to
  the logits before anything else the router does (bias, rounding to the router dtype, scores, correction bias,
  groups, top-k): `x·(W + ΔW)ᵀ = x·Wᵀ + (x·Aᵀ)·Bᵀ·s`, so it changes which experts are chosen.
* each routed expert's gate, up and down (`ExpertLoRA`): `A [E, r, in]`, `B [E, out, r]`.
* the shared expert's gate, up and down and its sigmoid gate (`SharedLoRA`; `gate_kernel`: `B [1, r]`).

**One adapter** (what `moejax.hf.load_adapter` returns) has those shapes; `scale` is a float32 scalar per target.
**A stack** (`stack([a, b, ...])`, what `moe_forward(..., lora=)` takes) has a leading adapter axis `[n + 1, ...]`
on every array, `scale [n + 1]`: adapter id 0 is "no adapter" (all zeros), ids 1..n the adapters in order. Ranks
are padded with zeros to the largest rank of each target (exact: the padded rank components contribute exact
zeros), and a target an adapter does not have is zeros for it. Each row of a batch names its adapter by id
(`adapter_ids`, int32, traced): any mix of adapters is one compiled program.

Numerics: the delta is computed in float32 whatever the dtype of x and of the adapters (`(x·Aᵀ)` then `·Bᵀ`,
then `· s`), and added to the float32 projection of the base weights. PEFT computes it in the model dtype; in
float32 the two agree to the model dtype's rounding. Rows with adapter id 0 get the base output bit for bit
(`where(id == 0, base, base + delta)`).

The adapters are a weight wrapper, as flax's `LoRALinear` wraps `Linear`: `adapt(experts, lora.experts)` is a
`LoRAExperts` that the plans read as any weight format; its `expert(e)` is a `LoRAExpert` whose `gate_up` /
`down_proj` take the rows' adapter ids (`Slots.adapter`, routed with the rows by the plans) and add each row's
deltas to the base format's float32 projections (the shared expert wraps its weights in a `LoRAExpert` too).
The native CPU kernels apply them inside their one call (csrc/lora.h: each (row, expert) pair adds its own
adapter's deltas, batch-invariant); backends that cannot apply adapters (the Pallas kernels, ragged) refuse the
wrapper, so "auto" runs native on CPU where built, else the plans.
`pair_delta(pair, x, adapter)` is one target of one expert of a stack (`pair.a [n+1, r, in]`): decode-sized calls
gather each row's own adapter; prefill blocks read every adapter of the expert once and each row selects its own
adapter's product; a row's delta never depends on its neighbours' adapters, not even on their values being
finite: adapter-dependent values are combined by selection (`where`), never by a 0/1 mask (0·inf = NaN).

Also here: `check_lora` (shapes against a `MoEConfig`, errors naming the target), `as_adapter_ids` (host ids of
any integer type to int32 without wrapping), `clamp_ids` (ids outside the stack -> 0 inside jit), `select` (one
adapter of a stack), and `merge` / `unmerge` (fold one adapter into the weights of a `MoEParams`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.ids import HOST_IDS, clip_host_ids
from moejax.weights import padded_ffn

Array = jax.Array

GATHER_MAX_ROWS = 8  # pair_delta gathers each row's own adapter up to this many rows (decode)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAPair:
    """One LoRA target: `ΔW = scale · b @ a` (per expert where the arrays have an expert axis).

    a: `[..., r, in]`. b: `[..., out, r]`. scale: float32 `[...]` (the adapter axis of a stack; () for one
    adapter: an array, a numpy scalar or a Python float), s = alpha / r or alpha / √r.
    """

    a: Array
    b: Array
    scale: Array

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FFNLoRA:
    """Adapters of a gated FFN's projections, a `LoRAPair` or None each."""

    gate: LoRAPair | None = None  # in H, out I
    up: LoRAPair | None = None  # in H, out I
    down: LoRAPair | None = None  # in I, out H


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertLoRA(FFNLoRA):
    """Adapters of the routed experts: per projection a `LoRAPair` with an expert axis (`a [(n+1,) E, r, in]`)."""

    def expert(self, e: Array | int) -> ExpertLoRA:
        """Expert `e` of a stack (`a [n+1, E, r, in]` -> `[n+1, r, in]`); `e` may be traced."""
        take = lambda w: jax.lax.dynamic_index_in_dim(w, e, 1, keepdims=False)
        return jax.tree.map(lambda p: dataclasses.replace(p, a=take(p.a), b=take(p.b)), self, is_leaf=_is_pair)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedLoRA(FFNLoRA):
    """Adapters of the shared expert and its sigmoid gate (`gate_kernel`: `a [r, H]`, `b [1, r]`)."""

    gate_kernel: LoRAPair | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAParams:
    """The LoRA adapters of one MoE block: one adapter, or a stack of them (see the module docstring)."""

    router: LoRAPair | None = None
    experts: ExpertLoRA | None = None
    shared: SharedLoRA | None = None

    def pairs(self) -> dict[str, LoRAPair]:
        """The targets that are set, by dotted name (`router`, `experts.gate`, `shared.gate_kernel`, ...)."""
        out = {}
        if self.router is not None:
            out["router"] = self.router
        for group in ("experts", "shared"):
            sub = getattr(self, group)
            if sub is not None:
                for f in dataclasses.fields(sub):
                    if getattr(sub, f.name) is not None:
                        out[f"{group}.{f.name}"] = getattr(sub, f.name)
        return out

    @property
    def is_stack(self) -> bool:
        """Whether this is a stack (`scale` has the adapter axis) rather than one adapter."""
        return any(np.ndim(p.scale) == 1 for p in self.pairs().values())

    @property
    def num_ids(self) -> int:
        """Adapter ids of a stack, n + 1 (id 0 included)."""
        if not self.is_stack:
            raise ValueError("num_ids: this LoRAParams is one adapter, not a stack (moejax.lora.stack)")
        return next(iter(self.pairs().values())).scale.shape[0]


def _is_pair(v) -> bool:
    return isinstance(v, LoRAPair)


def from_pairs(pairs: dict[str, LoRAPair | None]) -> LoRAParams:
    """A LoRAParams with the given targets by dotted name (as `LoRAParams.pairs` names them; the others None)."""
    experts = {k.split(".", 1)[1]: v for k, v in pairs.items() if k.startswith("experts.")}
    shared = {k.split(".", 1)[1]: v for k, v in pairs.items() if k.startswith("shared.")}
    return LoRAParams(
        router=pairs.get("router"),
        experts=ExpertLoRA(**experts) if any(v is not None for v in experts.values()) else None,
        shared=SharedLoRA(**shared) if any(v is not None for v in shared.values()) else None,
    )


def stack(adapters: Sequence[LoRAParams]) -> LoRAParams:
    """Stack single adapters into ids 1..n (id 0: no adapter, zeros), padding each target to its largest rank.

    A target some adapters lack is zeros for them. Arrays are stacked in float32 (the delta is computed in
    float32 anyway). Shapes must agree except for the rank.

    Raises:
      ValueError: empty list, an argument that is already a stack, or shapes that differ beyond the rank (the
        message names the target and both shapes).
    """
    if not adapters:
        raise ValueError("stack: needs at least one adapter")
    for i, adapter in enumerate(adapters):
        if not isinstance(adapter, LoRAParams):
            raise TypeError(f"stack: adapter {i} is a {type(adapter).__name__}, expected moejax.lora.LoRAParams")
        if adapter.is_stack:
            raise ValueError(f"stack: adapter {i} is already a stack; pass single adapters")
    names = sorted({name for a in adapters for name in a.pairs()})
    out: dict[str, LoRAPair] = {}
    for name in names:
        present = [a.pairs().get(name) for a in adapters]
        first = next(p for p in present if p is not None)
        lead, n_in, n_out = first.a.shape[:-2], first.a.shape[-1], first.b.shape[-2]
        for i, p in enumerate(present):
            if p is not None and (p.a.shape[:-2] != lead or p.a.shape[-1] != n_in or p.b.shape[-2] != n_out):
                raise ValueError(
                    f"stack: {name} of adapter {i} has A {p.a.shape}, B {p.b.shape}; "
                    f"adapter 0 with this target has A {first.a.shape}, B {first.b.shape} (only the rank may differ)"
                )
        r = max(p.rank for p in present if p is not None)
        zero_a, zero_b = jnp.zeros((*lead, r, n_in), jnp.float32), jnp.zeros((*lead, n_out, r), jnp.float32)
        a_rows, b_cols, scales = [zero_a], [zero_b], [jnp.float32(0)]
        for p in present:
            if p is None:  # id 0, and adapters without this target: zeros
                a_rows.append(zero_a)
                b_cols.append(zero_b)
                scales.append(jnp.float32(0))
                continue
            pad = r - p.rank
            a_rows.append(jnp.pad(p.a.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, pad), (0, 0)]))
            b_cols.append(jnp.pad(p.b.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, 0), (0, pad)]))
            scales.append(jnp.asarray(p.scale, jnp.float32))
        out[name] = LoRAPair(jnp.stack(a_rows), jnp.stack(b_cols), jnp.stack(scales))
    return from_pairs(out)


def pair_delta(pair: LoRAPair | None, x: Array, adapter: Array) -> Array | None:
    """`s[id] · (x·A[id]ᵀ)·B[id]ᵀ` per row, float32 `[R, out]`, for a stacked target of ONE expert (or the router /
    shared expert): `pair.a [n+1, r, in]`, `pair.b [n+1, out, r]`, `x [R, in]`, `adapter [R]` int32 ids.

    None when the target has no adapter. Up to GATHER_MAX_ROWS rows (decode) each row gathers its own adapter's
    A and B (R copies of r·(in+out) values: fewer bytes than every adapter's, and no masked work); more rows
    (prefill blocks) read every adapter's A and B once, compute each adapter's product for the block and keep
    each row's own by selection. Either way a row's delta is computed on its own: it depends only on its x, its
    id and its own adapter (an inf or NaN in another adapter does not reach it), and the form depends only on the
    static row count. Rows with id 0 (no adapter: zeros in a stack) get 0 in the prefill form without reading it.
    """
    if pair is None:
        return None
    x32 = x.astype(jnp.float32)
    if x.shape[0] <= GATHER_MAX_ROWS:
        a, b = pair.a[adapter].astype(jnp.float32), pair.b[adapter].astype(jnp.float32)  # [R, r, in], [R, out, r]
        xa = jnp.einsum("ri,rki->rk", x32, a) * pair.scale[adapter].astype(jnp.float32)[:, None]  # [R, r]
        return jnp.einsum("rk,rok->ro", xa, b)  # [R, out]
    n = pair.scale.shape[0]
    # [R, n+1, r]: this orientation keeps a row's bits independent of R on XLA:CPU (batch invariance); [n+1, R, r]
    # does not at R = 32
    xa = jnp.einsum("ri,nki->rnk", x32, pair.a.astype(jnp.float32)) * pair.scale.astype(jnp.float32)[:, None]

    # One adapter at a time, kept where the row's id is j: a select, not a sum of products masked by 0, so that
    # 0·inf = NaN from another adapter never enters a row. A scan, so the program does not grow with n. Id 0 (no
    # adapter: zeros, and `add_delta` keeps the base on its rows) is skipped: its rows keep a zero delta.
    def keep_own(delta: Array, step: tuple[Array, Array, Array]) -> tuple[Array, None]:
        j, xa_j, b_j = step  # (), [R, r], [out, r]
        y = jnp.einsum("rk,ok->ro", xa_j, b_j.astype(jnp.float32))  # [R, out]
        return jnp.where((adapter == j)[:, None], y, delta), None

    delta = jnp.zeros((x.shape[0], pair.b.shape[-2]), jnp.float32)
    steps = (jnp.arange(1, n, dtype=jnp.int32), jnp.swapaxes(xa, 0, 1)[1:], pair.b[1:])
    delta, _ = jax.lax.scan(keep_own, delta, steps)
    return delta  # [R, out]


def add_delta(y: Array, delta: Array | None, adapter: Array) -> Array:
    """`y + delta` on rows with an adapter (id != 0), `y` bit for bit on the others."""
    if delta is None:
        return y
    return jnp.where((adapter != 0)[:, None], y + delta, y)


def add_pair(y: Array, pair: LoRAPair | None, x: Array, adapter: Array) -> Array:
    """`y` plus the rows' deltas of target `pair` on input `x` (`pair_delta`, `add_delta`)."""
    return add_delta(y, pair_delta(pair, x, adapter), adapter)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAExpert:
    """One expert of any weight format with its adapters (every adapter of a stack): `ids [R]` the rows' ids.

    Gate and up deltas are added to the base's float32 projections before the activation, the down delta (of the
    float32 activation) after the down projection. Rows are padded as the base pads them (`padded_rows`).
    """

    base: Any  # one expert of a format (`gate_up`, `down_proj`, `padded_rows`, `dequantize`)
    lora: FFNLoRA  # its targets, `a [n+1, r, in]`

    @property
    def padded_rows(self) -> int:
        return self.base.padded_rows

    def gate_up(self, x: Array, ids: Array) -> tuple[Array, Array]:
        gate, up = self.base.gate_up(x)  # [R, I] float32 each
        return add_pair(gate, self.lora.gate, x, ids), add_pair(up, self.lora.up, x, ids)

    def down_proj(self, h: Array, ids: Array) -> Array:
        return add_pair(self.base.down_proj(h), self.lora.down, h, ids)  # [R, H]

    def ffn(self, x: Array, act: Any, ids: Array) -> Array:
        """`x [R, H]` -> float32 `[R, H]`; rows with id 0 get the base's `ffn` bit for bit."""
        return padded_ffn(self, x, act, ids)

    def dequantize(self) -> LoRAExpert:
        return LoRAExpert(self.base.dequantize(), self.lora)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAExperts:
    """Routed experts of any format and layout with a stack's expert adapters, read by the plans as a format:
    `expert(e)` is a `LoRAExpert`, and the rows' adapter ids are `row_ids(slots)` (`Slots.adapter`)."""

    base: Any  # `moejax.weights.Experts`
    lora: ExpertLoRA  # `a [n+1, E, r, in]`

    @property
    def layout(self) -> str:
        return self.base.layout

    @property
    def num_experts(self) -> int:
        return self.base.num_experts

    @property
    def padded_rows(self) -> int:
        return self.base.padded_rows

    def expert(self, e: Array | int) -> LoRAExpert:
        return LoRAExpert(self.base.expert(e), self.lora.expert(e))

    def stacked(self) -> LoRAExperts:
        return LoRAExperts(self.base.stacked(), self.lora)

    def row_ids(self, slots) -> Array:
        """`slots.adapter`; `ValueError` when it is missing or not `[T]`."""
        T = slots.indices.shape[0]
        if slots.adapter is None or tuple(slots.adapter.shape) != (T,):
            got = None if slots.adapter is None else tuple(slots.adapter.shape)
            raise ValueError(f"lora given: slots.adapter must be [T]=({T},) int32 adapter ids, got {got}")
        return slots.adapter


def adapt(experts: Any, lora: ExpertLoRA | None) -> Any:
    """`experts` (any format, either layout) with a stack's expert adapters (`LoRAExperts`), or `experts`
    unchanged when `lora` is None."""
    return experts if lora is None else LoRAExperts(experts, lora)


def as_adapter_ids(adapter_ids, num_ids: int):
    """`adapter_ids` as an integer array without wrapping: host values (a list, a numpy array or scalar) are first
    clipped to [-1, num_ids] on the host, in their own integer type, then cast to int32, so an id of 2**32 + 1 in a
    host int64 / uint64 array (or a Python int) stays out of range (-> 0 by `clamp_ids`; `checked_moe_forward`
    raises) instead of wrapping to 1 (`moejax.ids.clip_host_ids`). Device arrays (any integer dtype) and tracers
    pass through: `clamp_ids` compares them in their own type.

    Raises:
      TypeError: host values that are not integers.
    """
    if not isinstance(adapter_ids, HOST_IDS):
        return adapter_ids  # None, a device array, a tracer or another array type: `check_lora_inputs` checks it
    return jnp.asarray(clip_host_ids("adapter_ids", adapter_ids, -1, num_ids))


def clamp_ids(adapter_ids: Array, num_ids: int) -> Array:
    """Adapter ids as int32, those outside [0, num_ids) replaced by 0 (no adapter): inside jit ids cannot raise
    (`moejax.checked_moe_forward` raises instead). The comparison runs in the ids' own integer type (a uint32 id
    >= 2**31 is large, not negative) and host ids go through `as_adapter_ids` first (no wrap on the int32 cast)."""
    ids = jnp.asarray(as_adapter_ids(adapter_ids, num_ids))
    ok = (ids >= 0) & (ids < num_ids)
    return jnp.where(ok, ids, 0).astype(jnp.int32)


def _target_shapes(cfg) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Every target `cfg` allows: dotted name -> (leading axes, in, out)."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    out = {
        "router": ((), H, cfg.num_selectable),
        "experts.gate": ((E,), H, I),
        "experts.up": ((E,), H, I),
        "experts.down": ((E,), I, H),
    }
    if cfg.shared_expert.value != "none":
        Is = cfg.shared_intermediate_size
        out |= {"shared.gate": ((), H, Is), "shared.up": ((), H, Is), "shared.down": ((), Is, H)}
        if cfg.shared_expert.value == "sigmoid_gated":
            out["shared.gate_kernel"] = ((), H, 1)
    return out


def check_lora(lora: LoRAParams, cfg) -> None:
    """Raise `ValueError` naming the target and both shapes when `lora` (one adapter or a stack) does not fit
    `cfg`: a target the config has no weight for (a shared expert, its sigmoid gate), A / B / scale shapes
    (hidden size, experts, intermediate sizes, N = num_selectable for the router), ranks of A and B that differ,
    and a stack whose targets disagree on the number of adapters. Shape-only: safe on tracers."""
    if not isinstance(lora, LoRAParams):
        raise TypeError(f"lora must be a moejax.lora.LoRAParams (a moejax.lora.stack), got {type(lora).__name__}")
    allowed = _target_shapes(cfg)
    pairs = lora.pairs()
    stacked = lora.is_stack
    ids = {np.shape(p.scale)[0] for p in pairs.values() if np.ndim(p.scale) == 1}
    if len(ids) > 1:
        raise ValueError(f"lora: targets of one stack hold different numbers of adapter ids {sorted(ids)}")
    n = tuple(ids) if stacked else ()
    for name, pair in pairs.items():
        if name not in allowed:
            raise ValueError(f"lora {name}: this config has no such weight (targets it allows: {sorted(allowed)})")
        lead, n_in, n_out = allowed[name]
        r = pair.a.shape[-2] if pair.a.ndim >= 2 else None
        want_a, want_b = (*n, *lead, r, n_in), (*n, *lead, n_out, r)
        got_a, got_b = tuple(pair.a.shape), tuple(pair.b.shape)
        if got_a != want_a:
            raise ValueError(f"lora {name}: A expected shape {want_a} ([adapters,] [E,] r, in), got {got_a}")
        if got_b != want_b:
            raise ValueError(f"lora {name}: B expected shape {want_b} ([adapters,] [E,] out, r), got {got_b}")
        if tuple(jnp.shape(pair.scale)) != n:
            raise ValueError(f"lora {name}: scale expected shape {n}, got {tuple(jnp.shape(pair.scale))}")


def select(lora: LoRAParams, adapter_id: int | None = None) -> LoRAParams:
    """One adapter: `lora` itself when it is one (`adapter_id` None), or id `adapter_id` (static) of a stack."""
    if not lora.is_stack:
        if adapter_id is not None:
            raise ValueError(f"adapter_id={adapter_id}: lora is one adapter, not a stack; pass adapter_id=None")
        return lora
    if adapter_id is None or not 0 <= int(adapter_id) < lora.num_ids:
        raise ValueError(f"adapter_id={adapter_id} must be an int in [0, {lora.num_ids}) for this stack")
    take = lambda p: LoRAPair(p.a[adapter_id], p.b[adapter_id], p.scale[adapter_id])
    return from_pairs({name: take(p) for name, p in lora.pairs().items()})


def delta_weight(pair: LoRAPair) -> Array:
    """`ΔW = s · B @ A` of one adapter's target, float32 `[..., out, in]` (PEFT's orientation)."""
    a, b = pair.a.astype(jnp.float32), pair.b.astype(jnp.float32)
    return jnp.asarray(pair.scale, jnp.float32) * jnp.einsum("...or,...ri->...oi", b, a)


def merge(params, lora: LoRAParams, adapter_id: int | None = None, *, sign: float = 1.0):
    """`params` with one adapter's deltas folded into the weights: `W + s·B·A` for every target.

    Args:
      params: `moejax.MoEParams`, routed experts in any format and layout.
      lora: one adapter, or a stack with a static `adapter_id` (0 returns the weights unchanged in value).
      sign: -1 subtracts the delta (`unmerge`).

    Returns:
      `MoEParams` in the layout of `params`. Dense weights keep their dtype (a bfloat16 base is rounded to
      bfloat16 after the float32 sum; float32 is exact within float32). Quantized routed experts are dequantized
      to float32 dense `ExpertWeights` first (the merged weights are not re-quantized).
    """
    from moejax.params import MoEParams
    from moejax.weights import ExpertWeights, PerExpert, as_stacked, to_layout

    if not isinstance(params, MoEParams):
        raise TypeError(f"merge: params must be moejax.MoEParams, got {type(params).__name__}")
    one = select(lora, adapter_id).pairs()

    def add(w: Array, pair: LoRAPair | None) -> Array:  # w stored [..., in, out]
        if pair is None:
            return w
        d = jnp.swapaxes(delta_weight(pair), -1, -2)
        return (w.astype(jnp.float32) + sign * d).astype(w.dtype)

    router = dataclasses.replace(params.router, kernel=add(params.router.kernel, one.get("router")))
    experts = params.experts
    if any(name.startswith("experts.") for name in one):
        per_expert = isinstance(experts, PerExpert)
        dense = as_stacked(experts)
        if type(dense) is not ExpertWeights:
            dense = dense.dequantize()
        dense = dataclasses.replace(
            dense,
            gate=add(dense.gate, one.get("experts.gate")),
            up=add(dense.up, one.get("experts.up")),
            down=add(dense.down, one.get("experts.down")),
        )
        experts = to_layout(dense, "per_expert" if per_expert else "stacked")
    shared = params.shared
    if shared is not None:
        shared = dataclasses.replace(
            shared,
            gate=add(shared.gate, one.get("shared.gate")),
            up=add(shared.up, one.get("shared.up")),
            down=add(shared.down, one.get("shared.down")),
            gate_kernel=None if shared.gate_kernel is None else add(shared.gate_kernel, one.get("shared.gate_kernel")),
        )
    elif any(name.startswith("shared.") for name in one):
        raise ValueError("merge: the adapter has shared-expert targets but params has no shared expert")
    return dataclasses.replace(params, router=router, experts=experts, shared=shared)


def unmerge(params, lora: LoRAParams, adapter_id: int | None = None):
    """The inverse of `merge`: `W - s·B·A` (exact up to float32 rounding; quantized experts come back dense)."""
    return merge(params, lora, adapter_id, sign=-1.0)
