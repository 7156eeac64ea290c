"""Routed-expert weight storage: one owner for every format and layout of the routed experts' weights.

A **format** is a frozen dataclass registered as a pytree (subclass `ExpertFormat`) that declares its arrays once
(`declare(cfg)`: shape with the leading expert axis E, logical sharding axes, dtype, initialiser) and provides the
operations the plans need on **one expert** (the same class with the E axis dropped):

    g, u = w.gate_up(x)    # [R, H] -> two float32 [R, I]
    y = w.down_proj(h)     # float32 [R, I] -> float32 [R, H] (h rounded to the compute dtype first)
    dense = w.dequantize() # ExpertWeights in float32, with or without the E axis (the reference reads this)

The plans read any experts object (a format, `PerExpert`, a wrapper of either) through `num_experts`, `expert(e)`
(`ffn(rows, act, *ids)`, `padded_rows`, `dequantize()`), `stacked()`, `layout`, `padded_rows`, `row_ids(slots)`.

Everything else derives from the declaration, in this module: shape and dtype checks (`check_experts`), logical
axes (`logical_axes`), random init (`ExpertFormat.init`), flatten/unflatten (`expert_fields`, `from_fields`),
views of one expert (`expert(e)`, traced or static), and the two layouts:

* **stacked** (the canonical layout: checkpoints, GPU kernels, expert parallelism): each array `[E, ...]`.
* **per-expert** (`PerExpert`, the CPU layout): E one-expert instances in the format's `part_format()`, each
  array its own buffer (XLA:CPU copies a slice of a stacked array before its dot; docs/DESIGN.md). `to_layout`
  converts once, outside the forward; `init_params` and the loaders use `default_layout()`.

`ExpertWeights` is the dense format (float32 / bfloat16 / float16), `FusedExpertWeights` the same weights in
Hugging Face's fused layout. A new format is one new subclass, anywhere (tests/test_weight_formats.py defines an
int8 format in the test file itself).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from moejax.draws import as_array, divided, standard_normal
from pallas_kernels.activations import GatedActivation

Array = jax.Array
Layout = Literal["auto", "stacked", "per_expert"]
LAYOUTS = ("auto", "stacked", "per_expert")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
Initializer = Callable[[Array, tuple[int, ...], Any], Array]


def normal_fan_in(key: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    """`N(0, 1/fan_in)` with fan_in the second-to-last dimension (weights are stored `[in, out]`)."""
    return as_array(divided(standard_normal(key, shape), math.sqrt(shape[-2])), dtype)


def normal_fan_in_rows(key: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    """`N(0, 1/fan_in)` with fan_in the last dimension (weights stored `[out, in]`)."""
    return as_array(divided(standard_normal(key, shape), math.sqrt(shape[-1])), dtype)


def small_normal(key: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    """`N(0, 0.1²)`: biases that visibly change the output."""
    return as_array(0.1 * standard_normal(key, shape), dtype)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One array of a format, as stored with the leading expert axis.

    shape: `(E, ...)`. axes: logical sharding names, one per dimension (`expert`, `embed`, `mlp` or None).
    dtype: None for the float parameter dtype (float32, bfloat16 or float16, chosen at init or load time), else
      the one dtype the array must have (e.g. "int8", "float32" for scales).
    init: `init(key, shape, dtype)` for random parameters.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: str | None = None
    init: Initializer = normal_fan_in

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"ArraySpec: axes {self.axes} must name each dimension of shape {self.shape}")


class ExpertFormat:
    """Base class of routed-expert formats: `@jax.tree_util.register_dataclass` frozen dataclasses whose array
    fields all carry the leading expert axis (optional fields may be None). They implement `declare`, `gate_up`,
    `down_proj` and `dequantize`; the rest is derived here."""

    name: ClassVar[str] = "format"
    layout: ClassVar[str] = "stacked"

    # -- what a format implements ------------------------------------------------------------------------
    @classmethod
    def declare(cls, cfg) -> dict[str, ArraySpec]:
        """The arrays this format stores for `cfg` (a `MoEConfig`), by field name, in a fixed order."""
        raise NotImplementedError

    def gate_up(self, x: Array) -> tuple[Array, Array]:
        """One expert: `x [R, H]` -> gate and up projections, float32 `[R, I]` each, biases included."""
        raise NotImplementedError

    def down_proj(self, h: Array) -> Array:
        """One expert: float32 `h [R, I]` -> float32 `[R, H]`, bias included (h rounded to the compute dtype)."""
        raise NotImplementedError

    def dequantize(self) -> ExpertWeights:
        """The same weights as a float32 `ExpertWeights` (with or without the E axis, like `self`)."""
        raise NotImplementedError

    # -- the per-expert layout: override when one expert is stored differently there -----------------------
    @classmethod
    def part_format(cls) -> type[ExpertFormat]:
        """The format of one expert in the per-expert layout (default: this one, E axis dropped)."""
        return cls

    def to_part(self) -> ExpertFormat:
        """One expert (E axis dropped) converted to `part_format()`."""
        return self

    @classmethod
    def from_part(cls, part: ExpertFormat) -> ExpertFormat:
        """The inverse of `to_part`."""
        return part

    @property
    def padded_rows(self) -> int:
        """`ffn` runs 2..padded_rows rows padded to padded_rows (1: no padding); the CPU plans merge the row
        classes in that range."""
        return 1

    # -- derived -----------------------------------------------------------------------------------------
    def ffn(self, x: Array, act: GatedActivation) -> Array:
        """One expert's FFN on rows `x [R, H]` -> float32 `[R, H]` (`padded_ffn`)."""
        return padded_ffn(self, x, act)

    def stacked(self) -> ExpertFormat:
        """The stacked layout: this object."""
        return self

    def row_ids(self, slots) -> Array | None:
        """Per-row ids `[T]` these experts read beside the rows: None, a format reads the rows alone (a wrapper
        that adapts each row returns its ids; the plans then call `expert(e).ffn(rows, act, ids)`)."""
        del slots
        return None

    def fields(self) -> dict[str, Array]:
        """The arrays that are set, by field name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @property
    def num_experts(self) -> int:
        """E, the leading axis of the stacked layout."""
        return jnp.shape(next(iter(self.fields().values())))[0]

    def expert(self, e: Array | int) -> ExpertFormat:
        """Expert `e` (leading axis dropped); `e` may be traced. On XLA:CPU this copies the slice."""
        return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False), self)

    def unstack(self) -> PerExpert:
        """The per-expert layout: E one-expert instances, each array its own buffer."""
        one = lambda e: jax.tree.map(lambda w: w[e], self)
        return PerExpert(tuple(one(e).to_part() for e in range(self.num_experts)), type(self))

    @classmethod
    def init(cls, cfg, key: Array, dtype: Any = jnp.float32) -> ExpertFormat:
        """Random weights from the declaration (float arrays in `dtype`, others in their declared dtype)."""
        specs = cls.declare(cfg)
        keys = jax.random.split(key, len(specs))
        values = {
            name: spec.init(k, spec.shape, dtype if spec.dtype is None else spec.dtype)
            for k, (name, spec) in zip(keys, specs.items(), strict=True)
        }
        return cls(**values)


def padded_ffn(w: Any, x: Array, act: GatedActivation, *ids: Array) -> Array:
    """One expert's gated FFN `x [R, H]` -> float32 `[R, H]` by `w.gate_up(x, *ids)`, `w.down_proj(h, *ids)`
    (`ids`: per-row ids of a wrapper, none for a format). 2..`w.padded_rows` rows run padded (zeros, ids 0) to
    `w.padded_rows`: a row's bits then do not depend on how many rows run beside it."""
    R, P = x.shape[0], w.padded_rows
    if 1 < R < P:
        x = jnp.pad(x, ((0, P - R), (0, 0)))
        ids = tuple(jnp.pad(i, (0, P - R)) for i in ids)
    gate, up = w.gate_up(x, *ids)  # [P, I] float32 each
    return w.down_proj(act(gate, up), *ids)[:R]


