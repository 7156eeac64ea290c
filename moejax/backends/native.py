"""The "native" backend: moejax's routed experts as one XLA FFI call into C++ kernels (csrc/moe_cpu.cc).

One call per layer call, any T: the union of the chosen experts, each union expert's weights read once for all
of its rows, gate/up -> activation -> down -> the slot-weighted combine in slot order, on XLA's intra-op thread
pool. Weights are read as stored, in every format and both layouts: dense float32 / bfloat16 / float16
(`ExpertWeights` `[in, out]`, `FusedExpertWeights` `[out, in]`, the per-expert layout's storage on CPU),
int8 / int4 group-wise symmetric and asymmetric, FP8 e4m3 with 128x128 blocks, MXFP4 and NVFP4
(`moejax.quantized`). Weights are dequantized in registers; activations and accumulation are float32 (the
numerics of `moejax.backends.reference.reference_routed` on the dequantized weights, to float32 rounding).
The 4-bit formats with `Scheme.activations == "int8"` (an explicit option, never the default) run int8
activations against the 4-bit codes in integers (csrc/act8.h): `moejax.quantized.activations` defines the
results and states the error.

Batch invariance by construction: every output element is one fixed chain of operations over its row's
inputs and the weights (csrc/kernels.inc), so a row's bits do not depend on T, its position, its neighbours or
the number of threads.

LoRA: the experts wrapped with a stack's adapters (`moejax.lora.LoRAExperts` over any format above) run in the
same call (the FFI target `moejax_routed_experts_lora`, csrc/lora.h): each (row, expert) pair adds its own
adapter's deltas, `s · (x·Aᵀ)·Bᵀ` in float32, to gate and up before the activation and to down before the
combine; rows with adapter id 0 get the bits of the call without adapters, and a row's bits with its adapter do
not depend on T, its position or its neighbours (their adapters included).

Training: under `jax.grad` the forward is `routed_train_forward` (csrc/backward_cpu.cc), which also keeps each
routed (row, expert) pair's gate/up pre-activations, `T·K·2I` float32, for `routed_backward` (which then runs 6
matrix products per expert instead of 8). Its output equals the forward kernels' within float32 rounding (another
summation order; the same batch and thread invariance). `save_residuals(False)` makes the backward recompute them
instead (less memory, the inference forward's output bits); `jax.checkpoint` around the layer recomputes the whole
forward as usual. With adapters (`LoRAExperts`) both take the stack too: the saved pre-activations include the gate
and up deltas, and the backward gives each adapter's A, B and scale gradients over the pairs whose row uses it
(csrc/backward_kernels.inc), besides the input gradient through the deltas.

The extension is optional (setup.py); `available()` says whether it is built, loaded and enabled.
`enable(False)` hides it (then `impl="auto"` runs the XLA plans) for the programs traced afterwards, without
emptying JAX's caches; MOEJAX_NATIVE=0 in the environment makes off the default.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.lora import LoRAExperts, LoRAPair, clamp_ids
from moejax.quantized import QuantizedExperts
from moejax.slots import Slots
from moejax.weights import ExpertFormat, ExpertWeights, FusedExpertWeights, PerExpert
from pallas_kernels.activations import GatedActivation

Array = jax.Array
TARGET = "moejax_routed_experts"
LORA_TARGET = "moejax_routed_experts_lora"
BACKWARD_TARGET = "moejax_routed_experts_backward"
TRAIN_TARGET = "moejax_routed_experts_train_forward"
_DENSE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}
_FUSED = 3  # + the dense dtype's index
_QUANTIZED = {("int", 8): 6, ("int", 4): 7, ("fp8_block", 8): 8, ("mxfp4", 4): 9, ("nvfp4", 4): 10}
_ACT_KINDS = {"silu": 0, "gelu_tanh": 1, "gpt_oss": 2}
_REGISTERED: set[str] = set()
_SCALE_DTYPES = {"int": "float32", "fp8_block": "float32", "mxfp4": "uint8", "nvfp4": "float8_e4m3fn"}


# The switch (`enable`): True or False against the environment's default, None when it agrees with it. A JAX user
# context, so part of the key of every traced and compiled program (jit, the eager entry points' cached jit): a
# program traced under one setting is not reused under the other, and switching keeps every compiled program
# (switching back reuses them), where emptying JAX's caches would throw away all of the process's programs.
_SWITCH = jax.make_user_context(None)
# Whether a differentiated native forward keeps the pre-activations for the backward (`save_residuals`); a user
# context for the same reason as `_SWITCH`.
_SAVE_RESIDUALS = jax.make_user_context(None)  # None: saved (the default), False: recomputed


def _default() -> bool:
    """The environment's default: on unless MOEJAX_NATIVE=0."""
    return os.environ.get("MOEJAX_NATIVE", "1") != "0"


