"""The routed experts on the Pallas kernels: adapts `(experts, x, Slots, GatedActivation)` to `pallas_kernels`.

Same contract as the XLA plans (`moejax.plans`): float32 `[T, H]` `Σ_k w_k · E_k(s_k · x)`, skipped ids
(>= num_experts) contribute nothing, Llama-4's input scaling through `Slots.in_scale`. A config a kernel
cannot serve raises `NotImplementedError`, so that `impl="auto"` falls back to the XLA plans.

LoRA: the kernels do not apply adapters; with adapters (`lora=`) they raise `NotImplementedError` and
impl='auto' runs the XLA plans (or the CPU plans on the per-expert layout).

The kernels are called with `interpret=None`: the platform the program is lowered for decides, so a program
lowered for CUDA holds the compiled kernels (also when lowered on a CPU-only host: ahead-of-time compilation,
`jax.export`) and one lowered for CPU runs them under the Mosaic GPU interpreter (slow: for tests). See
`pallas_kernels.platform`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from moejax.experts import Slots
from moejax.plans import decode_fits
from moejax.weights import Experts, ExpertWeights
from pallas_kernels.activations import GatedActivation

Array = jax.Array

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _kernel_args(kernel: str, experts: Experts, slots: Slots, act: GatedActivation, lora) -> tuple[tuple, dict]:
    if lora is not None:
        raise NotImplementedError(f"{kernel}: the kernels do not apply LoRA adapters")
    if type(experts) is not ExpertWeights:
        raise NotImplementedError(
            f"{kernel}: reads stacked dense ExpertWeights, got {type(experts).__name__} "
            "(format or layout has no kernel)"
        )
    biases = (experts.gate_bias, experts.up_bias, experts.down_bias)
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise NotImplementedError(f"{kernel}: expert biases must be all of gate/up/down or none")
    dtypes = {jnp.dtype(w.dtype) for w in (experts.gate, experts.up, experts.down)}
    if len(dtypes) != 1 or not dtypes <= set(_KERNEL_DTYPES):
        raise NotImplementedError(f"{kernel}: weights must share one of bf16/f16/f32, got {sorted(map(str, dtypes))}")
    args = (experts.gate, experts.up, experts.down, slots.indices, slots.out_weight, slots.in_scale)
    kwargs = {
        "activation": act,
        "gate_bias": experts.gate_bias,
        "up_bias": experts.up_bias,
        "down_bias": experts.down_bias,
        "interpret": None,
    }
    return args, kwargs


def pallas_decode(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None) -> Array:
    """Routed output `[T, H]` float32 by the fused union-of-experts decode kernel (T <= 8, T·K <= 64)."""
    T, K = slots.indices.shape
    if not decode_fits(T, K):
        raise NotImplementedError(f"pallas_decode serves T <= 8 rows and T·K <= 64 slots, got T={T}, K={K}")
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_decode", experts, slots, act, lora)
    return pallas_kernels.moe_decode(x, gate, up, down, indices, weights, in_scale, **kwargs)


def pallas_grouped(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None) -> Array:
    """Routed output `[T, H]` float32 by the grouped (block-aligned, sorted by expert) prefill kernels.

    Each pair is scaled on its own: with hash routing a row may pick an expert twice, and the models then scale
    that row's input by the summed weights (`weights_on_input` with hash routing is not a family today).
    """
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_grouped", experts, slots, act, lora)
    return pallas_kernels.moe_grouped(x, gate, up, down, indices, weights, in_scale, **kwargs)
