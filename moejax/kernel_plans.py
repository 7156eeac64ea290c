"""The routed experts on the Pallas kernels: adapts `(ExpertWeights, x, Routing, MoEConfig)` to `pallas_kernels`.

Same contract as the XLA plans (`moejax.plans`): float32 `[T, H]` `Σ_k w_k · E_k(x)`, zero-computation experts
(ids >= num_experts) contribute nothing, Llama-4's input scaling through `slot_scales`. A config a kernel
cannot serve raises `NotImplementedError`, so that `impl="auto"` falls back to the XLA plans.

Interpret mode is chosen at trace time: on a CPU backend the kernels run under the Mosaic GPU interpreter (slow:
for tests), on a GPU they are compiled. To lower for a GPU from a CPU host (ahead-of-time compilation, the CUDA
lowering tests), trace inside `with compiled_kernels():`. (`jax.lax.platform_dependent` cannot make this choice
at lowering time: the interpreter's ordered host callbacks give its CPU branch an effect the CUDA branch lacks.)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

import pallas_kernels
from moejax.config import Activation, MoEConfig
from moejax.experts import slot_scales
from moejax.params import ExpertWeights
from moejax.plans import decode_fits
from moejax.routing import Routing

Array = jax.Array

_ACTIVATIONS = {Activation.SILU: "silu", Activation.GELU_TANH: "gelu_tanh", Activation.GPT_OSS: "gpt_oss"}
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_COMPILE = contextvars.ContextVar("moejax_compile_kernels", default=False)


def interpret_mode() -> bool:
    """Whether kernels traced now run interpreted: on a CPU backend, unless inside `compiled_kernels()`."""
    return jax.default_backend() == "cpu" and not _COMPILE.get()


@contextlib.contextmanager
def compiled_kernels() -> Iterator[None]:
    """Trace the kernels for a GPU even on a CPU host (then lower with `lowering_platforms=("cuda",)`)."""
    token = _COMPILE.set(True)
    try:
        yield
    finally:
        _COMPILE.reset(token)


def _kernel_args(kernel: str, experts: ExpertWeights, routing: Routing, cfg: MoEConfig) -> tuple[tuple, dict]:
    if type(experts) is not ExpertWeights:
        raise NotImplementedError(f"{kernel}: weight format {type(experts).__name__} has no kernel yet")
    biases = (experts.gate_bias, experts.up_bias, experts.down_bias)
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise NotImplementedError(f"{kernel}: expert biases must be all of gate/up/down or none")
    dtypes = {jnp.dtype(w.dtype) for w in (experts.gate, experts.up, experts.down)}
    if len(dtypes) != 1 or not dtypes <= set(_KERNEL_DTYPES):
        raise NotImplementedError(f"{kernel}: weights must share one of bf16/f16/f32, got {sorted(map(str, dtypes))}")
    in_scale, out_weight = slot_scales(routing, cfg)
    args = (
        experts.gate,
        experts.up,
        experts.down,
        routing.indices,
        out_weight,
        in_scale if cfg.weights_on_input else None,
    )
    kwargs = {
        "activation": _ACTIVATIONS[cfg.activation],
        "limit": cfg.swiglu_limit,
        "clamp_order": cfg.clamp_order.value,
        "alpha": cfg.swiglu_alpha,
        "gate_bias": experts.gate_bias,
        "up_bias": experts.up_bias,
        "down_bias": experts.down_bias,
        "interpret": interpret_mode(),
    }
    return args, kwargs


def pallas_decode(experts: ExpertWeights, x: Array, routing: Routing, cfg: MoEConfig) -> Array:
    """Routed output `[T, H]` float32 by the fused union-of-experts decode kernel (T <= 8, T·K <= 64)."""
    T, K = routing.indices.shape
    if not decode_fits(T, K):
        raise NotImplementedError(f"pallas_decode serves T <= 8 rows and T·K <= 64 slots, got T={T}, K={K}")
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_decode", experts, routing, cfg)
    return pallas_kernels.moe_decode(x, gate, up, down, indices, weights, in_scale, **kwargs)


def pallas_grouped(experts: ExpertWeights, x: Array, routing: Routing, cfg: MoEConfig) -> Array:
    """Routed output `[T, H]` float32 by the grouped (block-aligned, sorted by expert) prefill kernels."""
    if cfg.weights_on_input and cfg.hash_routing:
        # A hash table may repeat an expert in a row; the reference then scales that row's input by the summed
        # weights, while the grouped kernel scales each pair on its own.
        raise NotImplementedError("pallas_grouped: weights_on_input with hash routing (repeated ids in a row)")
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_grouped", experts, routing, cfg)
    return pallas_kernels.moe_grouped(x, gate, up, down, indices, weights, in_scale, **kwargs)