def bias_specs(E: int, H: int, I: int) -> dict[str, ArraySpec]:
    """The optional expert biases of gate, up (`[E, I]`) and down (`[E, H]`), float parameters."""
    return {
        "gate_bias": ArraySpec((E, I), ("expert", "mlp"), init=small_normal),
        "up_bias": ArraySpec((E, I), ("expert", "mlp"), init=small_normal),
        "down_bias": ArraySpec((E, H), ("expert", "embed"), init=small_normal),
    }


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights(ExpertFormat):
    """Routed experts in dense format (float32 / bfloat16 / float16), weights `[in, out]`, gate and up apart."""

    name: ClassVar[str] = "dense"

    gate: Array  # [E, H, I]
    up: Array  # [E, H, I]
    down: Array  # [E, I, H]
    gate_bias: Array | None = None  # [E, I]
    up_bias: Array | None = None  # [E, I]
    down_bias: Array | None = None  # [E, H]

    @classmethod
    def declare(cls, cfg) -> dict[str, ArraySpec]:
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        specs = {
            "gate": ArraySpec((E, H, I), ("expert", "embed", "mlp")),
            "up": ArraySpec((E, H, I), ("expert", "embed", "mlp")),
            "down": ArraySpec((E, I, H), ("expert", "mlp", "embed")),
        }
        if cfg.expert_bias:
            specs |= bias_specs(E, H, I)
        return specs

    def gate_up(self, x: Array) -> tuple[Array, Array]:
        # The matmuls take the weight dtype and accumulate in float32, as a bf16 model does.
        xw = x.astype(self.gate.dtype)
        gate = jnp.dot(xw, self.gate, preferred_element_type=jnp.float32)  # [R, I]
        up = jnp.dot(xw, self.up, preferred_element_type=jnp.float32)  # [R, I]
        if self.gate_bias is not None:
            gate = gate + self.gate_bias.astype(jnp.float32)
            up = up + self.up_bias.astype(jnp.float32)
        return gate, up

    def down_proj(self, h: Array) -> Array:
        dtype = self.gate.dtype
        y = jnp.dot(h.astype(dtype), self.down, preferred_element_type=jnp.float32)  # [R, H]
        if self.down_bias is not None:
            y = y + self.down_bias.astype(jnp.float32)
        return y

    def dequantize(self) -> ExpertWeights:
        return jax.tree.map(lambda w: w.astype(jnp.float32), self)

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype of the matmuls (the weights' dtype)."""
        return self.gate.dtype

    @classmethod
    def part_format(cls) -> type[ExpertFormat]:
        return FusedExpertWeights  # XLA:CPU's fastest dense products (see FusedExpertWeights)

    def to_part(self) -> FusedExpertWeights:
        return FusedExpertWeights.from_dense(self)

    @classmethod
    def from_part(cls, part: ExpertFormat) -> ExpertWeights:
        return part.as_dense() if isinstance(part, FusedExpertWeights) else part


SMALL_ROWS = 8  # FusedExpertWeights (float32): 2..SMALL_ROWS rows run as one multiply-reduce on SMALL_ROWS rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedExpertWeights(ExpertFormat):
    """Dense routed experts in Hugging Face's fused layout: weights `[out, in]`, gate rows then up rows in one
    matrix (`gate_up_proj`), the per-expert layout's storage of `ExpertWeights` on CPU (XLA:CPU's fastest dense
    products: one row is its row-major GEMV). Float32 runs 2..SMALL_ROWS rows padded to SMALL_ROWS as one
    multiply-reduce (`padded_rows`: one row count keeps a row's bits independent of its neighbours); other
    dtypes and more rows are dots. Measurements in docs/DESIGN.md.
    """

    name: ClassVar[str] = "dense_fused"

    gate_up_weight: Array  # [E, 2I, H], gate rows first (torch Linear naming: weights are [out, in])
    down_weight: Array  # [E, H, I]
    gate_up_bias: Array | None = None  # [E, 2I]
    down_bias: Array | None = None  # [E, H]

    @classmethod
    def declare(cls, cfg) -> dict[str, ArraySpec]:
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        specs = {
            "gate_up_weight": ArraySpec((E, 2 * I, H), ("expert", "mlp", "embed"), init=normal_fan_in_rows),
            "down_weight": ArraySpec((E, H, I), ("expert", "embed", "mlp"), init=normal_fan_in_rows),
        }
        if cfg.expert_bias:
            specs |= {
                "gate_up_bias": ArraySpec((E, 2 * I), ("expert", "mlp"), init=small_normal),
                "down_bias": ArraySpec((E, H), ("expert", "embed"), init=small_normal),
            }
        return specs

    @property
    def dtype(self) -> jnp.dtype:
        return self.gate_up_weight.dtype

    @property
    def padded_rows(self) -> int:
        return SMALL_ROWS if self.dtype == jnp.float32 else 1

    def _product(self, v: Array, w: Array) -> Array:
        """`[R, in] x [out, in] -> [R, out]` float32."""
        if self.padded_rows > 1 and 1 < v.shape[0] <= SMALL_ROWS:
            return jnp.sum(w[:, None, :].astype(jnp.float32) * v[None].astype(jnp.float32), axis=2).T
        return jax.lax.dot_general(v, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def gate_up(self, x: Array) -> tuple[Array, Array]:
        gu = self._product(x.astype(self.dtype), self.gate_up_weight)  # [R, 2I]
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias.astype(jnp.float32)
        I = self.down_weight.shape[-1]
        return gu[:, :I], gu[:, I:]

    def down_proj(self, h: Array) -> Array:
        y = self._product(h.astype(self.dtype), self.down_weight)  # [R, H]
        if self.down_bias is not None:
            y = y + self.down_bias.astype(jnp.float32)
        return y

    def dequantize(self) -> ExpertWeights:
        return self.as_dense().dequantize()

    def as_dense(self) -> ExpertWeights:
        """The same weights as `ExpertWeights` (`[in, out]`, gate and up apart), dtype kept."""
        I = self.down_weight.shape[-1]
        t = lambda w: jnp.swapaxes(w, -1, -2)
        bias = self.gate_up_bias
        return ExpertWeights(
            gate=t(self.gate_up_weight[..., :I, :]),
            up=t(self.gate_up_weight[..., I:, :]),
            down=t(self.down_weight),
            gate_bias=None if bias is None else bias[..., :I],
            up_bias=None if bias is None else bias[..., I:],
            down_bias=self.down_bias,
        )

    @classmethod
    def from_dense(cls, dense: ExpertWeights) -> FusedExpertWeights:
        """`dense` in this layout, dtype kept (with or without the E axis)."""
        t = lambda w: jnp.swapaxes(w, -1, -2)
        has_bias = dense.gate_bias is not None
        return cls(
            gate_up_weight=jnp.concatenate([t(dense.gate), t(dense.up)], axis=-2),
            down_weight=t(dense.down),
            gate_up_bias=jnp.concatenate([dense.gate_bias, dense.up_bias], axis=-1) if has_bias else None,
            down_bias=dense.down_bias,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerExpert:
    """The per-expert layout of any format: `parts[e]` is expert e (no E axis), each array its own buffer, as
    XLA:CPU reads them in place. Convert with `to_layout` (or `ExpertFormat.unstack` / `PerExpert.stacked`)."""

    parts: tuple[ExpertFormat, ...]  # each in `fmt.part_format()`
    fmt: type[ExpertFormat] | None = dataclasses.field(default=None, metadata={"static": True})  # None: parts'
    layout: ClassVar[str] = "per_expert"

    @property
    def num_experts(self) -> int:
        return len(self.parts)

    def expert(self, e: int) -> ExpertFormat:
        """Expert `e` (static): its own buffers."""
        return self.parts[e]

    @property
    def padded_rows(self) -> int:
        return min(part.padded_rows for part in self.parts)

    row_ids = ExpertFormat.row_ids

    @property
    def format(self) -> type[ExpertFormat]:
        """The format of the stacked layout (what `stacked()` returns)."""
        return type(self.parts[0]) if self.fmt is None else self.fmt

    def stacked(self) -> ExpertFormat:
        """The stacked layout (a copy of every array)."""
        fmt = self.format
        return jax.tree.map(lambda *ws: jnp.stack(ws), *(fmt.from_part(p) for p in self.parts))

    def dequantize(self) -> ExpertWeights:
        return self.stacked().dequantize()


Experts = ExpertFormat | PerExpert


def format_of(experts: Experts) -> type[ExpertFormat]:
    """The format class of `experts` in either layout."""
    return experts.format if isinstance(experts, PerExpert) else type(experts)


def as_stacked(experts: Experts) -> ExpertFormat:
    """`experts` in the stacked layout (a copy when given per-expert)."""
    return experts.stacked()


def default_layout() -> Literal["stacked", "per_expert"]:
    """The layout the default backend reads fastest: per-expert on CPU, stacked elsewhere (GPU kernels)."""
    return "per_expert" if jax.default_backend() == "cpu" else "stacked"


def to_layout(experts: Experts, layout: Layout = "auto") -> Experts:
    """`experts` in `layout` ("auto": `default_layout()`); a no-op when already there. Call it outside `jit`:
    converting inside a jitted forward would copy every weight on every call."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if layout == "auto":
        layout = default_layout()
    if layout == "stacked":
        return as_stacked(experts)
    return experts if isinstance(experts, PerExpert) else experts.unstack()


def from_host(fields: Mapping[str, Any], fmt: type[ExpertFormat] = ExpertWeights, layout: Layout = "auto") -> Experts:
    """Experts of format `fmt` in `layout` from host arrays `{field: [E, ...]}` (e.g. read from a checkpoint),
    each expert's slice copied to the device on its own: no stacked copy on the device for the per-expert layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if (default_layout() if layout == "auto" else layout) == "stacked":
        return fmt(**{name: jnp.asarray(value) for name, value in fields.items()})
    num_experts = len(next(iter(fields.values())))
    one = lambda e: fmt(**{name: jnp.asarray(value[e]) for name, value in fields.items()})
    return PerExpert(tuple(one(e).to_part() for e in range(num_experts)), fmt)


def logical_axes(fmt: type[ExpertFormat], cfg, *, per_expert: bool = False) -> dict[str, tuple[str | None, ...]]:
    """Logical sharding axes of each array of `fmt` (per expert: of `fmt.part_format()`, without the expert axis)."""
    if per_expert:
        return {name: spec.axes[1:] for name, spec in fmt.part_format().declare(cfg).items()}
    return {name: spec.axes for name, spec in fmt.declare(cfg).items()}


def expert_fields(experts: Experts) -> dict[str, Array]:
    """Flat `{name: array}` of the routed experts: `gate`, ... (stacked) or `0.gate`, `1.gate`, ... (per-expert)."""
    if isinstance(experts, PerExpert):
        return {f"{e}.{name}": w for e, part in enumerate(experts.parts) for name, w in part.fields().items()}
    return experts.fields()


def from_fields(flat: Mapping[str, Array], fmt: type[ExpertFormat] = ExpertWeights) -> Experts:
    """The inverse of `expert_fields`: a stacked `fmt` or, for keys `"{e}.{name}"`, the per-expert layout."""
    if not any("." in name for name in flat):
        return fmt(**flat)
    parts: dict[int, dict[str, Array]] = {}
    for name, value in flat.items():
        e, _, field = name.partition(".")
        if not e.isdigit() or not field:
            raise ValueError(f"expert field {name!r}: expected '<field>' or '<expert>.<field>'")
        parts.setdefault(int(e), {})[field] = value
    if sorted(parts) != list(range(len(parts))):
        raise ValueError(f"per-expert fields must number experts 0..E-1, got {sorted(parts)}")
    part_format = fmt.part_format()
    return PerExpert(tuple(part_format(**parts[e]) for e in range(len(parts))), fmt)


def check_experts(experts: Any, cfg, where: str = "params.experts") -> None:
    """`TypeError`/`ValueError` naming the field, the expected and the actual shape or dtype.

    Shape and dtype only: safe on tracers (called by `moe_forward` at trace time).
    """
    if isinstance(experts, PerExpert):
        if len(experts.parts) != cfg.num_experts:
            raise ValueError(f"{where}: per-expert layout has {len(experts.parts)} experts, expected {cfg.num_experts}")
        fmt = experts.format.part_format()
        for e, part in enumerate(experts.parts):
            if type(part) is not fmt:
                raise TypeError(f"{where}.parts[{e}]: {type(part).__name__}, expected {fmt.__name__}")
            _check_arrays(part, fmt.declare(cfg), f"{where}.parts[{e}]", drop_expert_axis=True)
        return
    if not isinstance(experts, ExpertFormat):
        raise TypeError(f"{where} must be an ExpertFormat (e.g. moejax.ExpertWeights) or PerExpert, got {experts!r}")
    _check_arrays(experts, type(experts).declare(cfg), where, drop_expert_axis=False)


def _check_arrays(experts: ExpertFormat, specs: dict[str, ArraySpec], where: str, *, drop_expert_axis: bool) -> None:
    actual = experts.fields()
    missing = [name for name in specs if name not in actual]
    extra = [name for name in actual if name not in specs]
    if missing:
        raise ValueError(f"{where} missing {missing} (expected shapes {[specs[m].shape for m in missing]})")
    if extra:
        raise ValueError(f"{where} has {extra}, which this config does not use")
    for name, spec in specs.items():
        value = actual[name]
        shape = spec.shape[1:] if drop_expert_axis else spec.shape
        if tuple(jnp.shape(value)) != shape:
            raise ValueError(f"{where}.{name}: expected shape {shape}, got {tuple(jnp.shape(value))}")
        dtype = jnp.dtype(value.dtype)
        if spec.dtype is None:
            if dtype not in FLOAT_DTYPES:
                raise TypeError(
                    f"{where}.{name}: dtype {dtype} is not a dense float dtype (float32, bfloat16, float16); "
                    "quantized weights need a quantized format, not the dense one"
                )
        elif dtype != jnp.dtype(spec.dtype):
            raise TypeError(f"{where}.{name}: expected dtype {spec.dtype}, got {dtype}")
