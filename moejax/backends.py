"""The registry of routed-expert implementations, and the one place `impl=` is resolved.

Every implementation has the same narrow signature, `run(experts, x, slots, act, *, lora=None, block_rows=None)
-> [T, H]` float32 (`moejax.experts.Slots`, `GatedActivation`, `moejax.lora.ExpertLoRA`: a stack's expert
adapters, each row's id in `slots.adapter`), prepares the weights it needs itself, and raises
`NotImplementedError` (at trace time) for a case it cannot serve. `impl="auto"` tries an ordered list of
candidates and takes the first that serves the call; when all fail, one error lists each one's reason.

  "reference"      dense float32: every expert on every token, masked, one expert at a time. The oracle.
  "native"         `moejax.native_cpu`: the C++ kernels through XLA's FFI (csrc/), any T, every weight format and
                   layout; no adapters. Optional: built by `pip install` when a C++ compiler is present.
  "cpu_decode"     `moejax.cpu_plans`: per-expert layout, `lax.switch` to each union expert (weights read in
                   place by XLA:CPU), T <= 8 rows and T·K <= 64 slots.
  "cpu_grouped"    `moejax.cpu_plans`: per-expert layout, pairs sorted by expert, blocks dispatched by `lax.switch`.
  "xla_decode"     union-of-experts decode over the stacked layout (T <= 8, T·K <= 64).
  "xla_grouped"    grouped plan over pairs sorted by expert, stacked layout (any T).
  "pallas_decode", "pallas_grouped"
                   the Pallas kernels (`moejax.kernel_plans`): Mosaic GPU where lowered for CUDA (interpreted on
                   CPU), Mosaic TPU where lowered for TPU; stacked dense or quantized weights.
  "ragged"         `moejax.ragged`: grouped matmuls on `jax.lax.ragged_dot` (stacked dense weights), any T. Runs
                   on CPU too (densified by XLA:CPU: for tests), but "auto" takes it only on TPU/GPU.
Families: "xla" (decode where it fits, else grouped), "cpu", "pallas" likewise.
"auto": the kernels `pallas_kernels/validated.json` lists for the devices the program is lowered for (and for the
weight format: quantized kernels need their own rows); for grouped calls on TPU/GPU, "ragged"; on CPU the native
kernels when built; then the CPU plans when the weights are per-expert; then the XLA plans. The platform and
devices are those the program is lowered and compiled for (a compile-only TPU topology on a CPU host included),
chosen while lowering (`pallas_kernels.platform.choose_at_lowering`), never the host's default backend. The
kernels do not apply adapters: with `lora` they raise and "auto" runs the XLA/CPU plans.

Gradients: `run_routed` wraps every backend but the reference in a `jax.custom_vjp` whose backward is the VJP of
`reference_routed` (the plans' loops with device trip counts are not reverse-differentiable). Gradients w.r.t. x,
the slots' weights and scales, the adapters and the expert weights are the reference path's; the backward costs
what the reference costs (every expert on every row). Forward-mode (`jax.jvp`) of the plans is not defined.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

import pallas_kernels
from moejax import kernel_plans, native_cpu, ragged
from moejax.experts import Slots, check_lora_slots, reference_routed
from moejax.lora import ExpertLoRA, expert_ffn
from moejax.plans import decode_fits, decode_plan, grouped_plan
from moejax.weights import Experts, PerExpert
from pallas_kernels.activations import GatedActivation

Array = jax.Array
RoutedFn = Callable[..., Array]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of the routed experts. `decode`: whether it serves only decode-sized calls."""

    name: str
    run: RoutedFn
    decode: bool = False


def _reference(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None) -> Array:
    del block_rows
    return reference_routed(experts, x, slots, act, lora=lora)


def _xla_decode(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None) -> Array:
    del block_rows
    return decode_plan(experts, x, slots, act, lora=lora)


def _xla_grouped(
    experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None
) -> Array:
    return grouped_plan(experts, x, slots, act, lora=lora, block_rows=block_rows)


