"""The expert backends: the registry of routed-expert implementations and the one place `impl=` is resolved.

A backend is one function `run(experts, x, slots, act, *, block_rows=None) -> [T, H]` float32 (the experts in
any weight format and layout, or a wrapper of one such as `moejax.lora.adapt`'s; `moejax.slots.Slots`;
`GatedActivation`; `block_rows`: the grouped block size where the caller fixes it, else ignored). It prepares
the weights it needs itself and raises `NotImplementedError` at trace time for what it cannot serve. One module
each: `reference`, `xla` (decode, grouped), `cpu` (decode, grouped: per-expert layout), `pallas` (the kernels),
`native` (the C++ kernels through XLA's FFI), `ragged` (`jax.lax.ragged_dot`). Adding one is a module and a
`register(Backend(name, run))` call (a test may call it too).

`impl=`: a backend's name; a group ("xla", "cpu", "pallas": decode where it fits, else grouped); or "auto",
which tries an ordered list of candidates and takes the first that serves the call: the kernels
`pallas_kernels/validated.json` lists for the devices the program is lowered for (and for the weight format),
"ragged" for grouped calls on TPU/GPU, "native" on CPU when built, then the CPU plans (per-expert layout), then
the XLA plans. Kernels, ragged and native are chosen while lowering (`pallas_kernels.platform.choose_at_lowering`:
the platform and devices the program is compiled for, never the host's default backend). When all candidates
fail, one error lists each one's reason.

Gradients: `run_routed` wraps every backend but the reference and ragged in a `jax.custom_vjp` whose backward is
the backend's own where it has one and reads the experts' format: the native C++ backward where the native forward
runs (`native.routed_backward`: dense float weights, or a frozen quantized base; the routed experts' adapters on
either; not int8 activations), the Pallas grouped
backward kernels (`pallas.pallas_vjp`: dense stacked weights; under "auto" only on devices validated.json lists
them for, `pallas.validated_vjp`); else `moejax.backends.backward.routed_vjp`, a grouped backward over the routed
(row, expert) pairs only (the plans' loops with device trip counts are not reverse-differentiable). Each gives
gradients w.r.t. x, the slots' weights and scales and the experts (adapters of a wrapper included) equal to the
reference's up to float32 summation order, at a cost proportional to T·K. The native backward's fwd rule is the
native training forward (`native.routed_train_forward`: the output within float32 rounding of the forward kernels',
and each routed pair's gate/up pre-activations, `T·K·2I` float32, saved for the backward); with
`native.save_residuals(False)` it is the plain forward and the backward recomputes them. The fwd rule runs only
under differentiation: a plain forward is unchanged. `jax.checkpoint` around the layer recomputes the whole
forward. The reference and ragged (`jax.lax.ragged_dot`'s own transpose) are differentiated as they are.
Forward-mode (`jax.jvp`) of the plans is not defined.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero, custom_vjp_primal_tree_values

import pallas_kernels
from moejax.backends import native, native_ops, pallas, ragged
from moejax.backends.backward import routed_vjp
from moejax.backends.cpu import cpu_decode, cpu_grouped
from moejax.backends.reference import reference_routed
from moejax.backends.xla import decode_fits, decode_plan, grouped_plan
from moejax.slots import Slots
from moejax.weights import Experts
from pallas_kernels.activations import GatedActivation

Array = jax.Array
RoutedFn = Callable[..., Array]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of the routed experts: `run(experts, x, slots, act, *, block_rows=None) -> [T, H]`.

    decode: whether it serves only decode-sized calls (`xla.decode_fits`). chooser: under "auto",
    `chooser(run, fallback, experts, x, slots)` runs it or the rest of the candidates, decided while lowering
    (None: it runs wherever it serves the call).
    """

    name: str
    run: RoutedFn
    decode: bool = False
    chooser: Callable[..., Array] | None = None
    # Its own VJP, `routed_vjp`'s signature, run where it is the only candidate (an explicit `impl=`; a kernel
    # backend's under "auto": `pallas.validated_vjp`); NotImplementedError for a call hands it to `routed_vjp`.
    backward: Callable[..., tuple] | None = None


BACKENDS: dict[str, Backend] = {}
GROUPS = ("xla", "cpu", "pallas")  # `impl=` names that pick `<group>_decode` where it fits, else `<group>_grouped`
# Each kernel backend: the pallas_kernels kernel it runs (for validated.json).
_KERNELS = {"pallas_decode": "moe_decode", "pallas_grouped": "moe_grouped"}


class _Impls(Sequence):
    """The names `impl=` takes, "auto", the groups, then the registered backends: a live view of the registry."""

    def __getitem__(self, i):
        return ("auto", *GROUPS, *BACKENDS)[i]

    def __len__(self) -> int:
        return 1 + len(GROUPS) + len(BACKENDS)

    def __repr__(self) -> str:
        return repr(tuple(self))