def enable(on: bool | None = True) -> None:
    """Use the native kernels where they are built (True), or hide them (False: `available()` is False, `impl="auto"`
    runs the XLA plans, `impl="native"` raises `NotImplementedError`); None: back to the environment's default
    (MOEJAX_NATIVE=0: off).

    The choice is made while tracing and is part of the key of JAX's caches of traced and compiled programs: calls
    after the switch, eager or jitted, follow it (a jitted function is traced again, once per setting). Programs
    compiled before stay cached, and are reused when the setting is switched back."""
    _SWITCH.set_global(None if on is None or bool(on) == _default() else bool(on))


def enabled() -> bool:
    """Whether the native kernels are switched on (`enable`), built or not."""
    choice = _SWITCH.value
    return _default() if choice is None else choice


@functools.cache
def save_residuals(on: bool = True) -> None:
    """Under `jax.grad`, keep each routed pair's gate/up pre-activations from the forward for the native backward
    (True, the default: `T·K·2I` float32 more memory until the backward, 6 matrix products per expert there), or
    recompute them in the backward (False: 8 products, no residual; the forward is then the inference kernels').
    Read while tracing, part of the key of JAX's caches (as `enable`). Choose it before the first differentiated
    call: with JAX 0.10.2, a jitted gradient called again after switching back and forth (both choices compiled in
    one process) was seen to run the last compiled choice (the same gradients; the output's bits and the cost
    are the other choice's)."""
    _SAVE_RESIDUALS.set_global(None if on else False)


def saves_residuals() -> bool:
    """Whether a differentiated native forward keeps the pre-activations (`save_residuals`)."""
    return _SAVE_RESIDUALS.value is None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the process's next allocations, instead of handing it back to the
    kernel: XLA's CPU runtime takes every call's buffers from malloc, so a training step's fresh outputs (the
    experts' gradients: 2.4 GB float32 for Qwen3-30B-A3B's layer) would fault in page by page again on every step.
    Buffers up to 32 MiB (glibc's bound) then come from malloc's arenas, and up to 2 GiB of free memory at an
    arena's top stays mapped. Process-wide: the resident memory stays near its peak. Returns whether it applied
    (glibc); changes no value."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # malloc.h
    options = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 2**31 - 1), (m_top_pad, 1 << 30))
    return all([bool(mallopt(option, value)) for option, value in options])


@functools.cache
def _load():
    """The extension with its FFI targets registered, or None where it is not built."""
    try:
        module = importlib.import_module("moejax._native_cpu")
    except ImportError:
        return None
    for name, capsule in module.registrations().items():
        if name not in _REGISTERED:  # once per process (the cache may be cleared)
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            _REGISTERED.add(name)
    return module


def _module():
    """The loaded extension, or None (not built, or switched off: `enable`)."""
    return _load() if enabled() else None


def available() -> bool:
    """Whether the native kernels are built and loaded. Where they run is decided while lowering (`on_cpu`)."""
    return _module() is not None


