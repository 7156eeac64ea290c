"""The "pallas_decode" and "pallas_grouped" backends: the routed experts on the Pallas kernels (`pallas_kernels`).

Same contract as the other backends (`moejax.backends`): float32 `[T, H]` `Σ_k w_k · E_k(s_k · x)`, skipped ids
(>= num_experts) contribute nothing, Llama-4's input scaling through `Slots.in_scale`. A config a kernel
cannot serve raises `NotImplementedError` (other formats and wrappers of them), so that `impl="auto"` falls back
to the XLA or CPU plans.

What the kernels read: dense stacked `ExpertWeights` (bf16/f16/f32), or stacked `QuantizedExperts` (int8/int4
group-wise, FP8 128x128 blocks, MXFP4, NVFP4), passed as `pallas_kernels.QuantizedWeight`s over the very arrays
moejax stores (codes, scales, zero points, NVFP4's scale2: no copy, no dequantization here). The kernels dequantize
each pipeline step's tile in registers, after its TMA load into shared memory and before the bf16 wgmma
(docs/FORMATS.md, "Kernels"); x and h are bf16 there.

The kernels are called with `interpret=None`: the platform the program is lowered for decides, so a program
lowered for CUDA holds the compiled kernels (also when lowered on a CPU-only host: ahead-of-time compilation,
`jax.export`) and one lowered for CPU runs them under the Mosaic GPU interpreter (slow: for tests). See
`pallas_kernels.platform`.

Gradients (`pallas_vjp`, the backends' VJP in `moejax.backends.run_routed`): `pallas_kernels.moe_grouped_vjp`, grouped
kernels over the routed rows (Mosaic GPU; megablox `gmm`/`tgmm` on TPU), for dense stacked weights; quantized
bases and adapters take `routed_vjp`. Under `impl="auto"`, `validated_vjp` runs them where validated.json lists them
("moe_grouped_vjp") for the devices, chosen while lowering.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from moejax.backends.backward import routed_vjp
from moejax.backends.xla import decode_fits
from moejax.quantized import QuantizedExperts
from moejax.slots import Slots
from moejax.weights import Experts, ExpertWeights
from pallas_kernels.activations import GatedActivation
from pallas_kernels.grouped_backward import moe_grouped_vjp
from pallas_kernels.platform import choose_at_lowering
from pallas_kernels.quantized_weights import QuantizedWeight

Array = jax.Array

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_STEP = 64  # contraction elements per pipeline step of the kernels (bf16 tiles of 128-byte rows; 4-bit: 2x)


def weights_name(experts: Experts) -> str:
    """The weight format as validated.json names it: "dense", or the quantized scheme's name ("int8_g128_sym")."""
    return experts.scheme.name if isinstance(experts, QuantizedExperts) else "dense"


def quantized_weights(kernel: str, experts: QuantizedExperts) -> tuple[QuantizedWeight, ...]:
    """The stacked quantized projections as the kernels' `QuantizedWeight`s: the same arrays, no copy.

    `NotImplementedError` for what the kernels do not read: per-expert layouts (stacked only), and int group
    sizes that are neither a multiple nor a divisor of the kernels' contraction steps (64 elements, int4 128).
    """
    s = experts.scheme
    if s.activations != "float32":
        raise NotImplementedError(f"{kernel}: {s.name}: Scheme.activations={s.activations!r} is not implemented")
    if experts.gate_q.ndim != 3:
        raise NotImplementedError(f"{kernel}: reads the stacked layout of {type(experts).__name__}")
    kind = s.kernel_kind
    out = []
    for p in ("gate", "up", "down"):
        w = QuantizedWeight(
            getattr(experts, f"{p}_q"),
            getattr(experts, f"{p}_scale"),
            getattr(experts, f"{p}_zero"),
            getattr(experts, f"{p}_scale2"),
            kind=kind,
        )
        g, step = w.group, 2 * _STEP if w.packed else _STEP
        if kind in ("int8", "int4") and g % step and step % g:
            raise NotImplementedError(f"{kernel}: {s.name} groups of {g} do not tile the {step}-element steps")
        out.append(w)
    return tuple(out)


