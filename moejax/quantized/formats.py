"""The quantized routed-expert formats (weight-only): int8/int4 group-wise, FP8 e4m3 128x128 blocks, MXFP4, NVFP4.

One `Scheme` (data) per format; `quantized_format(kind, ...)` builds its `ExpertFormat` class (cached: one scheme,
one class, one pytree type). Weights stay packed; one expert's projection is dequantized (float32 scale math) inside
the computation that uses it. Arrays are `[in, out]` with groups along `in`, codes stored unsigned as on disk.
The layouts, the math and why `[in, out]`: docs/FORMATS.md ("In memory").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from moejax.quantized.activations import int8_activations
from moejax.weights import ArraySpec, ExpertFormat, ExpertWeights
from pallas_kernels.codecs import e2m1_to_f32, e8m0_to_f32, split_nibbles  # one decoder per code, the kernels' too

Array = jax.Array
Kind = Literal["int", "fp8_block", "mxfp4", "nvfp4"]
Activations = Literal["float32", "int8"]
PROJECTIONS = ("gate", "up", "down")
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
ACTIVATION_GROUP = 32  # int8 activations of per-channel int4 weights: inputs per activation scale
REDUCE_MAX_ROWS = 2  # up to this many rows: the fused multiply-reduce; more rows: dequantize once, then a dot


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A quantization scheme: what a format stores and how it dequantizes.

    kind: "int" (group-wise integers), "fp8_block" (e4m3, 128x128 block scales), "mxfp4" (e2m1, e8m0 scale per
      32), "nvfp4" (e2m1, e4m3 scale per 16, float32 per-tensor multiplier).
    bits: 8 or 4 (int only; 8 for FP8, 4 for the FP4 kinds).
    group_size: elements along `in` that share a scale (int: None = one group per output channel; fixed for the
      FP4 kinds; FP8 uses 128x128 blocks).
    symmetric: int only; False adds a zero point per group.
    activations: what the projections' inputs are multiplied as: "float32" (weight-only, the default) or "int8"
      (integer and 4-bit weights: each row's input to each projection quantized to int8 per group of
      `activation_group` inputs, `moejax.quantized.activations`; an explicit opt-in that changes the results).
    """

    kind: Kind
    bits: int
    group_size: int | None
    symmetric: bool = True
    activations: Activations = "float32"

    def __post_init__(self) -> None:
        if self.kind not in ("int", "fp8_block", "mxfp4", "nvfp4"):
            raise ValueError(f"kind={self.kind!r} is not one of 'int', 'fp8_block', 'mxfp4', 'nvfp4'")
        if self.kind == "int":
            if self.bits not in (4, 8):
                raise NotImplementedError(f"int formats take bits=4 or 8, got bits={self.bits}")
            if self.group_size is not None and (self.group_size <= 0 or self.group_size % 2):
                raise ValueError(f"group_size must be a positive even number or None, got {self.group_size}")
        elif not self.symmetric:
            raise ValueError(f"{self.kind} is symmetric (no zero point)")
        if self.activations not in ("float32", "int8"):
            raise ValueError(f"activations={self.activations!r} is not one of 'float32', 'int8'")
        if self.activations == "int8" and self.bits != 4 and self.kind != "int":
            raise NotImplementedError(
                f"activations='int8' is implemented for integer and 4-bit weights (int8, int4, mxfp4, nvfp4), "
                f"not {self.kind} with bits={self.bits}"
            )

    @property
    def name(self) -> str:
        """ "int4_g128_sym", "mxfp4", ...; "_a8" appended with int8 activations (the float32 names are unchanged)."""
        suffix = "_a8" if self.activations == "int8" else ""
        if self.kind != "int":
            return self.kind + suffix
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits}_{group}_{'sym' if self.symmetric else 'asym'}{suffix}"

    @property
    def activation_group(self) -> int:
        """Inputs per int8 scale of the activations (`activations="int8"`): the weight's group (int4 g, MXFP4 32,
        NVFP4 16), 32 for a per-channel int4 scheme (the last group of a projection may be partial)."""
        return ACTIVATION_GROUP if self.group_size is None else self.group_size

    @property
    def kernel_kind(self) -> str:
        """The kind the kernels name this scheme by (`pallas_kernels.QuantizedWeight.kind`): "int8", "int4",
        "fp8_block", "mxfp4", "nvfp4"."""
        return f"int{self.bits}" if self.kind == "int" else self.kind

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte along `in`."""
        return self.bits == 4

    def group(self, n_in: int) -> int:
        """Elements of `in` per scale (FP8: the 128-row block)."""
        if self.kind == "fp8_block":
            return FP8_BLOCK
        return n_in if self.group_size is None else self.group_size

    def check_dims(self, n_in: int, what: str) -> None:
        """`ValueError` when the scheme cannot hold a projection with `in` = `n_in`."""
        if self.kind == "fp8_block":
            return  # partial edge blocks are allowed
        g = self.group(n_in)
        if n_in % g:
            raise ValueError(f"{self.name}: group size {g} does not divide in={n_in} of {what}")
        if self.packed and g % 2:
            raise ValueError(f"{self.name}: 4-bit codes pack in pairs, group {g} of {what} is odd")


# -- the formats -----------------------------------------------------------------------------------------------


def _init(scheme: Scheme, kind: str, fan_in: int):
    """The random initialiser of array `kind` (q, scale, zero, scale2): dequantized weights with |w| ~
    1/sqrt(fan_in), like the dense init."""

    def q_init(key, shape, dtype):
        if scheme.kind == "int" or scheme.packed:
            return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(jnp.uint8)
        return (jax.random.normal(key, shape, jnp.float32) * 64).astype(jnp.float8_e4m3fn)  # fp8

    def scale_init(key, shape, dtype):
        jitter = 1 + 0.1 * jax.random.uniform(key, shape, jnp.float32)
        if scheme.kind == "int":
            spread = 73.0 if scheme.bits == 8 else 4.6  # std of uniform codes
            return jitter / (spread * math.sqrt(fan_in))
        if scheme.kind == "fp8_block":
            return jitter / (64 * math.sqrt(fan_in))
        target = 1 / (2.9 * math.sqrt(fan_in))  # std of uniform e2m1 codes ~2.9
        if scheme.kind == "mxfp4":
            return jnp.full(shape, 127 + round(math.log2(target)), jnp.uint8)
        return (jitter * target * 64).astype(jnp.float8_e4m3fn)  # nvfp4, scale2 = 1/64

    def zero_init(key, shape, dtype):
        lim = 1 << (scheme.bits - 1)
        return jax.random.randint(key, shape, -lim // 4, lim // 4, jnp.int32).astype(jnp.int8)

    def scale2_init(key, shape, dtype):
        return jnp.full(shape, 1 / 64, jnp.float32)

    return {"q": q_init, "scale": scale_init, "zero": zero_init, "scale2": scale2_init}[kind]


class QuantizedExperts(ExpertFormat):
    """Base of the quantized formats; `scheme` (a class variable) says which. Build classes with
    `quantized_format`; fields not used by a scheme stay None."""

    scheme: ClassVar[Scheme]

    @classmethod
    def declare(cls, cfg) -> dict[str, ArraySpec]:
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        s = cls.scheme
        specs: dict[str, ArraySpec] = {}
        for p, (n_in, n_out), (in_axis, out_axis) in (
            ("gate", (H, I), ("embed", "mlp")),
            ("up", (H, I), ("embed", "mlp")),
            ("down", (I, H), ("mlp", "embed")),
        ):
            s.check_dims(n_in, f"experts.{p}")
            q_dtype = "float8_e4m3fn" if s.kind == "fp8_block" else "uint8"
            q_rows = n_in // 2 if s.packed else n_in
            specs[f"{p}_q"] = ArraySpec((E, q_rows, n_out), ("expert", in_axis, out_axis), q_dtype, _init(s, "q", n_in))
            if s.kind == "fp8_block":
                grid = (E, -(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK))
                specs[f"{p}_scale"] = ArraySpec(grid, ("expert", in_axis, out_axis), "float32", _init(s, "scale", n_in))
                continue
            groups = (E, n_in // s.group(n_in), n_out)
            scale_dtype = {"mxfp4": "uint8", "nvfp4": "float8_e4m3fn"}.get(s.kind, "float32")
            specs[f"{p}_scale"] = ArraySpec(groups, ("expert", in_axis, out_axis), scale_dtype, _init(s, "scale", n_in))
            if s.kind == "int" and not s.symmetric:
                specs[f"{p}_zero"] = ArraySpec(groups, ("expert", in_axis, out_axis), "int8", _init(s, "zero", n_in))
            if s.kind == "nvfp4":
                specs[f"{p}_scale2"] = ArraySpec((E,), ("expert",), "float32", _init(s, "scale2", n_in))
        # the biases are the dense format's (float, [E, out])
        return specs | {k: v for k, v in ExpertWeights.declare(cfg).items() if k.endswith("_bias")}

    # -- one projection of one expert --------------------------------------------------------------------------
    def weight_view(self, p: str) -> Array:
        """Projection `p` of ONE expert dequantized to float32, as a fused expression of the packed arrays.

        Shape: a view of `[in, out]` whose leading axes split `in` by group: `[in/g, g, out]` (int8),
        `[in/g, g/2, 2, out]` (4-bit codes, nibble pairs), `[in, out]` (FP8, scales broadcast to elements).
        Reshaping it to `[in, out]` is free (same element order).
        """
        s = self.scheme
        q = getattr(self, f"{p}_q")
        scale = getattr(self, f"{p}_scale")
        if s.kind == "fp8_block":
            n_in, n_out = q.shape
            sf = scale.astype(jnp.float32)
            sf = jnp.repeat(jnp.repeat(sf, FP8_BLOCK, axis=0)[:n_in], FP8_BLOCK, axis=1)[:, :n_out]
            return q.astype(jnp.float32) * sf
        n_out = q.shape[-1]
        G = scale.shape[0]
        if s.packed:
            u = q.reshape(G, -1, n_out)  # [G, g/2, out]
            codes = jnp.stack(split_nibbles(u), axis=2)  # [G, g/2, 2, out]: even element, odd element
        else:
            codes = q.reshape(G, -1, n_out)  # [G, g, out]
        bcast = (slice(None),) + (None,) * (codes.ndim - 2)  # a [G, out] array against the codes
        if s.kind == "int":
            offset = 1 << (s.bits - 1)  # codes hold q + 2^(b-1)
            zero = getattr(self, f"{p}_zero")
            v = codes.astype(jnp.float32)
            v = v - (offset if zero is None else (zero.astype(jnp.float32) + offset)[bcast])
            return v * scale[bcast]
        v = e2m1_to_f32(codes)
        if s.kind == "mxfp4":
            return v * e8m0_to_f32(scale)[bcast]
        return v * (scale.astype(jnp.float32) * getattr(self, f"{p}_scale2"))[bcast]  # nvfp4

    def weight(self, p: str) -> Array:
        """Projection `p` of ONE expert as float32 `[in, out]`."""
        w = self.weight_view(p)
        return w.reshape(-1, w.shape[-1])

    def project(self, p: str, x: Array) -> Array:
        """`x [R, in] @ W_p` -> float32 `[R, out]` for one expert.

        Up to REDUCE_MAX_ROWS rows: `Σ_in w·x` as one fused multiply-reduce over `(group, element)` with the
        scale applied per element (the packed weight streamed once, no dequantized copy; `reduce_project`).
        More rows: the projection dequantized to float32 once, then a dot. With `scheme.activations == "int8"`
        the rows are first replaced by their int8 quantization (`int8_activations`).
        """
        x = x.astype(jnp.float32)
        if self.scheme.activations == "int8":  # the emulation of the native kernels' int8 activations
            x = int8_activations(x, self.scheme.activation_group)
        if x.shape[0] <= REDUCE_MAX_ROWS:
            return self.reduce_project(p, x)
        w = self.weight(p)
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    def reduce_project(self, p: str, x: Array) -> Array:
        """`project` for a few rows, float32 `x [R, in]` -> `[R, out]`, shaped for XLA:CPU's fused reductions.

        Every form reduces over the major axes of an elementwise expression of the packed bytes, streaming them
        once (a reduce over a minor axis is 10x slower on XLA:CPU).
          * int (8 and 4 bits), one row at a time: a reduce within each group, `P[G, out] = Σ_j u[G, j, out]·x[G, j]`
            (rank 3, no scale inside), then `Σ_G (P - z·Σ_j x[G, j])·s` over the small `[G, out]`. The zero point
            and the `2^(b-1)` offset of the codes come out of the sum: `Σ_j (u_j - z)·x_j = Σ_j u_j·x_j - z·Σ_j x_j`.
            Measured (benchmarks/RESULTS.md, same runs): 1.2x faster per layer than one reduce over
            `(group, element)` with the scale broadcast inside (a second operand per element); with a leading row
            axis (rank 4) the same two-stage reduce was 4x slower.
          * int4: for a byte u = lo + 16·hi (lo the even element), `lo·x_e + hi·x_o = u·x_e + hi·(x_o - 16·x_e)`
            with `hi = floor(u / 16)`: three float operations per byte, no nibble extraction in integers.
          * FP4: each nibble decoded by `e2m1_to_f32`, even and odd elements against x_e and x_o, one reduce over
            `(group, element)` with the scale inside (the two-stage form measured no faster for MXFP4).
        """
        s = self.scheme
        R = x.shape[0]
        q = getattr(self, f"{p}_q")
        scale = getattr(self, f"{p}_scale")
        n_out = q.shape[-1]
        if s.kind == "fp8_block":
            # Scales expanded along out only ([in/128, out], small); full 128-row blocks as one reduction over
            # (block, row), a partial last block as a second one.
            n_in = q.shape[0]
            full = n_in // FP8_BLOCK * FP8_BLOCK
            s_out = jnp.repeat(scale.astype(jnp.float32), FP8_BLOCK, axis=1)[:, :n_out]  # [ceil(in/128), out]
            y = jnp.zeros((R, n_out), jnp.float32)
            if full:
                w = q[:full].reshape(-1, FP8_BLOCK, n_out).astype(jnp.float32) * s_out[: full // FP8_BLOCK, None]
                y = jnp.sum(w[None] * x[:, :full].reshape(R, -1, FP8_BLOCK, 1), axis=(1, 2))
            if full < n_in:
                w = q[full:].astype(jnp.float32) * s_out[-1]  # [in - full, out]
                y = y + jnp.sum(w[None] * x[:, full:, None], axis=1)
            return y
        G = scale.shape[0]
        if s.kind == "int":
            u = q.reshape(G, -1, n_out).astype(jnp.float32)  # [G, g, out] (int4: [G, g/2, out], nibble pairs)
            zero = getattr(self, f"{p}_zero")
            z = float(1 << (s.bits - 1)) if zero is None else zero.astype(jnp.float32) + (1 << (s.bits - 1))
            rows = []
            for r in range(R):  # one rank-3 reduction per row
                xg = x[r].reshape(G, -1)  # [G, g]
                if s.packed:
                    hi = jnp.floor(u * (1 / 16))
                    xe, xo = xg[:, 0::2, None], xg[:, 1::2, None]  # [G, g/2, 1]
                    partial = jnp.sum(u * xe + hi * (xo - 16 * xe), axis=1)  # [G, out]
                else:
                    partial = jnp.sum(u * xg[:, :, None], axis=1)  # [G, out]
                partial = partial - xg.sum(-1)[:, None] * z  # codes hold q + 2^(b-1); minus the zero point
                rows.append(jnp.sum(partial * scale.astype(jnp.float32), axis=0))
            return jnp.stack(rows)
        sf = e8m0_to_f32(scale) if s.kind == "mxfp4" else scale.astype(jnp.float32) * getattr(self, f"{p}_scale2")
        u = q.reshape(G, -1, n_out)  # [G, g/2, out]
        xg = x.reshape(R, G, -1)
        xe, xo = xg[:, :, 0::2, None], xg[:, :, 1::2, None]
        low, high = split_nibbles(u)
        v = e2m1_to_f32(low)[None] * xe + e2m1_to_f32(high)[None] * xo
        return jnp.sum(v * sf[None, :, None, :], axis=(1, 2))

    def gate_up(self, x: Array) -> tuple[Array, Array]:
        gate, up = self.project("gate", x), self.project("up", x)  # [R, I] each
        if self.gate_bias is not None:
            gate = gate + self.gate_bias.astype(jnp.float32)
            up = up + self.up_bias.astype(jnp.float32)
        return gate, up

    def down_proj(self, h: Array) -> Array:
        y = self.project("down", h)  # [R, H]; h stays float32 (weight-only quantization)
        if self.down_bias is not None:
            y = y + self.down_bias.astype(jnp.float32)
        return y

    def dequantize(self) -> ExpertWeights:
        if self.gate_q.ndim == 3:  # stacked: one expert at a time
            return jax.vmap(lambda one: one.dequantize())(self)
        bias = {k: None if v is None else v.astype(jnp.float32) for k, v in self._biases().items()}
        return ExpertWeights(self.weight("gate"), self.weight("up"), self.weight("down"), **bias)

    def _biases(self) -> dict[str, Array | None]:
        return {"gate_bias": self.gate_bias, "up_bias": self.up_bias, "down_bias": self.down_bias}


_FIELDS = [f"{p}_{k}" for p in PROJECTIONS for k in ("q", "scale", "zero", "scale2")]
_FIELDS += ["gate_bias", "up_bias", "down_bias"]


def quantized_format(
    kind: Kind,
    *,
    bits: int | None = None,
    group_size: int | None = None,
    symmetric: bool = True,
    activations: Activations = "float32",
) -> type[QuantizedExperts]:
    """The format class of one scheme (cached: the same scheme gives the same class).

    kind "int": `bits` 8 or 4, `group_size` (None: per output channel), `symmetric`. "fp8_block": 128x128
    blocks. "mxfp4": group 32. "nvfp4": group 16. `activations`: "float32" (weight-only) or "int8" (int and
    4-bit schemes; `Scheme.activations`), a class of its own (name suffix "A8") with the same arrays.
    """
    if kind == "int":
        scheme = Scheme("int", 8 if bits is None else bits, group_size, symmetric, activations)
    else:
        fixed = {"fp8_block": (8, None), "mxfp4": (4, 32), "nvfp4": (4, 16)}
        if kind not in fixed:
            raise ValueError(f"kind={kind!r} is not one of 'int', 'fp8_block', 'mxfp4', 'nvfp4'")
        want_bits, want_group = fixed[kind]
        if bits not in (None, want_bits) or group_size not in (None, want_group):
            raise ValueError(f"{kind} has bits={want_bits}, group_size={want_group}; got {bits=}, {group_size=}")
        scheme = Scheme(kind, want_bits, want_group, symmetric, activations)
    return _format_class(scheme)


@functools.cache
def _format_class(scheme: Scheme) -> type[QuantizedExperts]:
    """The one class of `scheme` (cached by the scheme: however the arguments were spelled)."""
    cls_name = "".join(part.capitalize() for part in scheme.name.split("_"))
    namespace = {
        "__module__": __name__,
        "__qualname__": cls_name,
        "__annotations__": {f: "Array | None" for f in _FIELDS},
        "scheme": scheme,
        "name": scheme.name,
        **{f: None for f in _FIELDS},
    }
    cls = dataclasses.dataclass(frozen=True)(type(cls_name, (QuantizedExperts,), namespace))
    return jax.tree_util.register_dataclass(cls)


FORMAT_NAMES = ("int8", "int4", "fp8_block", "mxfp4", "nvfp4")


def format_by_name(name: str, **options: Any) -> type[QuantizedExperts]:
    """`"int8" | "int4"` (options group_size=128, symmetric=True; group_size=None per channel), `"fp8_block"`,
    `"mxfp4"`, `"nvfp4"` -> the format class. Every name takes `activations="float32" | "int8"` too
    (`Scheme.activations`; "int8" for all but fp8_block)."""
    activations = options.pop("activations", "float32")
    if name in ("int8", "int4"):
        unknown = set(options) - {"group_size", "symmetric"}
        if unknown:
            raise ValueError(f"{name}: unknown options {sorted(unknown)} (group_size, symmetric, activations)")
        return quantized_format(
            "int",
            bits=int(name[3:]),
            group_size=options.get("group_size", 128),
            symmetric=options.get("symmetric", True),
            activations=activations,
        )
    if name in FORMAT_NAMES:
        if options:
            raise ValueError(f"{name} takes no options but activations, got {sorted(options)}")
        return quantized_format(name, activations=activations)
    raise ValueError(f"format {name!r} is not one of {FORMAT_NAMES}")