def retained_buffer_bytes() -> int:
    """The bytes of intermediate buffers the kernels keep between calls (0 when not available). Each set of a
    call's buffers (one per concurrent caller) is kept for the next call up to a bound (16 MiB: decode and small
    batches); a larger one, a prefill's, is freed when its call returns."""
    module = _module()
    return 0 if module is None else module.call_buffers()["retained_bytes"]


def on_cpu(run, fallback, *operands) -> Array:
    """`run(*operands)` in a program lowered for the CPU, `fallback(*operands)` elsewhere (a GPU or TPU program,
    also one compiled on a CPU host for a compile-only topology): decided while lowering, never by the host's
    default backend. By the lowering platform alone (`jax.lax.platform_dependent`, pruned while lowering), as
    `native_ops`'s ops: `choose_at_lowering` asks for the program's devices, which makes JAX require one mesh
    across the program, and the routed experts run in programs that mix meshes (a data-parallel input beside an
    EP forward, tests/test_lora_safety.py)."""
    return jax.lax.platform_dependent(*operands, cpu=run, default=fallback)


def on_cpu_tree(run: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    """`run()` in a program lowered for the CPU, else `fallback()` (as `on_cpu`), for two functions of no operands
    that return one pytree structure; its float0 leaves (constants) are taken as zeros."""
    shapes, tree = jax.tree.flatten(jax.eval_shape(run))
    is_zero = [jnp.dtype(s.dtype) == jax.dtypes.float0 for s in shapes]

    def arrays(fn: Callable[[], Any]) -> list[Array]:
        leaves, got = jax.tree.flatten(fn())
        if got != tree:
            raise ValueError(f"native: the two branches return different structures {got} and {tree}")
        return [leaf for leaf, zero in zip(leaves, is_zero, strict=True) if not zero]

    chosen = iter(jax.lax.platform_dependent(cpu=lambda: arrays(run), default=lambda: arrays(fallback)))
    leaves = [np.zeros(s.shape, s.dtype) if zero else next(chosen) for s, zero in zip(shapes, is_zero, strict=True)]
    return jax.tree.unflatten(tree, leaves)


def isa() -> str | None:
    """The instruction set of the kernels in use ('avx512', 'avx2', 'generic'), None when not available."""
    module = _module()
    return None if module is None else module.isa()


def routed_experts(
    experts: PerExpert | ExpertFormat, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None, max_threads=0
) -> Array:
    """`Σ_k out_weight[t, k] · E_{indices[t, k]}(in_scale · x[t])` `[T, H]` float32 by the native kernels.

    Args:
      experts: routed experts in either layout, any format in the module docstring, or those wrapped with a
        stack's adapters (`moejax.lora.adapt`; the rows' ids in `slots.adapter`, ids outside the stack: none).
      x: `[T, H]` float32, bfloat16 or float16 (converted to float32 first).
      slots: `Slots`; ids outside [0, E) and slots of weight 0 are skipped (contribute exactly 0).
      act: the gated activation.
      block_rows: ignored (the kernels take each union expert's rows at once).
      max_threads: at most this many threads (the caller's included); 0: the whole intra-op pool.

    Raises:
      NotImplementedError: not built, or a format (or wrapper of one) the kernels do not read.
      ValueError: shapes or dtypes of x, the slots or the weights that do not fit together.
    """
    del block_rows
    if not available():
        raise NotImplementedError("the native CPU kernels are not built or not loaded (moejax._native_cpu)")
    T, H = _check_rows(x, slots)
    lora = experts if isinstance(experts, LoRAExperts) else None
    spec = _weight_spec(experts if lora is None else lora.base, H)
    E, I = spec["E"], spec["I"]
    adapters = () if lora is None else _lora_operands(lora, slots, E, H, I)
    target = TARGET if lora is None else LORA_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((T, H), jnp.float32), vmap_method="sequential")
    return call(
        x.astype(jnp.float32),
        *_slot_operands(slots, spec),
        *adapters,
        *spec["buffers"],
        **_attributes(spec, E, I, act, max_threads),
        act_group=np.int64(spec["act_group"]),
    )