def _kernel_args(kernel: str, experts: Experts, slots: Slots, act: GatedActivation) -> tuple[tuple, dict]:
    if isinstance(experts, QuantizedExperts):
        weights = quantized_weights(kernel, experts)
    elif type(experts) is ExpertWeights:
        weights = (experts.gate, experts.up, experts.down)
        dtypes = {jnp.dtype(w.dtype) for w in weights}
        if len(dtypes) != 1 or not dtypes <= set(_KERNEL_DTYPES):
            raise NotImplementedError(
                f"{kernel}: weights must share one of bf16/f16/f32, got {sorted(map(str, dtypes))}"
            )
    else:
        raise NotImplementedError(
            f"{kernel}: reads stacked ExpertWeights or QuantizedExperts, got {type(experts).__name__} "
            "(format or layout has no kernel)"
        )
    biases = (experts.gate_bias, experts.up_bias, experts.down_bias)
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise NotImplementedError(f"{kernel}: expert biases must be all of gate/up/down or none")
    args = (*weights, slots.indices, slots.out_weight, slots.in_scale)
    kwargs = {
        "activation": act,
        "gate_bias": experts.gate_bias,
        "up_bias": experts.up_bias,
        "down_bias": experts.down_bias,
        "interpret": None,
    }
    return args, kwargs