IMPLS = _Impls()


def register(backend: Backend) -> None:
    """Add `backend` to the registry: `impl=backend.name` runs it ("auto" does not try it)."""
    if backend.name in ("auto", *GROUPS) or backend.name in BACKENDS:
        raise ValueError(f"backend name {backend.name!r} is taken")
    BACKENDS[backend.name] = backend


def unregister(name: str) -> None:
    """Remove backend `name` from the registry (`KeyError` when it is not there)."""
    del BACKENDS[name]


def _on_validated_devices(name: str) -> Callable[..., Array]:
    def choose(run, fallback, experts, *operands):
        weights = pallas.weights_name(experts)
        return pallas.on_validated_devices(_KERNELS[name], weights, run, fallback, experts, *operands)

    return choose


for _backend in (
    Backend("reference", reference_routed),
    Backend("native", native_ops.routed_experts, chooser=native.on_cpu),
    Backend(
        "pallas_decode",
        pallas.pallas_decode,
        decode=True,
        chooser=_on_validated_devices("pallas_decode"),
        backward=pallas.pallas_vjp,
    ),
    Backend(
        "pallas_grouped",
        pallas.pallas_grouped,
        chooser=_on_validated_devices("pallas_grouped"),
        backward=pallas.pallas_vjp,
    ),
    Backend("cpu_decode", cpu_decode, decode=True),
    Backend("cpu_grouped", cpu_grouped),
    Backend("xla_decode", decode_plan, decode=True),
    Backend("xla_grouped", grouped_plan),
    Backend("ragged", ragged.ragged_grouped, chooser=ragged.on_accelerators),
):
    register(_backend)


def kernel_validated(name: str) -> bool:
    """Whether kernel backend `name` may be a candidate of "auto": `pallas_kernels/validated.json` lists its kernel
    for some device kind at this JAX version (checked by benchmarks/gpu_bench.py, tpu_bench.py). Where it then
    runs is decided when the program is lowered: only for a device kind with a row (`pallas.validated_on`),
    never by the host's default backend."""
    return pallas_kernels.is_validated(_KERNELS[name], None, jax.__version__)


def _auto_may_run(name: str, experts: Experts) -> bool:
    """Under "auto": a kernel backend runs quantized experts only where validated.json lists that format too
    (`kernel_validated` checked the dense kernel; the quantized kernel bodies are separate)."""
    weights = pallas.weights_name(experts)
    if name not in _KERNELS or weights == "dense":
        return True
    return pallas_kernels.is_validated(_KERNELS[name], None, jax.__version__, weights=weights)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")


def may_run_kernels(impl: str) -> bool:
    """Whether `impl` may run a Pallas kernel in a CPU program (under the Mosaic GPU interpreter): "auto" never
    does (its kernels run only where lowered for a validated accelerator)."""
    _check_impl(impl)
    return impl == "pallas" or impl in _KERNELS


def candidates(impl: str, num_rows: int, top_k: int) -> list[str]:
    """The backends `impl` tries, in order, for a call of `num_rows` rows of `top_k` slots (static)."""
    _check_impl(impl)
    kind = "decode" if decode_fits(num_rows, top_k) else "grouped"
    if impl in GROUPS:
        return [f"{impl}_{kind}"]
    if impl == "auto":
        kernel = f"pallas_{kind}"
        ragged_dot = ["ragged"] * (kind == "grouped")  # on TPU/GPU only: chosen while lowering (_dispatch)
        native_cpu = ["native"] * native.available()  # on CPU only: chosen while lowering (_dispatch)
        return [kernel] * kernel_validated(kernel) + ragged_dot + native_cpu + [f"cpu_{kind}", f"xla_{kind}"]
    if BACKENDS[impl].decode and kind != "decode":
        raise ValueError(f"impl={impl!r} serves at most 8 rows and 64 slots, got T={num_rows}, K={top_k}")
    return [impl]


def _names(impl: str, experts: Experts, slots: Slots) -> list[str]:
    names = candidates(impl, *slots.indices.shape)
    return [name for name in names if impl != "auto" or _auto_may_run(name, experts)]