def _attributes(spec: dict, E: int, I: int, act: GatedActivation, max_threads: int) -> dict:
    """The FFI attributes the forward and the backward calls share: the weights' format and the activation."""
    return {
        "fmt": np.int64(spec["fmt"]),
        "num_experts": np.int64(E),
        "intermediate": np.int64(I),
        "group": np.int64(spec["group"]),
        "fields_per_proj": np.int64(spec["fields_per_proj"]),
        "per_expert": np.int64(spec["per_expert"]),
        "act_kind": np.int64(_ACT_KINDS[act.kind]),
        "has_limit": np.int64(act.limit is not None),
        "limit": np.float32(0.0 if act.limit is None else act.limit),
        "alpha": np.float32(act.alpha),
        "clamp_after": np.int64(act.clamp_order == "after_activation"),
        "max_threads": np.int64(max_threads),
    }


def _check_rows(x: Array, slots: Slots) -> tuple[int, int]:
    """(T, H); `ValueError` naming the field when x and the slots do not fit."""
    if x.ndim != 2:
        raise ValueError(f"native: x must be [T, H], got {x.shape=}")
    if jnp.dtype(x.dtype) not in _DENSE:
        raise ValueError(f"native: x must be float32, bfloat16 or float16, got {x.dtype=}")
    T, H = x.shape
    idx = slots.indices
    if idx.ndim != 2 or idx.shape[0] != T:
        raise ValueError(f"native: slots.indices must be [T, K] with T={T}, got {idx.shape=}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"native: slots.indices must be integer expert ids, got {idx.dtype=}")
    for name in ("out_weight", "in_scale"):
        value = getattr(slots, name)
        if value is None and name == "in_scale":
            continue
        if tuple(value.shape) != tuple(idx.shape):
            raise ValueError(f"native: slots.{name} must be [T, K]={tuple(idx.shape)}, got {value.shape}")
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"native: slots.{name} must be float, got {value.dtype}")
    return T, H


def _lora_operands(lora: LoRAExperts, slots: Slots, E: int, H: int, I: int) -> list[Array]:
    """The LoRA call's operands after the slots: the rows' ids `[T]` int32 (clamped into the stack), then A, B,
    scale of gate, up and down (float32; three empty arrays for a target without adapters)."""
    ids = lora.row_ids(slots)
    targets = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    pairs = {name: getattr(lora.lora, name) for name in targets}
    num_ids = {p.scale.shape[0] for p in pairs.values() if p is not None and jnp.ndim(p.scale) == 1}
    if len(num_ids) > 1:
        raise ValueError(f"native: the expert targets of lora hold different numbers of adapter ids {num_ids}")
    n = num_ids.pop() if num_ids else 1
    out = [clamp_ids(ids, n)]
    empty = jnp.zeros((0,), jnp.float32)
    for name, (n_in, n_out) in targets.items():
        pair = pairs[name]
        if pair is None:
            out += [empty, empty, empty]
            continue
        _check_pair(name, pair, n, E, n_in, n_out)
        out += [pair.a.astype(jnp.float32), pair.b.astype(jnp.float32), pair.scale.astype(jnp.float32)]
    return out


def _check_pair(name: str, pair: LoRAPair, n: int, E: int, n_in: int, n_out: int) -> None:
    """`ValueError` naming the target when its stacked arrays do not fit `[n, E, r, in]`, `[n, E, out, r]`, `[n]`."""
    r = pair.a.shape[-2] if pair.a.ndim == 4 else None
    want = ((n, E, r, n_in), (n, E, n_out, r), (n,))
    got = (tuple(pair.a.shape), tuple(pair.b.shape), tuple(jnp.shape(pair.scale)))
    if r is None or r < 1 or got != want:
        raise ValueError(f"native: lora.{name} must be a stack A {want[0]}, B {want[1]}, scale {want[2]}, got {got}")


