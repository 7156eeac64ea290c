"""What the four MoE ops share (decode and grouped, on Mosaic GPU and on Mosaic TPU): their arguments, checks and
plain-jnp reference.

An op is written as `op(p: MoEProblem, *, <its options>)` and decorated with `moe_op`, which gives it the public
signature `op(x, gate, up, down, indices, weights, in_scale=None, *, activation, gate_bias, up_bias, down_bias,
<its options>)` and checks the arguments once. `moe_reference(op)` is the op's reference: the same signature and
checks, then `dense_reference`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.activations import GatedActivation
from pallas_kernels.quantized_weights import COMPUTE_DTYPE, QuantizedWeight, check_quantized, dequantize_weight

Array = jax.Array
Weight = Array | QuantizedWeight  # a stacked projection [E, in, out], dense or quantized

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def require_activation(name: str, activation: object) -> None:
    """`TypeError` unless `activation` is a `GatedActivation` (which validated its fields when it was made)."""
    if not isinstance(activation, GatedActivation):
        raise TypeError(f"{name}: activation must be a pallas_kernels.GatedActivation, got {activation!r}")


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    """The routed experts' arguments of every MoE op: `Σ_k weights[t,k] · E_{indices[t,k]}(in_scale[t,k] · x[t])`.

    x: `[T, H]` rows (cast to the weight dtype for the matmuls).
    gate, up: `[E, H, I]`; down: `[E, I, H]`: all bf16, f16 or f32, or all `QuantizedWeight`s of one kind (x and
      h are then multiplied in bf16).
    indices: `[T, K]` int expert ids; ids outside [0, E) contribute nothing.
    weights: `[T, K]` output weight of each slot. in_scale: `[T, K]` input scale of each slot, or None.
    activation: the gated activation `h = act(gate, up)` (SwiGLU by default).
    gate_bias, up_bias: `[E, I]`, down_bias: `[E, H]`, all or none (gpt-oss): added in float32 to the gate/up
      accumulators before the activation and to the down output.
    """

    x: Array
    gate: Weight
    up: Weight
    down: Weight
    indices: Array
    weights: Array
    in_scale: Array | None = None
    _: dataclasses.KW_ONLY
    activation: GatedActivation = GatedActivation()  # noqa: RUF009 (frozen: an immutable default)
    gate_bias: Array | None = None
    up_bias: Array | None = None
    down_bias: Array | None = None

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """`(T, H, E, I, K)`."""
        T, H = self.x.shape
        E, _, I = self.gate.shape
        return T, H, E, I, self.indices.shape[1]

    @property
    def biases(self) -> tuple[Array | None, Array | None, Array | None]:
        return self.gate_bias, self.up_bias, self.down_bias

    def check(self, name: str) -> None:
        """`ValueError` naming `name`, the argument and both shapes; `TypeError` for a wrong activation."""
        x, gate, up, down, indices = self.x, self.gate, self.up, self.down, self.indices
        if x.ndim != 2 or gate.ndim != 3:
            raise ValueError(f"{name}: need x [T, H] and gate [E, H, I], got {x.shape=} {gate.shape=}")
        T, H = x.shape
        E, H2, I = gate.shape
        if H2 != H:
            raise ValueError(f"{name}: gate must be [E, H={H}, I], got {gate.shape=}")
        if up.shape != gate.shape or down.shape != (E, I, H):
            raise ValueError(f"{name}: need up {gate.shape} and down {(E, I, H)}, got {up.shape=} {down.shape=}")
        quantized = [isinstance(w, QuantizedWeight) for w in (gate, up, down)]
        if any(quantized):
            kinds = {getattr(w, "kind", None) for w in (gate, up, down)}
            if not all(quantized) or len(kinds) != 1:
                raise ValueError(
                    f"{name}: gate, up, down must be all dense or all QuantizedWeights of one kind: {kinds}"
                )
            for wname, w in (("gate", gate), ("up", up), ("down", down)):
                check_quantized(f"{name}: {wname}", w)
        elif not (gate.dtype == up.dtype == down.dtype) or gate.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name}: weights must share one of bf16/f16/f32, got {gate.dtype=} {up.dtype=} {down.dtype=}"
            )
        if indices.ndim != 2 or indices.shape[0] != T or not jnp.issubdtype(indices.dtype, jnp.integer):
            raise ValueError(f"{name}: indices must be integers [T={T}, K], got {indices.shape=} {indices.dtype=}")
        if self.weights.shape != indices.shape:
            raise ValueError(f"{name}: weights must have indices' shape {indices.shape}, got {self.weights.shape=}")
        if self.in_scale is not None and self.in_scale.shape != indices.shape:
            raise ValueError(f"{name}: in_scale must have indices' shape {indices.shape}, got {self.in_scale.shape=}")
        shapes = [None if b is None else tuple(b.shape) for b in self.biases]
        if shapes != [None] * 3 and shapes != [(E, I), (E, I), (E, H)]:
            raise ValueError(
                f"{name}: gate_bias, up_bias, down_bias must all be None or {(E, I)}, {(E, I)}, {(E, H)}, got {shapes}"
            )
        require_activation(name, self.activation)


_PROBLEM_PARAMETERS = tuple(inspect.signature(MoEProblem).parameters.values())
_PROBLEM_FIELDS = tuple(p.name for p in _PROBLEM_PARAMETERS)


def with_signature(signature: inspect.Signature, fn: Callable[..., Array], name: str, doc: str | None) -> Callable:
    """`fn(**arguments)` as a function of `signature`: it receives every argument by name, defaults applied."""

    def call(*args: Any, **kwargs: Any) -> Array:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return fn(**bound.arguments)

    call.__signature__ = signature
    call.__name__ = call.__qualname__ = name
    call.__doc__ = doc
    call.__module__ = getattr(fn, "__module__", __name__)
    return call


def _problem_call(name: str, impl: Callable[..., Array]) -> Callable[..., Array]:
    """`impl(problem, **options)` called with the public arguments: the problem's fields checked under `name`."""

    def call(**arguments: Any) -> Array:
        problem = MoEProblem(**{f: arguments.pop(f) for f in _PROBLEM_FIELDS})
        problem.check(name)
        return impl(problem, **arguments)

    return call