def run_routed(
    impl: str,
    experts: Experts,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    *,
    block_rows: int | None = None,
) -> Array:
    """The routed sum `[T, H]` float32 by the first candidate of `impl` that serves the call.

    Every backend but the reference and ragged runs under `jax.custom_vjp` with the grouped backward over the
    routed pairs (see the module docstring). Adapters come wrapped with the experts (`moejax.lora.adapt`), their
    rows' ids in `slots.adapter`.

    Raises:
      NotImplementedError: no candidate serves it (the message lists each one's reason).
    """
    names = _names(impl, experts, slots)
    if names in (["reference"], ["ragged"]):  # both differentiate themselves (ragged_dot has its own transpose)
        return _dispatch(impl, names, experts, x, slots, act, block_rows)
    perturbed = []  # the fwd rule's flags of what is differentiated, read by the bwd rule (static)

    @jax.custom_vjp
    def routed(experts, x, slots):
        return _dispatch(impl, names, experts, x, slots, act, block_rows)

    def routed_fwd(experts, x, slots):
        is_primal = lambda leaf: isinstance(leaf, CustomVJPPrimal)
        perturbed.append(jax.tree.map(lambda p: p.perturbed, (experts, x, slots), is_leaf=is_primal))
        values = custom_vjp_primal_tree_values((experts, x, slots))
        if "native" in names and native.saves_residuals():
            try:  # the native training forward: the output and the pre-activations its backward reads
                return _native_train_forward(impl, names, values, act, block_rows, perturbed[-1])
            except NotImplementedError:
                pass
        return _dispatch(impl, names, *values, act, block_rows), (values, None)

    def routed_bwd(residuals, cotangent):
        if isinstance(cotangent, SymbolicZero):
            return None, None, None
        values, saved = residuals
        args = (*values, act, cotangent, perturbed[-1])
        grouped = functools.partial(routed_vjp, *args, block_rows=block_rows)

        def kernels_or_grouped():
            backward = BACKENDS[names[0]].backward if len(names) == 1 else None
            if impl == "auto" and names[0] in _KERNELS:  # the backward kernels where validated (chosen at lowering)
                backward = pallas.validated_vjp
            if backward is not None:
                try:
                    return backward(*args, block_rows=block_rows)
                except NotImplementedError:
                    pass  # a format its kernels do not read
            return grouped()

        if "native" in names:
            own = functools.partial(native.routed_backward, *args, residual=saved)
            try:  # the native backward where the native forward ran and it reads the experts' format
                return own() if names == ["native"] else native.on_cpu_tree(own, kernels_or_grouped)
            except NotImplementedError:
                pass
        return kernels_or_grouped()

    if _in_shard_map():  # JAX has no symbolic zeros there: every input counts as differentiated
        routed.defvjp(lambda *args: routed_fwd(*jax.tree.map(lambda v: CustomVJPPrimal(v, True), args)), routed_bwd)
    else:
        routed.defvjp(routed_fwd, routed_bwd, symbolic_zeros=True)
    return routed(experts, x, slots)


def _native_train_forward(impl, names, values, act, block_rows, perturbed) -> tuple:
    """(out, (values, residual)) by `native.routed_train_forward` where the native forward runs: always for
    `impl="native"`, else in a program lowered for the CPU, the other candidates' forward (and an unused zero
    residual) elsewhere. NotImplementedError where the native backward would not serve the call."""
    train = lambda: native.routed_train_forward(*values, act, perturbed)
    if names == ["native"]:
        out, residual = train()
    else:
        zeros = jax.eval_shape(train)[1]
        others = lambda: (_dispatch(impl, names, *values, act, block_rows), jax.numpy.zeros(zeros.shape, zeros.dtype))
        out, residual = native.on_cpu_tree(train, others)
    return out, (values, residual)


def _in_shard_map() -> bool:
    """Whether this is traced inside a `shard_map` (some mesh axis of the context is Manual)."""
    return any(t == jax.sharding.AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types)


def _dispatch(impl, names, experts, x, slots, act, block_rows) -> Array:
    def run(name, experts, x, slots):
        return BACKENDS[name].run(experts, x, slots, act, block_rows=block_rows)

    if len(names) == 1:
        return run(names[0], experts, x, slots)
    reasons = []
    for i, name in enumerate(names):
        try:
            chooser = BACKENDS[name].chooser
            if impl != "auto" or chooser is None:
                return run(name, experts, x, slots)
            # It serves this call: it, or the rest of the list, is chosen while lowering.
            jax.eval_shape(functools.partial(run, name), experts, x, slots)
            fallback = lambda e, x, s, i=i: _dispatch(impl, names[i + 1 :], e, x, s, act, block_rows)
            return chooser(functools.partial(run, name), fallback, experts, x, slots)
        except NotImplementedError as err:
            reasons.append(f"{name}: {err}")
    raise NotImplementedError(f"impl={impl!r}: no implementation serves this call ({'; '.join(reasons)})")


def resolve_impl(impl: str, experts: Experts, x: Array, slots: Slots, act: GatedActivation) -> str:
    """The backend `impl` would run for this call (traced abstractly, nothing computed; for tests and benchmarks)."""
    for name in _names(impl, experts, slots):
        try:
            run = functools.partial(BACKENDS[name].run, act=act)
            jax.eval_shape(run, experts, x, slots)
        except NotImplementedError:
            continue
        return name
    raise NotImplementedError(f"impl={impl!r}: no implementation serves this call")