def _weight_spec(experts: PerExpert | ExpertFormat, H: int) -> dict:
    """What the FFI call needs of the weights: format code, buffers (field-major), group, biases, scale2."""
    per_expert = isinstance(experts, PerExpert)
    parts = experts.parts if per_expert else (experts,)
    one = parts[0]
    kind = type(one)
    if any(type(p) is not kind for p in parts):
        raise ValueError("native: the per-expert parts must all have one format")
    E = len(parts) if per_expert else experts.num_experts
    lead = () if per_expert else (E,)
    if isinstance(one, FusedExpertWeights):
        I = one.down_weight.shape[-1]
        names = ["gate_up_weight", "down_weight"]
        shapes = {"gate_up_weight": (2 * I, H), "down_weight": (H, I)}
        fmt, fields_per_proj, group, act_group = _FUSED + _dense_code(one, names), 0, 0, 0
        bias_names = ("gate_up_bias", None, "down_bias")
    elif isinstance(one, ExpertWeights):
        I = one.gate.shape[-1]
        names = ["gate", "up", "down"]
        shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
        fmt, fields_per_proj, group, act_group = _dense_code(one, names), 0, 0, 0
        bias_names = ("gate_bias", "up_bias", "down_bias")
    elif isinstance(one, QuantizedExperts):
        scheme = one.scheme
        key = (scheme.kind, scheme.bits)
        if key not in _QUANTIZED:
            raise NotImplementedError(f"native: quantized scheme {scheme.name} is not supported")
        I = one.gate_q.shape[-1]
        fields = ["q", "scale"] + ([] if scheme.symmetric else ["zero"])
        names = [f"{p}_{f}" for p in ("gate", "up", "down") for f in fields]
        shapes = _quantized_shapes(scheme, H, I, fields)
        fmt, fields_per_proj = _QUANTIZED[key], len(fields)
        group = (scheme.group_size or 0) if scheme.kind == "int" else 0
        _check_quantized_dtypes(one, scheme, names)
        act_group = scheme.activation_group if scheme.activations == "int8" else 0
        bias_names = ("gate_bias", "up_bias", "down_bias")
    else:
        raise NotImplementedError(f"native: format {kind.__name__} is not supported")
    for part in parts:
        for name in names:
            value = getattr(part, name)
            if value is None or tuple(value.shape) != lead + shapes[name]:
                got = None if value is None else tuple(value.shape)
                raise ValueError(f"native: experts.{name} must be {lead + shapes[name]} for H={H}, I={I}, got {got}")
    buffers = [getattr(p, name) for name in names for p in parts]
    return {
        "E": E,
        "I": I,
        "fmt": fmt,
        "group": group,
        "fields_per_proj": fields_per_proj,
        "per_expert": per_expert,
        "act_group": act_group,
        "buffers": buffers,
        "biases": _biases(parts, bias_names, per_expert, E, H, I),
        "scale2": _scale2(parts, per_expert) if fmt == _QUANTIZED[("nvfp4", 4)] else None,
    }


def _dense_code(one: ExpertFormat, names: list[str]) -> int:
    dtypes = {jnp.dtype(getattr(one, n).dtype) for n in names}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DENSE:
        raise ValueError(f"native: dense weights {names} must share one of float32/bfloat16/float16, got {dtypes}")
    return _DENSE[dtypes.pop()]