def _cpu(plan_name: str) -> RoutedFn:
    def run(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None) -> Array:
        del block_rows
        if not isinstance(experts, PerExpert):
            raise NotImplementedError(
                "the CPU plans read the per-expert layout (moejax.weights.to_layout(experts, 'per_expert'))"
            )
        from moejax import cpu_plans  # TODO(integration): module-level import

        plan = getattr(cpu_plans, plan_name)
        adapter = check_lora_slots(lora, slots)
        if lora is None:
            expert_fns = [functools.partial(part.ffn, act=act) for part in experts.parts]
        else:  # expert e's adapters sliced statically inside its switch branch
            expert_fns = [
                lambda rows, ids, part=part, e=e: expert_ffn(part, rows, act, lora.expert(e), ids)
                for e, part in enumerate(experts.parts)
            ]
        padded_rows = min(part.padded_rows for part in experts.parts)
        return plan(
            expert_fns, x, slots.indices, slots.in_scale, slots.out_weight, adapter=adapter, padded_rows=padded_rows
        )

    return run


def _native(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None) -> Array:
    del block_rows
    return native_cpu.routed_experts(experts, x, slots, act, lora=lora)


def _pallas(kernel: Callable[..., Array]) -> RoutedFn:
    def run(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None) -> Array:
        del block_rows
        return kernel(experts, x, slots, act, lora=lora)

    return run


def _ragged(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora=None, block_rows=None) -> Array:
    del block_rows
    return ragged.ragged_grouped(experts, x, slots, act, lora=lora)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", _reference),
        Backend("native", _native),
        Backend("pallas_decode", _pallas(kernel_plans.pallas_decode), decode=True),
        Backend("pallas_grouped", _pallas(kernel_plans.pallas_grouped)),
        Backend("cpu_decode", _cpu("switch_decode"), decode=True),
        Backend("cpu_grouped", _cpu("switch_grouped")),
        Backend("xla_decode", _xla_decode, decode=True),
        Backend("xla_grouped", _xla_grouped),
        Backend("ragged", _ragged),
    )
}
_FAMILIES = ("xla", "cpu", "pallas")
IMPLS = ("auto", *_FAMILIES, *BACKENDS)
# Each kernel backend: the pallas_kernels kernel it runs (for validated.json).
_KERNELS = {"pallas_decode": "moe_decode", "pallas_grouped": "moe_grouped"}


def kernel_validated(name: str) -> bool:
    """Whether kernel backend `name` may be a candidate of "auto": `pallas_kernels/validated.json` lists its kernel
    for some device kind at this JAX version (checked by benchmarks/gpu_bench.py, tpu_bench.py). Where it then
    runs is decided when the program is lowered: only for a device kind with a row (`kernel_plans.validated_on`),
    never by the host's default backend."""
    return pallas_kernels.is_validated(_KERNELS[name], None, jax.__version__)


def _native_available() -> bool:
    return native_cpu.available()


def _auto_may_run(name: str, experts: Experts) -> bool:
    """Under "auto": a kernel backend runs quantized experts only where validated.json lists that format too
    (`kernel_validated` checked the dense kernel; the quantized kernel bodies are separate)."""
    weights = kernel_plans.weights_name(experts)
    if name not in _KERNELS or weights == "dense":
        return True
    return pallas_kernels.is_validated(_KERNELS[name], None, jax.__version__, weights=weights)


def may_run_kernels(impl: str) -> bool:
    """Whether `impl` may run a Pallas kernel in a CPU program (under the Mosaic GPU interpreter): "auto" never
    does (its kernels run only where lowered for a validated accelerator)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    return impl == "pallas" or impl in _KERNELS


def candidates(impl: str, num_rows: int, top_k: int) -> list[str]:
    """The backends `impl` tries, in order, for a call of `num_rows` rows of `top_k` slots (static)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    kind = "decode" if decode_fits(num_rows, top_k) else "grouped"
    if impl in _FAMILIES:
        return [f"{impl}_{kind}"]
    if impl == "auto":
        kernel = f"pallas_{kind}"
        ragged_dot = ["ragged"] * (kind == "grouped")  # on TPU/GPU only: chosen while lowering (_dispatch)
        native = ["native"] * _native_available()  # on CPU only: chosen while lowering (_dispatch)
        return [kernel] * kernel_validated(kernel) + ragged_dot + native + [f"cpu_{kind}", f"xla_{kind}"]
    if BACKENDS[impl].decode and kind != "decode":
        raise ValueError(f"impl={impl!r} serves at most 8 rows and 64 slots, got T={num_rows}, K={top_k}")
    return [impl]