def pallas_decode(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """Routed output `[T, H]` float32 by the fused union-of-experts decode kernel (T <= 8, T·K <= 64)."""
    del block_rows
    T, K = slots.indices.shape
    if not decode_fits(T, K):
        raise NotImplementedError(f"pallas_decode serves T <= 8 rows and T·K <= 64 slots, got T={T}, K={K}")
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_decode", experts, slots, act)
    return pallas_kernels.moe_decode(x, gate, up, down, indices, weights, in_scale, **kwargs)


def pallas_grouped(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """Routed output `[T, H]` float32 by the grouped (block-aligned, sorted by expert) prefill kernels.

    Each pair is scaled on its own: with hash routing a row may pick an expert twice, and the models then scale
    that row's input by the summed weights (`weights_on_input` with hash routing is not a family today).
    `block_rows` is ignored (the kernels' own blocks).
    """
    del block_rows
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_grouped", experts, slots, act)
    return pallas_kernels.moe_grouped(x, gate, up, down, indices, weights, in_scale, **kwargs)


def validated_on(kernel: str, weights: str, platform: str, device_kinds: frozenset[str] | None) -> bool:
    """Whether `pallas_kernels/validated.json` lists `kernel` for `weights` on every device kind of a program
    lowered for `platform` at this JAX version. Never on CPU (the kernels would run interpreted) nor where the
    devices are unknown (`jax.export`)."""
    if platform not in ("cuda", "rocm", "tpu") or not device_kinds:
        return False
    return all(pallas_kernels.is_validated(kernel, kind, jax.__version__, weights=weights) for kind in device_kinds)


def on_validated_devices(kernel: str, weights: str, run_kernel, fallback, *operands) -> Array:
    """`run_kernel(*operands)` where the program is lowered for devices on which `kernel` is validated for
    `weights` (`validated_on`), else `fallback(*operands)`: decided while lowering, by the lowering platform and
    the program's devices (`pallas_kernels.platform.choose_at_lowering`), so that a program compiled for a TPU or
    GPU topology on a CPU host gets the kernel and the host's own programs the fallback."""

    def choose(platform: str, device_kinds: frozenset[str] | None) -> int:
        return 0 if validated_on(kernel, weights, platform, device_kinds) else 1

    return choose_at_lowering(choose, (run_kernel, fallback), *operands)


def pallas_vjp(
    experts: Experts, x: Array, slots: Slots, act: GatedActivation, cotangent: Array, perturbed, *, block_rows=None
):
    """The kernel backends' backward (`moejax.backends.run_routed`'s VJP contract): cotangents of `(experts, x,
    slots)` by `pallas_kernels.moe_grouped_vjp` (grouped kernels over the routed rows; megablox on TPU).

    Dense stacked `ExpertWeights` only (`NotImplementedError` otherwise: quantized bases, adapters, per-expert
    layouts take `routed_vjp`). Hash routing's repeated (row, expert) pairs are scaled each on its own, as the
    forward kernels do.
    """
    del block_rows
    if type(experts) is not ExpertWeights:
        raise NotImplementedError(f"pallas backward: reads stacked dense ExpertWeights, got {type(experts).__name__}")
    (gate, up, down, indices, weights, in_scale), kwargs = _kernel_args("pallas_vjp", experts, slots, act)
    grads = moe_grouped_vjp(
        x,
        gate,
        up,
        down,
        indices,
        weights,
        in_scale,
        **kwargs,
        cotangent=cotangent,
        weight_grads=any(jax.tree.leaves(perturbed[0])),
        out_weight_grads=bool(perturbed[2].out_weight),
    )
    d_experts = None
    if grads.gate is not None:
        fields = {f: getattr(grads, f) for f in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
        d_experts = dataclasses.replace(experts, **{k: v for k, v in fields.items() if getattr(experts, k) is not None})
    d_slots = Slots(
        np.zeros(slots.indices.shape, jax.dtypes.float0),
        grads.weights,
        grads.in_scale,
        None if slots.adapter is None else np.zeros(slots.adapter.shape, jax.dtypes.float0),
    )
    return d_experts, grads.x, d_slots


def validated_vjp(
    experts: Experts,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    cotangent: Array,
    perturbed,
    *,
    block_rows=None,
):
    """The kernel backends' backward under `impl="auto"`: `pallas_vjp` where the program is lowered for devices on
    which validated.json lists "moe_grouped_vjp" (the backward kernels, checked on a device like the forward's),
    else `routed_vjp`; decided while lowering (`on_validated_devices`). Same contract as `pallas_vjp`."""
    if type(experts) is not ExpertWeights:
        raise NotImplementedError(f"pallas backward: reads stacked dense ExpertWeights, got {type(experts).__name__}")
    primals = (experts, x, slots)
    flags = jax.tree.leaves(perturbed)
    leaves = jax.tree.leaves(primals)
    wanted = [f and jnp.issubdtype(leaf.dtype, jnp.inexact) for f, leaf in zip(flags, leaves, strict=True)]

    def perturbed_only(backward):
        """`backward`'s gradients of the differentiated float leaves, as a list (the branches' common type)."""

        def run(experts, x, slots, cotangent):
            grads = backward(experts, x, slots, act, cotangent, perturbed, block_rows=block_rows)
            per_arg = [
                [None] * len(jax.tree.leaves(arg)) if g is None else jax.tree.structure(arg).flatten_up_to(g)
                for arg, g in zip((experts, x, slots), grads, strict=True)
            ]
            flat = [g for arg in per_arg for g in arg]
            return [
                jnp.zeros(leaf.shape, leaf.dtype) if g is None else jnp.asarray(g).astype(leaf.dtype)
                for g, leaf, w in zip(flat, jax.tree.leaves((experts, x, slots)), wanted, strict=True)
                if w
            ]

        run.__name__ = backward.__name__  # what a printed jaxpr shows: choose_at_lowering[choice=pallas_vjp|routed_vjp]
        return run

    def choose(platform: str, device_kinds: frozenset[str] | None) -> int:
        return 0 if validated_on("moe_grouped_vjp", "dense", platform, device_kinds) else 1

    branches = (perturbed_only(pallas_vjp), perturbed_only(routed_vjp))
    chosen = iter(choose_at_lowering(choose, branches, experts, x, slots, cotangent))
    full = [
        next(chosen)
        if w
        else (None if jnp.issubdtype(leaf.dtype, jnp.inexact) else np.zeros(leaf.shape, jax.dtypes.float0))
        for leaf, w in zip(leaves, wanted, strict=True)
    ]
    return tuple(jax.tree.unflatten(jax.tree.structure(primals), full))