def _quantized_shapes(scheme, H: int, I: int, fields: list[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for p, (n_in, n_out) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
        scheme.check_dims(n_in, f"experts.{p}")
        rows = n_in // 2 if scheme.packed else n_in
        if scheme.kind == "fp8_block":
            grid = (-(-n_in // 128), -(-n_out // 128))
        else:
            grid = (n_in // scheme.group(n_in), n_out)
        shapes[f"{p}_q"] = (rows, n_out)
        shapes[f"{p}_scale"] = grid
        if "zero" in fields:
            shapes[f"{p}_zero"] = grid
    return shapes


def _check_quantized_dtypes(one: QuantizedExperts, scheme, names: list[str]) -> None:
    want = {
        "q": "float8_e4m3fn" if scheme.kind == "fp8_block" else "uint8",
        "scale": _SCALE_DTYPES[scheme.kind],
        "zero": "int8",
    }
    for name in names:
        field = name.split("_", 1)[1]
        got = jnp.dtype(getattr(one, name).dtype)
        if got != jnp.dtype(want[field]):
            raise ValueError(f"native: experts.{name} must be {want[field]}, got {got}")


def _stack(parts, name: str, per_expert: bool) -> Array:
    arrays = [getattr(p, name).astype(jnp.float32) for p in parts]
    return jnp.stack(arrays) if per_expert else arrays[0]


def _biases(parts, names, per_expert: bool, E: int, H: int, I: int) -> tuple[Array | None, Array | None]:
    """(gate|up bias `[E, 2I]`, down bias `[E, H]`) float32, or (None, None)."""
    gate_name, up_name, down_name = names
    if getattr(parts[0], gate_name) is None:
        return None, None
    gate_up = _stack(parts, gate_name, per_expert)
    if up_name is not None:
        gate_up = jnp.concatenate([gate_up, _stack(parts, up_name, per_expert)], axis=-1)
    down = _stack(parts, down_name, per_expert)
    if gate_up.shape != (E, 2 * I) or down.shape != (E, H):
        raise ValueError(f"native: biases must be [E, 2I]=({E}, {2 * I}) and [E, H]=({E}, {H})")
    return gate_up, down


def _scale2(parts, per_expert: bool) -> Array:
    """NVFP4's per-tensor multipliers `[3, E]` (gate, up, down) float32."""
    return jnp.stack([_stack(parts, f"{p}_scale2", per_expert).reshape(-1) for p in ("gate", "up", "down")])


def _trainable_spec(experts, x: Array, slots: Slots, perturbed: tuple) -> tuple[dict, bool, bool]:
    """The weight spec of the base experts the native backward reads, whether the base is differentiated, and
    whether the adapters are (experts wrapped with a stack's adapters: `LoRAExperts`; else False).

    Raises:
      NotImplementedError: not built, or experts the backward does not read (int8 activations, a differentiated
        quantized base).
    """
    if not available():
        raise NotImplementedError("the native CPU kernels are not built or not loaded (moejax._native_cpu)")
    _check_rows(x, slots)
    lora = isinstance(experts, LoRAExperts)
    spec = _weight_spec(experts.base if lora else experts, x.shape[1])
    flags = perturbed[0]
    want_base = any(jax.tree.leaves(flags.base if lora else flags))
    want_lora = lora and any(jax.tree.leaves(flags.lora))
    if spec["act_group"]:
        raise NotImplementedError("native backward: int8 activations")
    if spec["fmt"] >= _QUANTIZED[("int", 8)] and want_base:
        raise NotImplementedError("native backward: quantized experts are read frozen")
    return spec, want_base, want_lora


_NO_ADAPTERS = 10  # the adapter operands of a call without them: ids, then A, B, scale of gate, up and down


def _adapter_operands(experts, slots: Slots, spec: dict, H: int) -> list[Array]:
    """The adapter operands of the training forward and the backward (`_lora_operands`; empty without adapters)."""
    if not isinstance(experts, LoRAExperts):
        return [jnp.zeros((0,), jnp.int32)] + [jnp.zeros((0,), jnp.float32)] * (_NO_ADAPTERS - 1)
    return _lora_operands(experts, slots, spec["E"], H, spec["I"])


def _slot_operands(slots: Slots, spec: dict) -> list[Array]:
    """The operands every routed-experts call (forward, training forward, backward) passes after x (and the
    backward's g): the slots, the biases and NVFP4's multipliers."""
    empty = jnp.zeros((0,), jnp.float32)
    gu_bias, d_bias = spec["biases"]
    return [
        slots.indices.astype(jnp.int32),
        slots.out_weight.astype(jnp.float32),
        empty if slots.in_scale is None else slots.in_scale.astype(jnp.float32),
        empty if gu_bias is None else gu_bias,
        empty if d_bias is None else d_bias,
        empty if spec["scale2"] is None else spec["scale2"],
    ]


def routed_train_forward(
    experts: PerExpert | ExpertFormat,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    perturbed: tuple,
    *,
    max_threads: int = 0,
) -> tuple[Array, Array]:
    """`routed_experts` for a differentiated call: the routed sum `[T, H]` float32 (within float32 rounding of the
    forward kernels', the same batch and thread invariance) and the residual `routed_backward` reads, each routed
    pair's gate|up pre-activations `[T·K, 2I]` float32 (csrc/backward_cpu.cc).

    Raises:
      NotImplementedError: as `routed_backward`.
    """
    spec, _, _ = _trainable_spec(experts, x, slots, perturbed)
    (T, H), K, E, I = x.shape, slots.indices.shape[1], spec["E"], spec["I"]
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    call = jax.ffi.ffi_call(TRAIN_TARGET, [f32((T, H)), f32((T * K, 2 * I))], vmap_method="sequential")
    out, residual = call(
        x.astype(jnp.float32),
        *_slot_operands(slots, spec),
        *_adapter_operands(experts, slots, spec, H),
        *spec["buffers"],
        **_attributes(spec, E, I, act, max_threads),
    )
    return out, residual


def routed_backward(
    experts: PerExpert | ExpertFormat,
    x: Array,
    slots: Slots,
    act: GatedActivation,
    cotangent: Array,
    perturbed: tuple,
    *,
    residual: Array | None = None,
    max_threads: int = 0,
) -> tuple:
    """Cotangents of `(experts, x, slots)` of `routed_experts` by the native backward (csrc/backward_cpu.cc), in
    the structure of `moejax.backends.backward.routed_vjp` (same arguments).

    Dense float32 / bfloat16 / float16 experts in either layout: the input, slot-weight and input-scale gradients,
    and the weight and bias gradients when the experts are differentiated (float32 sums, then the weights' dtype).
    Quantized experts (float32 activations) with the base frozen: the input and slot gradients (QLoRA-style).
    Either wrapped with a stack's adapters (`LoRAExperts`): also the gradients of each adapter's A, B and scale
    when the adapters are differentiated (zeros for id 0 and for an (adapter, expert) no pair uses).
    Gradients are summed per expert by one thread in row order: the same bits run to run and at any thread count.
    residual: `routed_train_forward`'s of the same call, or None: the pre-activations are recomputed (the same
    bits either way).

    Raises:
      NotImplementedError: not built, or experts the backward does not read (int8 activations, a differentiated
        quantized base).
    """
    spec, want_base, want_lora = _trainable_spec(experts, x, slots, perturbed)
    _, p_x, p_slots = perturbed
    T, H = x.shape
    E, I = spec["E"], spec["I"]
    lora = experts if isinstance(experts, LoRAExperts) else None
    base = experts if lora is None else lora.base
    has_bias = spec["biases"][0] is not None
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    bias_shapes = ((E, 2 * I), (E, H)) if has_bias and want_base else ((0,), (0,))
    weight_shapes = [f32(b.shape) for b in spec["buffers"]] if want_base else []
    adapters = _adapter_operands(experts, slots, spec, H)
    adapter_shapes = [f32(a.shape if want_lora else (0,)) for a in adapters[1:]]
    K = slots.indices.shape[1]
    results = [f32((T, H)), f32((T, K)), f32((T, K) if slots.in_scale is not None else (0,))]
    results += [f32(s) for s in bias_shapes] + adapter_shapes + weight_shapes
    call = jax.ffi.ffi_call(BACKWARD_TARGET, results, vmap_method="sequential")
    d_x, d_out, d_scale, d_gu_bias, d_d_bias, *rest = call(
        x.astype(jnp.float32),
        cotangent.astype(jnp.float32),
        *_slot_operands(slots, spec),
        jnp.zeros((0,), jnp.float32) if residual is None else residual,
        *adapters,
        *spec["buffers"],
        **_attributes(spec, E, I, act, max_threads),
    )
    d_adapters, d_weights = rest[: len(adapter_shapes)], rest[len(adapter_shapes) :]
    if want_base:
        d_experts = _weight_cotangent(base, d_weights, (d_gu_bias, d_d_bias) if has_bias else None)
    else:
        d_experts = jax.tree.map(_zero_cotangent, base)
    if lora is not None:
        d_lora = _adapter_cotangent(lora.lora, d_adapters) if want_lora else jax.tree.map(_zero_cotangent, lora.lora)
        d_experts = LoRAExperts(d_experts, d_lora)
    d_slots = Slots(
        np.zeros(slots.indices.shape, jax.dtypes.float0),
        d_out.astype(slots.out_weight.dtype) if p_slots.out_weight else None,
        d_scale.astype(slots.in_scale.dtype) if slots.in_scale is not None and p_slots.in_scale else None,
        None if slots.adapter is None else np.zeros(slots.adapter.shape, jax.dtypes.float0),
    )
    return d_experts, d_x.astype(x.dtype) if p_x else None, d_slots


def _adapter_cotangent(lora, d_adapters: list[Array]):
    """The adapters' cotangent from the backward's float32 gradients (A, B, scale of gate, up and down; empty for
    an absent target), each in its primal's dtype and shape."""

    def pair(k: int, p: LoRAPair | None) -> LoRAPair | None:
        if p is None:
            return None
        d_a, d_b, d_s = d_adapters[3 * k : 3 * k + 3]
        cast = lambda d, primal: d.reshape(jnp.shape(primal)).astype(jnp.result_type(primal))
        return LoRAPair(cast(d_a, p.a), cast(d_b, p.b), cast(d_s, p.scale))

    targets = ("gate", "up", "down")
    return dataclasses.replace(lora, **{name: pair(k, getattr(lora, name)) for k, name in enumerate(targets)})


def _zero_cotangent(leaf: Array) -> Array | np.ndarray:
    """A leaf's zero cotangent: float0 for codes and other integers."""
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros(leaf.shape, leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def _weight_cotangent(experts, d_weights: list[Array], d_biases: tuple[Array, Array] | None):
    """The experts' cotangent from the backward's float32 weight gradients (`_weight_spec`'s buffer order: field
    major) and bias gradients (`[E, 2I]`, `[E, H]`), each in its primal's dtype."""
    per_expert = isinstance(experts, PerExpert)
    parts = experts.parts if per_expert else (experts,)
    fused = isinstance(parts[0], FusedExpertWeights)
    names = ["gate_up_weight", "down_weight"] if fused else ["gate", "up", "down"]
    n = len(parts)
    grads = {name: d_weights[i * n : (i + 1) * n] for i, name in enumerate(names)}

    def part_cotangent(j: int, part):
        fields = {name: grads[name][j].astype(getattr(part, name).dtype) for name in names}
        if d_biases is not None:
            d_gu, d_down = (b[j] if per_expert else b for b in d_biases)
            I = d_gu.shape[-1] // 2
            biases = {"down_bias": d_down}
            biases |= {"gate_up_bias": d_gu} if fused else {"gate_bias": d_gu[..., :I], "up_bias": d_gu[..., I:]}
            fields |= {k: v.astype(getattr(part, k).dtype) for k, v in biases.items()}
        return dataclasses.replace(part, **fields)

    cotangents = tuple(part_cotangent(j, p) for j, p in enumerate(parts))
    return PerExpert(cotangents, experts.fmt) if per_expert else cotangents[0]
