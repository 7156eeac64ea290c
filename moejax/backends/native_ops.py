"""The rest of the MoE layer on the native CPU kernels: the router's and the shared expert's matmuls, so that a
row's whole-layer output is bit-identical whatever the batch around it (docs/DESIGN.md, "Batch invariance").

XLA:CPU's dot changes its kernel, and with it the order of each output's sum, with the number of rows, so the
router logits and the shared expert of a row alone differ in the last bits from the same row in a batch (and a
changed logit can change the routing). On CPU, when the native extension is built and the routed experts'
backend is "native" or "auto" (`layer_ops`), the layer runs:

* `matmul`: `x [T, K] @ w [K, N]` float32 by one FFI call into csrc/linear_cpu.cc (every output one fixed chain
  of fused multiply-adds over k): the router logits `x @ W_router` and the shared expert's sigmoid gate `x @ w`.
* `shared_ffn`: the shared expert's FFN as one expert of the routed-experts FFI call (csrc/moe_cpu.cc), every row
  with weight 1.0 (`0 + 1.0 · y` is y exactly), with the shared expert's LoRA adapters in the same call
  (csrc/lora.h: each row's own adapter, batch-invariant).
* `lora_delta(pair, x, adapter)`: the router's and the shared expert's sigmoid gate's LoRA deltas, each row's own
  adapter's `s · (x·Aᵀ)·Bᵀ`, by one FFI call into csrc/moe_cpu.cc (the chains of the experts' adapters,
  csrc/lora_kernels.inc): XLA's `pair_delta` changes its form with the row count.
* `scores(kind, logits)`: the router's softmax / sigmoid / softplus and the shared expert's sigmoid gate by one
  FFI call into csrc/scores_cpu.cc (a scalar `std::exp` per value, a row's softmax summed in column order):
  XLA:CPU's exp gives other bits in a loop's vector body than in its scalar tail, so a row's scores changed with
  the batch.

Each is chosen while lowering (`_on_cpu`): a GPU or TPU program runs the XLA path, unchanged. Both run under
a `jax.custom_vjp` whose backward is the VJP of the XLA path, so gradients are the XLA path's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.backends import native
from moejax.lora import ExpertLoRA, FFNLoRA, LoRAExpert, LoRAExperts, LoRAPair, pair_delta
from moejax.routing import xla_scores
from moejax.slots import Slots
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation

Array = jax.Array
LINEAR = "moejax_linear"
SCORES = "moejax_scores"
LORA_DELTA = "moejax_lora_delta"
_SCORE_KINDS = {"softmax": 0, "sigmoid": 1, "softplus": 2}
_WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def linear(x: Array, w: Array, bias: Array | None = None, *, max_threads: int = 0, portable: bool = False) -> Array:
    """`x @ w (+ bias)` `[T, N]` float32 by the native kernel, batch-invariant (csrc/linear_cpu.cc).

    Args:
      x: `[T, K]` float32, bfloat16 or float16 (converted to float32, exactly).
      w: `[K, N]` float32, bfloat16 or float16, read as stored.
      bias: `[N]` (converted to float32) added to each output's sum, or None.
      max_threads: at most this many threads (the caller's included); 0: the whole intra-op pool.
      portable: the portable C++ variant instead of the best for this CPU (tests).

    Raises:
      NotImplementedError: the extension is not built or not enabled.
      ValueError: shapes or dtypes that do not fit, naming the argument.
    """
    if not native.available():
        raise NotImplementedError("the native CPU kernels are not built or not enabled (moejax._native_cpu)")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"native linear: x must be [T, K] and w [K, N], got {x.shape=} {w.shape=}")
    for name, value in (("x", x), ("w", w)):
        if jnp.dtype(value.dtype) not in _WEIGHT_DTYPES:
            raise ValueError(f"native linear: {name} must be float32, bfloat16 or float16, got {value.dtype}")
    if bias is not None and tuple(bias.shape) != (w.shape[1],):
        raise ValueError(f"native linear: bias must be [N]=({w.shape[1]},), got {bias.shape}")
    bias = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    call = jax.ffi.ffi_call(
        LINEAR, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32), vmap_method="sequential"
    )
    flags = {"max_threads": np.int64(max_threads), "portable": np.int64(bool(portable))}
    return call(x.astype(jnp.float32), w, bias, **flags)


def _on_cpu(run, fallback, *operands):
    """`run(*operands)` in a program lowered for the CPU, `fallback(*operands)` elsewhere. By the lowering
    platform alone (`jax.lax.platform_dependent`, pruned while lowering), not `native.on_cpu`: that primitive asks
    for the program's devices, which makes JAX require one mesh across the program, and the router runs in
    programs that mix meshes (a data-parallel input beside an EP forward)."""
    return jax.lax.platform_dependent(*operands, cpu=run, default=fallback)


def xla_matmul(x: Array, w: Array) -> Array:
    """`x @ w` `[T, N]` float32 by XLA (accumulated in float32): the path off CPU and the backward's."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


@jax.custom_vjp
def matmul(x: Array, w: Array) -> Array:
    """`x [T, K] @ w [K, N]` `[T, N]` float32 (x and w in one dtype, or float32 x and a bfloat16 / float16 w,
    widened exactly; accumulated in float32): `linear` in a program lowered for the CPU, `xla_matmul` elsewhere;
    gradients are `xla_matmul`'s."""
    threads = threads_for(x.shape[0] * _nbytes(w))
    return _on_cpu(lambda x, w: linear(x, w, max_threads=threads), xla_matmul, x, w)


def _matmul_fwd(x, w):
    return matmul(x, w), (x, w)


def _matmul_bwd(residuals, cotangent):
    return jax.vjp(xla_matmul, *residuals)[1](cotangent)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def native_scores(kind: str, logits: Array) -> Array:
    """`kind` ("softmax" over the last axis, "sigmoid", "softplus") of float32 `logits [T, N]` by the native op,
    each row's bits independent of the other rows (csrc/scores_cpu.cc).

    Raises:
      NotImplementedError: the extension is not built or not enabled.
      ValueError: an unknown kind, or logits that are not `[T, N]` float32.
    """
    if not native.available():
        raise NotImplementedError("the native CPU kernels are not built or not enabled (moejax._native_cpu)")
    if kind not in _SCORE_KINDS:
        raise ValueError(f"native scores: kind must be one of {sorted(_SCORE_KINDS)}, got {kind!r}")
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"native scores: logits must be [T, N] float32, got {logits.shape} {logits.dtype}")
    call = jax.ffi.ffi_call(SCORES, jax.ShapeDtypeStruct(logits.shape, jnp.float32), vmap_method="sequential")
    return call(logits, kind=np.int64(_SCORE_KINDS[kind]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def scores(kind: str, logits: Array) -> Array:
    """`xla_scores(kind, logits)`: by `native_scores` in a program lowered for the CPU, by XLA elsewhere;
    gradients are XLA's."""
    return _on_cpu(functools.partial(native_scores, kind), functools.partial(xla_scores, kind), logits)


def _scores_fwd(kind, logits):
    return scores(kind, logits), logits


def _scores_bwd(kind, logits, cotangent):
    return jax.vjp(functools.partial(xla_scores, kind), logits)[1](cotangent)


scores.defvjp(_scores_fwd, _scores_bwd)


def native_lora_delta(pair: LoRAPair, x: Array, adapter: Array, *, max_threads: int = 0) -> Array:
    """`pair_delta(pair, x, adapter)` by the native op: each row's `s[a] · (x·A[a]ᵀ)·B[a]ᵀ` float32 `[T, out]` for
    its adapter `a` (0 on rows with id 0 or outside the stack), every value one fixed chain (batch-invariant).

    Args:
      pair: a stacked target without an expert axis: `a [n, r, in]`, `b [n, out, r]`, `scale [n]` (any float
        dtype, converted to float32).
      x: `[T, in]` (converted to float32, exactly).
      adapter: `[T]` int32 adapter ids.
      max_threads: at most this many threads (the caller's included); 0: the whole intra-op pool.

    Raises:
      NotImplementedError: the extension is not built or not enabled.
      ValueError: shapes that do not fit, naming the array.
    """
    if not native.available():
        raise NotImplementedError("the native CPU kernels are not built or not enabled (moejax._native_cpu)")
    a, b, scale = pair.a, pair.b, jnp.asarray(pair.scale)
    if a.ndim != 3 or x.ndim != 2 or a.shape[2] != x.shape[1] or a.shape[1] < 1:
        raise ValueError(f"native lora_delta: a must be [n, r, in] and x [T, in], got {a.shape=} {x.shape=}")
    n, r = a.shape[:2]
    if b.ndim != 3 or b.shape[0] != n or b.shape[2] != r or scale.shape != (n,):
        raise ValueError(f"native lora_delta: b must be [{n}, out, {r}] and scale [{n}], got {b.shape=} {scale.shape=}")
    if adapter.shape != (x.shape[0],):
        raise ValueError(f"native lora_delta: adapter must be [T]=({x.shape[0]},), got {adapter.shape}")
    f32 = jnp.float32
    call = jax.ffi.ffi_call(LORA_DELTA, jax.ShapeDtypeStruct((x.shape[0], b.shape[1]), f32), vmap_method="sequential")
    operands = (a.astype(f32)[:, None], b.astype(f32)[:, None], scale.astype(f32))  # [n, 1, ...]: E = 1
    return call(x.astype(f32), adapter.astype(jnp.int32), *operands, max_threads=np.int64(max_threads))


@jax.custom_vjp
def lora_delta(pair: LoRAPair, x: Array, adapter: Array) -> Array:
    """`pair_delta(pair, x, adapter)` (never None: `pair` is given): by `native_lora_delta` in a program lowered
    for the CPU, by XLA elsewhere; gradients are `pair_delta`'s."""
    threads = threads_for(x.shape[0] * _nbytes((pair.a, pair.b)) // max(pair.a.shape[0], 1))
    native_run = lambda pair, x, adapter: native_lora_delta(pair, x, adapter, max_threads=threads)
    return _on_cpu(native_run, pair_delta, pair, x, adapter)


def _lora_delta_fwd(pair, x, adapter):
    return lora_delta(pair, x, adapter), (pair, x, adapter)


def _lora_delta_bwd(residuals, cotangent):
    return jax.vjp(pair_delta, *residuals)[1](cotangent)


lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


def shared_ffn(
    w: ExpertWeights, x: Array, act: GatedActivation, lora: FFNLoRA | None = None, adapter: Array | None = None
) -> Array:
    """The shared expert's gated FFN on all rows `x [T, H]` -> `[T, H]` float32.

    `w`: one expert's dense weights (`[H, Is]`, `[H, Is]`, `[Is, H]`, no expert axis). `lora`: the shared
    expert's targets of a stack (`a [n+1, r, in]`, `moejax.lora.SharedLoRA`; its sigmoid gate is not read here)
    and `adapter [T]` the rows' ids, or None. On CPU one routed-experts FFI call with `w` as the only expert
    (its adapters too) and every row's weight 1.0; elsewhere (and for the backward) `w.ffn` or
    `LoRAExpert.ffn`, the XLA path."""
    if lora is not None:
        lora = FFNLoRA(lora.gate, lora.up, lora.down)  # the FFN's targets (not the sigmoid gate's)

    @jax.custom_vjp
    def ffn(w, x, lora, adapter):
        return _on_cpu(_native_ffn, _xla_ffn, w, x, lora, adapter)

    def _native_ffn(w, x, lora, adapter):
        stacked = jax.tree.map(lambda a: a[None], w)  # [1, ...]: a bitcast, read in place
        T = x.shape[0]
        slots = Slots(jnp.zeros((T, 1), jnp.int32), jnp.ones((T, 1), jnp.float32), None, adapter)
        if lora is not None:  # the expert axis of the routed experts' stacks: a [n+1, 1, r, in], b [n+1, 1, out, r]
            one = lambda p: None if p is None else LoRAPair(p.a[:, None], p.b[:, None], p.scale)
            stacked = LoRAExperts(stacked, ExpertLoRA(one(lora.gate), one(lora.up), one(lora.down)))
        return native.routed_experts(stacked, x, slots, act, max_threads=threads_for(T * _nbytes(stacked)))

    def _xla_ffn(w, x, lora, adapter):
        return w.ffn(x, act) if lora is None else LoRAExpert(w, lora).ffn(x, act, adapter)

    def fwd(w, x, lora, adapter):
        return ffn(w, x, lora, adapter), (w, x, lora, adapter)

    def bwd(residuals, cotangent):
        return jax.vjp(_xla_ffn, *residuals)[1](cotangent)

    ffn.defvjp(fwd, bwd)
    return ffn(w, x, lora, adapter)


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """The layer's ops besides the routed experts, as the pipeline passes them down: `matmul(x, w)` for the
    router logits and the shared expert's gate, `shared_ffn(w, x, act, lora, adapter)` for the shared expert's FFN
    (with its adapters, or None), `scores(kind, logits)` for the router's scores and the shared expert's sigmoid
    gate, `lora_delta(pair, x, adapter)` for the router's and the sigmoid gate's adapters."""

    matmul: Callable[[Array, Array], Array] = matmul
    shared_ffn: Callable[..., Array] = shared_ffn
    scores: Callable[[str, Array], Array] = scores
    lora_delta: Callable[[LoRAPair, Array, Array], Array] = lora_delta


# At most this many threads in every native call of the layer (0: `threads_for` decides by the call's size); read
# while tracing. Tests set it to compare one thread with the pool.
_MAX_THREADS = 0
# Below this many bytes of weights streamed by one call, it runs on the calling thread alone. A call that uses the
# pool hands items to a pool thread lingering after an earlier call, or wakes a parked one (csrc/parallel.h: ~45 us
# on a virtual machine). Measured in whole tiny models' decode loops (Qwen3-MoE, 16 experts, top-4, 3 layers, 2-core
# Xeon, benchmarks/model_decode.py): at H=64, I=32 the pool for 8 rows' experts (768 KiB a call) cost 1.15-1.25x
# the time of one thread, and every call on the pool at one row 1.12x; at H=256, I=128, one row (1.5 MiB of experts
# a call) the pool took 0.75x its time, at H=128, I=64, 8 rows (3 MiB) the same.
SINGLE_THREAD_BYTES = 2**20


def threads_for(weight_bytes: int) -> int:
    """The `max_threads` of a native call that streams `weight_bytes` of weights (summed over what its rows read):
    1 below `SINGLE_THREAD_BYTES`, else 0 (the whole pool); the threads never change a result's bits."""
    if _MAX_THREADS:
        return _MAX_THREADS
    return 1 if weight_bytes < SINGLE_THREAD_BYTES else 0


def _nbytes(tree) -> int:
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def routed_experts(experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """`native.routed_experts` (the "native" backend) on as many threads as its size pays for (`threads_for`:
    each (row, slot) pair streams one expert's weights)."""
    pairs = slots.indices.shape[0] * slots.indices.shape[1]
    per_expert = _nbytes(experts) // max(experts.num_experts, 1)
    return native.routed_experts(
        experts, x, slots, act, block_rows=block_rows, max_threads=threads_for(pairs * per_expert)
    )


def layer_ops(impl: str) -> LayerOps | None:
    """The native layer ops when `impl` runs the routed experts natively where it can ("auto", "native") and the
    extension is built and enabled; None: the XLA path (`jnp.dot`, `ExpertWeights.ffn`), unchanged."""
    if impl not in ("auto", "native") or not native.available():
        return None
    return LayerOps()