def moe_op(impl: Callable[..., Array]) -> Callable[..., Array]:
    """Decorate `impl(p: MoEProblem, *, <options>) -> Array` into the public op
    `impl.__name__(x, gate, up, down, indices, weights, in_scale=None, *, activation, gate_bias, up_bias, down_bias,
    <options>)` (the fields of `MoEProblem`, checked, then the options of `impl`)."""
    own = list(inspect.signature(impl).parameters.values())[1:]
    if any(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in own):
        raise TypeError(f"moe_op: {impl.__name__}'s options after the problem must be keyword-only")
    signature = inspect.Signature([*_PROBLEM_PARAMETERS, *own], return_annotation="Array")
    op = with_signature(signature, _problem_call(impl.__name__, impl), impl.__name__, impl.__doc__)
    op.__module__ = impl.__module__
    return op


def moe_reference(op: Callable[..., Array]) -> Callable[..., Array]:
    """`<op>_reference`: plain jnp with `op`'s signature and checks (`dense_reference`); the op's own options
    (block sizes, interpret, device kind) exist for signature parity and are not used."""
    name = f"{op.__name__}_reference"
    doc = f"Plain-jnp `{op.__name__}` (`dense_reference`: dense over experts); its options exist for signature parity."
    reference = with_signature(inspect.signature(op), _problem_call(name, lambda p, **_: dense_reference(p)), name, doc)
    reference.__module__ = op.__module__
    return reference


def combine_slots(per_slot: Array, indices: Array, weights: Array, num_experts: int) -> Array:
    """`Σ_k w[t, k] · y[t, k]` `[T, K, H] -> [T, H]` float32, in slot order; slots of ids outside
    [0, num_experts) or with weight 0 contribute exactly 0 (their y may be unwritten memory)."""
    real = (indices >= 0) & (indices < num_experts)
    w = jnp.where(real, weights.astype(jnp.float32), 0.0)[..., None]
    return jnp.where(w != 0, w * per_slot, 0.0).sum(1)


def compute_dtype(w: Weight):
    """The dtype the matmuls multiply in: the weights' own (dense), bf16 (quantized: dequantized to bf16)."""
    return COMPUTE_DTYPE if isinstance(w, QuantizedWeight) else w.dtype


def dense_reference(p: MoEProblem) -> Array:
    """`Σ_k w[t,k] · E_idx[t,k](s[t,k] · x[t])` float32 `[T, H]`, one expert at a time over all rows (a scan:
    memory O(T·I) at any E). Matmuls take the weight dtype and accumulate in float32, h is rounded to the weight
    dtype before the down projection, ids outside [0, E) contribute nothing. Quantized weights: each expert
    dequantized to float32 when the scan reaches it and rounded to bf16 (what the kernels feed the wgmma)."""
    require_activation("dense_reference", p.activation)
    E = p.gate.shape[0]
    dtype = compute_dtype(p.gate)

    def expert_weight(w: Weight, e: Array) -> Array:
        if not isinstance(w, QuantizedWeight):
            return w[e]
        one = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, e, 1, 0), w)
        return dequantize_weight(one)[0].astype(dtype)

    chosen = jax.nn.one_hot(p.indices, E, dtype=jnp.float32)  # [T, K, E]; out-of-range ids have no column
    out_w = jnp.einsum("tk,tke->et", p.weights.astype(jnp.float32), chosen)  # [E, T]
    scale = None if p.in_scale is None else jnp.einsum("tk,tke->et", p.in_scale.astype(jnp.float32), chosen)
    selected = chosen.sum(1).T > 0  # [E, T]
    x32 = p.x.astype(jnp.float32)

    def one_expert(acc: Array, e: Array) -> tuple[Array, None]:
        xe = x32 if scale is None else x32 * scale[e][:, None]
        xw = xe.astype(dtype)
        g = jnp.dot(xw, expert_weight(p.gate, e), preferred_element_type=jnp.float32)
        u = jnp.dot(xw, expert_weight(p.up, e), preferred_element_type=jnp.float32)
        if p.gate_bias is not None:
            g = g + p.gate_bias[e].astype(jnp.float32)
            u = u + p.up_bias[e].astype(jnp.float32)
        h = p.activation(g, u)
        y = jnp.dot(h.astype(dtype), expert_weight(p.down, e), preferred_element_type=jnp.float32)  # [T, H]
        if p.down_bias is not None:
            y = y + p.down_bias[e].astype(jnp.float32)
        return acc + jnp.where(selected[e][:, None], out_w[e][:, None] * y, 0.0), None

    out, _ = jax.lax.scan(one_expert, jnp.zeros(p.x.shape, jnp.float32), jnp.arange(E))
    return out


def signature_of(op: Callable[..., Array]) -> Callable[[Callable[..., Array]], Callable[..., Array]]:
    """Decorate `fn(**arguments)` (a reference) to take `op`'s signature: every argument by name, defaults
    applied, so that kernel and reference cannot drift apart."""
    return lambda fn: with_signature(inspect.signature(op), fn, fn.__name__, fn.__doc__)