def run_routed(
    impl: str,
    experts: Experts,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    *,
    lora: ExpertLoRA | None = None,
    block_rows: int | None = None,
) -> Array:
    """The routed sum `[T, H]` float32 by the first candidate of `impl` that serves the call.

    With `lora` (a stack's expert adapters) each row gets its adapter's deltas (`slots.adapter`). Every backend
    but the reference runs under `jax.custom_vjp` with the reference's backward (see the module docstring).

    Raises:
      NotImplementedError: no candidate serves it (the message lists each one's reason).
    """
    names = candidates(impl, *slots.indices.shape)
    if impl == "auto":
        names = [name for name in names if _auto_may_run(name, experts)]
    if names == ["reference"]:
        return _dispatch(impl, names, experts, x, slots, act, lora, block_rows)

    @jax.custom_vjp
    def routed(experts, x, slots, lora):
        return _dispatch(impl, names, experts, x, slots, act, lora, block_rows)

    def routed_fwd(experts, x, slots, lora):
        return routed(experts, x, slots, lora), (experts, x, slots, lora)

    def routed_bwd(residuals, cotangent):
        reference = lambda experts, x, slots, lora: reference_routed(experts, x, slots, act, lora=lora)
        return jax.vjp(reference, *residuals)[1](cotangent)

    routed.defvjp(routed_fwd, routed_bwd)
    return routed(experts, x, slots, lora)


def _dispatch(impl, names, experts, x, slots, act, lora, block_rows) -> Array:
    def run(name, experts, x, slots, lora):
        return BACKENDS[name].run(experts, x, slots, act, lora=lora, block_rows=block_rows)

    if len(names) == 1:
        return run(names[0], experts, x, slots, lora)
    reasons = []
    for i, name in enumerate(names):
        try:
            if impl != "auto" or name not in (*_KERNELS, "ragged", "native"):
                return run(name, experts, x, slots, lora)
            # A kernel or ragged_dot serves this call: it, or the rest of the list, is chosen while lowering.
            jax.eval_shape(functools.partial(run, name), experts, x, slots, lora)
            fallback = lambda e, x, s, lo, i=i: _dispatch(impl, names[i + 1 :], e, x, s, act, lo, block_rows)
            operands = (functools.partial(run, name), fallback, experts, x, slots, lora)
            if name == "ragged":
                return ragged.on_accelerators(*operands)
            if name == "native":
                return native_cpu.on_cpu(*operands)
            return kernel_plans.on_validated_devices(_KERNELS[name], kernel_plans.weights_name(experts), *operands)
        except NotImplementedError as err:
            reasons.append(f"{name}: {err}")
    raise NotImplementedError(f"impl={impl!r}: no implementation serves this call ({'; '.join(reasons)})")


def resolve_impl(
    impl: str, experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora: ExpertLoRA | None = None
) -> str:
    """The backend `impl` would run for this call (traced abstractly, nothing computed; for tests and benchmarks)."""
    for name in candidates(impl, *slots.indices.shape):
        if impl == "auto" and not _auto_may_run(name, experts):
            continue
        try:
            run = functools.partial(BACKENDS[name].run, act=act)
            jax.eval_shape(lambda e, x, s, lo, run=run: run(e, x, s, lora=lo), experts, x, slots, lora)
        except NotImplementedError:
            continue
        return name
    raise NotImplementedError(f"impl={impl!r}: no implementation serves this call")
