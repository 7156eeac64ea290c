"""`interpret=None`: run a kernel compiled or interpreted according to the platform it is *lowered* for.

A Mosaic GPU kernel runs compiled on a GPU and, for tests, under the Mosaic GPU interpreter on a CPU; which one
follows the platform the program is lowered for, not the host that traces it (a CPU-only host can lower for
CUDA: ahead-of-time compilation, `jax.export`). The op is staged out as one primitive, `kernel_by_platform`,
with a lowering rule per platform: "cuda" lowers `op(..., interpret=False)`, "cpu" `op(..., interpret=True)`
under a lock (the interpreter simulates one GPU per process: two interpreted kernels with no data dependency in
one CPU program are an error; `interpret=True` orders them), "tpu" the op's registered Mosaic TPU variant
(`register_tpu_variant`). `choose_at_lowering` is the same idea for a choice between whole implementations
(moejax's `impl="auto"`), made from the lowering platform and the device kinds of the program's devices.
After a failed interpretation call `reset_interpreter()`. Only inference: no JVP or batching rule for the kernels.
(Why a primitive and not `jax.lax.platform_dependent`: docs/DESIGN.md.)
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import dispatch
from jax.experimental import io_callback
from jax.extend import core as jex_core
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import batching, mlir

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _OpCall:
    """One call of `op` with its array arguments taken out: what the primitive carries as a (hashable) param."""

    op: Callable[..., Array]
    treedef: Any  # of (args, kwargs)
    is_array: tuple[bool, ...]  # per leaf of treedef
    static: tuple[Any, ...]  # the non-array leaves (None where an array goes)

    def __repr__(self) -> str:  # what a printed jaxpr shows: kernel_by_platform[call=moe_decode]
        return self.op.__name__

    def __call__(self, *arrays: Array, interpret: bool) -> list[Array]:
        args, kwargs = self._unflatten(arrays)
        return jax.tree.leaves(self.op(*args, **kwargs, interpret=interpret))

    def tpu(self, *arrays: Array, device_kind: str | None) -> Array:
        args, kwargs = self._unflatten(arrays)
        kwargs.pop("block_sizes", None)  # the GPU op's blocks; the TPU op picks its own per TPU generation
        return jax.tree.leaves(_TPU_VARIANTS[self.op](*args, **kwargs, device_kind=device_kind, interpret=False))

    def compiled(self, *arrays: Array) -> Any:
        """The op's output (a pytree), compiled variant."""
        args, kwargs = self._unflatten(arrays)
        return self.op(*args, **kwargs, interpret=False)

    def _unflatten(self, arrays):
        it = iter(arrays)
        leaves = [next(it) if a else s for a, s in zip(self.is_array, self.static, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)


kernel_by_platform_p = jex_core.Primitive("kernel_by_platform")
kernel_by_platform_p.multiple_results = True  # the leaves of the op's output (one array, or a tuple of them)


@functools.lru_cache(maxsize=1024)
def _output_type(call: _OpCall, avals: tuple[Any, ...]) -> tuple[Any, list]:
    """`(pytree structure, leaves' avals)` of the op's output: the compiled variant (it traces on any host; the
    interpreted one gives the same type), traced from the input avals themselves so that it keeps what they carry
    (inside shard_map: the manual axes the output varies over). Traced once for the wrapper and the primitive."""
    closed, shape = jax.make_jaxpr(call.compiled, return_shape=True)(*avals)
    return jax.tree.structure(shape), closed.out_avals


def _abstract_eval(*avals, call: _OpCall):
    return _output_type(call, avals)[1]


kernel_by_platform_p.def_abstract_eval(_abstract_eval)


@functools.cache
def _jitted(call: _OpCall) -> Callable[..., Array]:
    return jax.jit(functools.partial(kernel_by_platform_p.bind, call=call))


kernel_by_platform_p.def_impl(lambda *arrays, call: _jitted(call)(*arrays))


def _lower_compiled(ctx: mlir.LoweringRuleContext, *args, call: _OpCall):
    return mlir.lower_fun(functools.partial(call, interpret=False), multiple_results=True)(ctx, *args)


def interpret_params(interpret: bool) -> Any:
    """What `plgpu.kernel(interpret=...)` needs: None compiled, the GPU interpreter's parameters interpreted.

    Mosaic GPU kernels with TMA copies and wgmma run on CPU only under the GPU interpreter, whose parameter
    class is private in jax 0.10: this module is the one place that imports the interpreter.
    """
    if not interpret:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as err:  # a JAX without the Mosaic GPU interpreter
        raise NotImplementedError(f"Mosaic GPU interpret mode is not available in jax {jax.__version__}") from err
    return InterpretGPUParams()


def reset_interpreter() -> None:
    """Make the interpreter usable again after an interpreted kernel failed (or overlapped another): the failed
    run leaves the simulated GPU's state, and the lock, behind (JAX's `reset_gpu_interpret_mode_state`)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()
    if _INTERPRETER_LOCK.locked():
        _INTERPRETER_LOCK.release()


_INTERPRETER_LOCK = threading.Lock()
_TOKEN = jax.ShapeDtypeStruct((), np.int32)


def _enter(token):
    # Never wait here (module docstring): a blocked callback holds an XLA:CPU worker thread.
    if not _INTERPRETER_LOCK.acquire(blocking=False):
        raise RuntimeError(
            "pallas_kernels: two Mosaic GPU kernels were interpreted at once (kernels with no data dependency "
            "between them in one CPU program: pass interpret=True to order them), or an interpreted kernel failed "
            "earlier in this process; call pallas_kernels.platform.reset_interpreter() before interpreting again"
        )
    return token


def _exit(token):
    _INTERPRETER_LOCK.release()
    return token


def _interpreted(call: _OpCall, *arrays: Array) -> Array:
    """`call` under the interpreter, between two ordered host callbacks that take and release the lock (the
    interpreter's own ordered host callbacks run between them, on the same token chain)."""
    token = io_callback(_enter, _TOKEN, np.int32(0), ordered=True)
    out = call(*arrays, interpret=True)
    io_callback(_exit, _TOKEN, token, ordered=True)
    return out


def _lower_interpreted(ctx: mlir.LoweringRuleContext, *args, call: _OpCall):
    closed = jax.make_jaxpr(functools.partial(_interpreted, call))(*ctx.avals_in)
    # A fresh token for each effect of the interpreter (ordered host callbacks): the kernel's callbacks are
    # chained from it, and the primitive itself has no effect for the enclosing program to thread.
    tokens = mlir.TokenSet({effect: hlo.create_token() for effect in closed.effects})
    consts = [mlir.ir_constant(c) for c in closed.consts]
    outs, _ = mlir.jaxpr_subcomp(
        ctx.module_context,
        closed.jaxpr,
        ctx.name_stack,
        tokens,
        consts,
        *args,
        dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering,
        outer_traceback=None,
    )
    return outs


_TPU_VARIANTS: dict[Callable[..., Array], Callable[..., Array]] = {}


def register_tpu_variant(op: Callable[..., Array], tpu_op: Callable[..., Array]) -> None:
    """Lower `op` (an `interpret_by_platform` op) as `tpu_op(..., device_kind=..., interpret=False)` for TPU."""
    _TPU_VARIANTS[op.__wrapped__] = tpu_op


def _lower_tpu(ctx: mlir.LoweringRuleContext, *args, call: _OpCall):
    if call.op not in _TPU_VARIANTS:
        raise NotImplementedError(f"{call}: no Mosaic TPU kernel (lowering for TPU)")
    kinds = lowering_device_kinds(ctx.module_context.axis_context)
    device_kind = next(iter(kinds)) if kinds and len(kinds) == 1 else None
    tpu = functools.partial(call.tpu, device_kind=device_kind)
    return mlir.lower_fun(tpu, multiple_results=True)(ctx, *args)


mlir.register_lowering(kernel_by_platform_p, _lower_compiled, platform="cuda")
mlir.register_lowering(kernel_by_platform_p, _lower_interpreted, platform="cpu")
mlir.register_lowering(kernel_by_platform_p, _lower_tpu, platform="tpu")


def interpret_by_platform(op: Callable[..., Array]) -> Callable[..., Array]:
    """Decorate a kernel op `op(..., *, interpret: bool | None = None, ...) -> Array` (or a tuple of arrays, a
    NamedTuple: any pytree of arrays and None): with `interpret=None` the
    lowering platform decides (cuda: compiled, cpu: interpreted, tpu: the registered TPU variant); True/False are
    passed to `op` unchanged (the Mosaic GPU kernel)."""

    @functools.wraps(op)
    def wrapper(*args, interpret: bool | None = None, **kwargs) -> Array:
        if interpret is not None:
            return op(*args, interpret=bool(interpret), **kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_array = tuple(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)
        static = tuple(None if a else leaf for a, leaf in zip(is_array, leaves, strict=True))
        arrays = [leaf for a, leaf in zip(is_array, leaves, strict=True) if a]
        call = _OpCall(op, treedef, is_array, static)
        outs = kernel_by_platform_p.bind(*arrays, call=call)
        return jax.tree.unflatten(_output_type(call, tuple(jax.typeof(a) for a in arrays))[0], outs)

    return wrapper


# A choice between implementations, made while lowering. `choose(platform, device_kinds) -> index` gets the one
# lowering platform ("cpu", "cuda", "rocm", "tpu") and the device kinds of the program's devices (None where the
# program has none: `jax.export`); a program lowered for several platforms at once gets the last branch.

choose_at_lowering_p = jex_core.Primitive("choose_at_lowering")
# The same choice by the platform alone: it does not ask for the program's devices, so JAX does not require one
# mesh across the program (an Explicit mesh and its Auto view may meet in it).
choose_by_platform_p = jex_core.Primitive("choose_by_platform")


@dataclasses.dataclass(frozen=True, eq=False)
class _Choice:
    branches: tuple[Callable[..., Array], ...]
    choose: Callable[[str, frozenset[str] | None], int]
    by_platform: bool = False  # choose reads the platform only (choose_by_platform_p)

    @property
    def primitive(self) -> jex_core.Primitive:
        return choose_by_platform_p if self.by_platform else choose_at_lowering_p

    def __repr__(self) -> str:
        return "|".join(getattr(b, "__name__", "branch") for b in self.branches)


for _p in (choose_at_lowering_p, choose_by_platform_p):
    _p.multiple_results = True  # the leaves of the branches' output (one array, or a pytree of them)
    _p.def_abstract_eval(lambda *avals, choice: jax.make_jaxpr(choice.branches[0])(*avals).out_avals)
    _p.def_impl(lambda *arrays, choice: jax.jit(lambda *a: choice.primitive.bind(*a, choice=choice))(*arrays))


def lowering_device_kinds(axis_context: Any) -> frozenset[str] | None:
    """The device kinds of the devices a program is lowered for (a jit's device assignment, or the mesh of an
    enclosing `shard_map`); None where the lowering has no devices (`jax.export`, an abstract mesh)."""
    devices = getattr(axis_context, "device_assignment", None)
    if devices is None:
        mesh = getattr(axis_context, "mesh", None)
        try:
            devices = None if mesh is None else list(mesh.devices.flat)
        except (AttributeError, ValueError):  # an AbstractMesh has no devices
            devices = None
    return None if not devices else frozenset(d.device_kind for d in devices)


def _lower_choice(ctx: mlir.LoweringRuleContext, *args, choice: _Choice):
    platforms = tuple(ctx.module_context.platforms)
    index = len(choice.branches) - 1
    if len(platforms) == 1:
        kinds = None if choice.by_platform else lowering_device_kinds(ctx.module_context.axis_context)
        index = choice.choose(platforms[0], kinds)
    return mlir.lower_fun(choice.branches[index], multiple_results=True)(ctx, *args)


mlir.register_lowering(choose_at_lowering_p, _lower_choice)
mlir.register_lowering(choose_by_platform_p, _lower_choice)


def _batch_choice(args, dims, *, choice: _Choice):
    # One call per batch element, in a loop (`lax.map`), each still chosen while lowering: a branch may have no
    # batching rule of its own (`ragged_dot` under vmap is not implemented for every axis in jax 0.10).
    mapped = [i for i, d in enumerate(dims) if isinstance(d, int)]
    batched = [jax.numpy.moveaxis(args[i], dims[i], 0) for i in mapped]

    def one(elements):
        full = list(args)
        for i, element in zip(mapped, elements, strict=True):
            full[i] = element
        return choice.primitive.bind(*full, choice=choice)

    outs = jax.lax.map(one, batched)
    return outs, [0] * len(outs)


batching.primitive_batchers[choose_at_lowering_p] = _batch_choice
batching.primitive_batchers[choose_by_platform_p] = _batch_choice
# Without this, a jit's lowering context carries no devices (`ShardingContext.device_assignment` is None): JAX
# hands them to primitives that declare they need them (as its cuDNN primitives do for the GPU's compute
# capability). A private registry of jax 0.10 (jax._src.dispatch).
# A JAX without it: device kinds are unknown while lowering (auto then takes no kernel; TPU tiles by default VMEM).
getattr(dispatch, "prim_requires_devices_during_lowering", set()).update((choose_at_lowering_p, kernel_by_platform_p))


def choose_at_lowering(
    choose: Callable[[str, frozenset[str] | None], int],
    branches: tuple[Callable[..., Array], ...],
    *operands: Any,
    by_platform: bool = False,
) -> Array:
    """`branches[choose(platform, device_kinds)](*operands)`, decided when the program is lowered.

    Args:
      choose: `(lowering platform, device kinds or None) -> index into branches`.
      branches: functions of `operands` with the same output type (an array or a pytree of arrays); each must
        trace on any host, and none may carry effects (the lowering keeps one branch only). The first one also
        gives the output type, so put the cheapest to trace first.
      operands: pytrees of arrays.
      by_platform: `choose` reads the platform only (its device kinds are None): the program's devices are not
        asked for, so the program need not hold one mesh throughout.
    """
    leaves, treedef = jax.tree.flatten(operands)

    def unflat(fn):
        def branch(*leaves):
            return jax.tree.leaves(fn(*jax.tree.unflatten(treedef, leaves)))

        branch.__name__ = getattr(fn, "__name__", "branch")  # a printed jaxpr's choice=<name>|<name>
        return branch

    choice = _Choice(tuple(unflat(b) for b in branches), choose, by_platform)
    out_tree = jax.tree.structure(jax.eval_shape(branches[0], *operands))
    return jax.tree.unflatten(out_tree, choice.primitive.bind(*leaves, choice=choice))
