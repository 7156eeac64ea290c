"""Quantized routed-expert formats (weight-only): int8/int4 group-wise, FP8 e4m3 block-scaled, MXFP4, NVFP4.

Each scheme is one `ExpertFormat` subclass (`quantized_format(kind, ...)`, cached, so one scheme is one class and
one pytree type). Weights stay packed on the device; `gate_up` / `down_proj` dequantize ONE expert's projection
inside the computation that uses it (scale math in float32), never the whole weight set. Activations are not
quantized: x and the intermediate h stay float32 (weight-only quantization, A16 in llm-compressor's names).
The on-disk layouts, the math and where each was checked are in docs/FORMATS.md.

In-memory layout of one projection (`in` = H, `out` = I for gate/up; `in` = I, `out` = H for down), E axis first:

    field            int8          int4 / MXFP4 / NVFP4           FP8 block
    {p}_q            uint8 [in,out] uint8 [in/2, out] nibble pairs float8_e4m3fn [in, out]
    {p}_scale        f32 [in/g,out] f32 / e8m0 uint8 / e4m3 [in/g,out]  f32 [ceil(in/128), ceil(out/128)]
    {p}_zero         int8 [in/g, out] (asymmetric int only)
    {p}_scale2       f32 [] (NVFP4 only: the per-tensor multiplier, ModelOpt's `weight_scale_2`)

Why `[in, out]` (the transpose of the checkpoints' `[out, in]`) with groups along the MAJOR axis: decode (a few
rows) computes `y[o] = Σ_i w[i, o]·x[i]` as one fused multiply-reduce that streams the packed bytes once; XLA:CPU
vectorizes a reduction over a major axis across the minor `out` axis, but reduces a minor axis one element at a
time. Measured (jax 0.10.2, this shared 2-core VM, eight `[2048, 1536]` int8 products at one row, groups of
128): 19 ms as `[in, out]` vs 271 ms as `[out, in]`. An int4 byte holds two consecutive `in` elements of one
column (low nibble = even element, as on disk), so unpacking never interleaves: the reduction runs over
`[in/g, g/2, 2, out]`, which is the same memory as `[in, out]` read in order.

Int values are stored as on disk, unsigned `q + 2^(b-1)` (int8 bytes `q + 128`, int4 nibbles `q + 8`); a zero
point is signed like q (compressed-tensors), so `w = (q - zp)·scale = (u - 2^(b-1) - zp)·scale`. Unsigned bytes
also convert to float faster on XLA:CPU (eight `[2048, 768]` one-row products: 10.4 ms from uint8, 17.0 from
int8).

Many rows (prefill blocks) dequantize the expert's projection to float32 once and run one dot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.weights import (
    ArraySpec,
    ExpertFormat,
    Experts,
    ExpertWeights,
    PerExpert,
    as_stacked,
    check_experts,
    format_of,
    from_host,
    small_normal,
    to_layout,
)
from pallas_kernels.codecs import (  # the one decoder of each code, shared with the kernels
    E2M1_VALUES,  # noqa: F401 (re-exported)
    e2m1_to_f32,
    e8m0_to_f32,
    pack_nibbles,
    split_nibbles,
    unpack_nibbles,
)

Array = jax.Array
Kind = Literal["int", "fp8_block", "mxfp4", "nvfp4"]
PROJECTIONS = ("gate", "up", "down")
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
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
    """

    kind: Kind
    bits: int
    group_size: int | None
    symmetric: bool = True

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

    @property
    def name(self) -> str:
        if self.kind != "int":
            return self.kind
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits}_{group}_{'sym' if self.symmetric else 'asym'}"

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
        if cfg.expert_bias:
            specs |= {
                "gate_bias": ArraySpec((E, I), ("expert", "mlp"), init=small_normal),
                "up_bias": ArraySpec((E, I), ("expert", "mlp"), init=small_normal),
                "down_bias": ArraySpec((E, H), ("expert", "embed"), init=small_normal),
            }
        return specs

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
        More rows: the projection dequantized to float32 once, then a dot.
        """
        x = x.astype(jnp.float32)
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


@functools.cache
def quantized_format(
    kind: Kind, *, bits: int | None = None, group_size: int | None = None, symmetric: bool = True
) -> type[QuantizedExperts]:
    """The format class of one scheme (cached: the same arguments give the same class).

    kind "int": `bits` 8 or 4, `group_size` (None: per output channel), `symmetric`. "fp8_block": 128x128
    blocks. "mxfp4": group 32. "nvfp4": group 16.
    """
    if kind == "int":
        scheme = Scheme("int", 8 if bits is None else bits, group_size, symmetric)
    else:
        fixed = {"fp8_block": (8, None), "mxfp4": (4, 32), "nvfp4": (4, 16)}
        if kind not in fixed:
            raise ValueError(f"kind={kind!r} is not one of 'int', 'fp8_block', 'mxfp4', 'nvfp4'")
        want_bits, want_group = fixed[kind]
        if bits not in (None, want_bits) or group_size not in (None, want_group):
            raise ValueError(f"{kind} has bits={want_bits}, group_size={want_group}; got {bits=}, {group_size=}")
        scheme = Scheme(kind, want_bits, want_group, symmetric)
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
    `"mxfp4"`, `"nvfp4"` -> the format class."""
    if name in ("int8", "int4"):
        unknown = set(options) - {"group_size", "symmetric"}
        if unknown:
            raise ValueError(f"{name}: unknown options {sorted(unknown)} (group_size, symmetric)")
        return quantized_format(
            "int",
            bits=int(name[3:]),
            group_size=options.get("group_size", 128),
            symmetric=options.get("symmetric", True),
        )
    if name in FORMAT_NAMES:
        if options:
            raise ValueError(f"{name} takes no options, got {sorted(options)}")
        return quantized_format(name)
    raise ValueError(f"format {name!r} is not one of {FORMAT_NAMES}")


# -- quantize / dequantize (host, numpy) --------------------------------------------------------------------------


def _round_bf16(v: np.ndarray) -> np.ndarray:
    return v.astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize_projection(
    w: np.ndarray, scheme: Scheme, *, tensor_amax: float | None = None, name: str = "the weight"
) -> dict[str, np.ndarray]:
    """One projection of one expert, float `[in, out]` -> the format's arrays `{q, scale, zero?, scale2?}`.

    Min-max scales, round-to-nearest-even.
      * int: symmetric `scale = max|w| / (2^(b-1) - 1)`; asymmetric `scale = (max(w, 0) - min(w, 0)) / (2^b - 1)`
        and `zp = round(-2^(b-1) - min/scale)`.
      * FP8: `scale = max|w| / 448` per 128x128 block, values clipped to ±448.
      * MXFP4: `scale = 2^(floor(log2 max|w|) - 2)` (OCP MX), values saturate at ±6.
      * NVFP4: per-tensor `scale2 = max|w| / (448·6)`, block `scale = e4m3(max|w_block| / (6·scale2))`.
    Int and FP8 scales are rounded to bfloat16 first (compressed-tensors stores them in bfloat16, DeepSeek in
    float32: a save is exact in both). `tensor_amax` overrides NVFP4's per-tensor max (gate and up share one, as
    ModelOpt and llm-compressor fuse them).

    Raises:
      ValueError: `w` holds NaN or inf (naming `name` and the first position): min-max scales would turn them into
        finite codes and zero the rest of their group, where the dense forward gives NaN.
    """
    w = np.asarray(w, np.float32)
    n_in, n_out = w.shape
    bad = ~np.isfinite(w)
    if bad.any():
        i, o = np.argwhere(bad)[0]
        raise ValueError(
            f"quantize: {name} [{n_in}, {n_out}] has {int(bad.sum())} non-finite values (first w[{i}, {o}] = "
            f"{w[i, o]}); quantized codes cannot represent them"
        )
    scheme.check_dims(n_in, name)
    if scheme.kind == "fp8_block":
        gi, go = -(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK)
        padded = np.zeros((gi * FP8_BLOCK, go * FP8_BLOCK), np.float32)
        padded[:n_in, :n_out] = w
        blocks = padded.reshape(gi, FP8_BLOCK, go, FP8_BLOCK)
        scale = _round_bf16(np.abs(blocks).max(axis=(1, 3)) / FP8_MAX)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(padded.shape)[:n_in, :n_out]
        return {"q": q.astype(ml_dtypes.float8_e4m3fn), "scale": scale}
    g = scheme.group(n_in)
    wg = w.reshape(n_in // g, g, n_out)
    out: dict[str, np.ndarray] = {}
    if scheme.kind == "int":
        lo, hi = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
        if scheme.symmetric:
            scale = _round_bf16(np.abs(wg).max(axis=1) / hi)
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
            q = np.clip(np.round(wg / scale[:, None]), lo, hi)
        else:
            mn, mx = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
            scale = _round_bf16((mx - mn) / (hi - lo))
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
            zero = np.clip(np.round(lo - mn / scale), lo, hi)
            q = np.clip(np.round(wg / scale[:, None]) + zero[:, None], lo, hi)
            out["zero"] = zero.astype(np.int8)
        q = q.reshape(n_in, n_out).astype(np.int8)
        codes = (q.astype(np.int16) + (1 << (scheme.bits - 1))).astype(np.uint8)
        out["q"] = pack_nibbles(codes) if scheme.packed else codes
        out["scale"] = scale
        return out
    amax = np.abs(wg).max(axis=1)  # [G, out]
    if scheme.kind == "mxfp4":
        exp = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
        exp = np.clip(np.where(amax > 0, exp, -127), -127, 127).astype(np.int32)
        scale_f = np.ldexp(np.float32(1), exp).astype(np.float32)
        out["scale"] = (exp + 127).astype(np.uint8)
    else:  # nvfp4
        tensor_amax = float(np.abs(w).max()) if tensor_amax is None else tensor_amax
        scale2 = np.float32(tensor_amax / (FP8_MAX * FP4_MAX)) if tensor_amax > 0 else np.float32(1.0)
        block = (amax / (FP4_MAX * scale2)).astype(ml_dtypes.float8_e4m3fn)
        scale_f = block.astype(np.float32) * scale2
        scale_f = np.where(scale_f > 0, scale_f, 1.0).astype(np.float32)
        out["scale"], out["scale2"] = block, np.asarray(scale2, np.float32)
    v = np.clip(wg / scale_f[:, None], -FP4_MAX, FP4_MAX).reshape(n_in, n_out)
    out["q"] = pack_nibbles(v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15)
    return out


def quantize_experts(experts: Experts, fmt: type[QuantizedExperts]) -> QuantizedExperts:
    """Dense routed experts (either layout) -> `fmt`, stacked, one expert and projection at a time on the host."""
    dense = as_stacked(experts)
    if not isinstance(dense, ExpertWeights):
        raise TypeError(f"quantize takes dense experts (ExpertWeights), got {type(dense).__name__}")
    fields: dict[str, list[np.ndarray]] = {}
    for e in range(dense.num_experts):
        ws = {p: np.asarray(getattr(dense, p)[e], np.float32) for p in PROJECTIONS}
        gate_up_amax = float(max(np.abs(ws["gate"]).max(), np.abs(ws["up"]).max()))
        for p, w in ws.items():
            amax = gate_up_amax if p != "down" and fmt.scheme.kind == "nvfp4" else None
            for k, v in quantize_projection(w, fmt.scheme, tensor_amax=amax, name=f"expert {e} {p}").items():
                fields.setdefault(f"{p}_{k}", []).append(v)
    stacked = {name: jnp.asarray(np.stack(vs)) for name, vs in fields.items()}
    biases = {k: getattr(dense, k) for k in ("gate_bias", "up_bias", "down_bias") if getattr(dense, k) is not None}
    return fmt(**stacked, **biases)


def quantize(params, cfg, format_name: str, **options: Any):
    """`MoEParams` with dense routed experts -> the same params with the routed experts in a quantized format.

    Args:
      params: `moejax.MoEParams` (routed experts dense, either layout); the router and shared expert are kept.
      cfg: the `MoEConfig` (shapes are checked against it).
      format_name: "int8", "int4" (options `group_size=128` (None: per channel), `symmetric=True`),
        "fp8_block", "mxfp4", "nvfp4". Min-max scales, round-to-nearest-even (`quantize_projection`).

    Returns:
      `MoEParams` whose experts are in the quantized format, in the layout the input had.
    """
    from moejax.params import check_params  # params imports weights; this module stays below params

    fmt = format_by_name(format_name, **options)
    check_params(params, cfg)
    fmt.declare(cfg)  # raises for a group that does not divide in
    q = quantize_experts(params.experts, fmt)
    layout = "per_expert" if isinstance(params.experts, PerExpert) else "stacked"
    return dataclasses.replace(params, experts=to_layout(q, layout))


def dequantize(qparams):
    """`MoEParams` (or routed experts) in any format -> the same with float32 dense `ExpertWeights`, same layout."""
    experts = getattr(qparams, "experts", qparams)
    per_expert = isinstance(experts, PerExpert)
    dense = as_stacked(experts).dequantize()
    dense = to_layout(dense, "per_expert" if per_expert else "stacked")
    if experts is qparams:
        return dense
    return dataclasses.replace(qparams, experts=dense)


# -- Hugging Face on-disk layouts ---------------------------------------------------------------------------------

Source = Literal["compressed-tensors", "deepseek", "gpt-oss", "modelopt"]
SOURCES = ("compressed-tensors", "deepseek", "gpt-oss", "modelopt")


@dataclasses.dataclass(frozen=True)
class HfQuant:
    """What a checkpoint's quantization config says: the in-memory format and the on-disk flavour."""

    fmt: type[QuantizedExperts]
    source: Source


_KNOWN_METHODS = ("compressed-tensors", "fp8", "mxfp4", "modelopt")


def format_from_config(quantization_config: Mapping[str, Any] | None, hf_quant_config: Mapping | None = None):
    """The format of a checkpoint from config.json's `quantization_config` and/or `hf_quant_config.json`.

    Returns:
      `HfQuant`, or None when neither is given (a dense checkpoint).

    Raises:
      ValueError: unknown `quant_method`, or a scheme this module does not hold (naming the field).
    """
    if quantization_config is None and hf_quant_config is not None:
        algo = (hf_quant_config.get("quantization") or {}).get("quant_algo")
        return _modelopt(algo, (hf_quant_config.get("quantization") or {}).get("group_size", 16))
    if quantization_config is None:
        return None
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt={qc.get('fmt')!r}: only 'e4m3' FP8 is supported")
        block = list(qc.get("weight_block_size") or [])
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise NotImplementedError(f"quantization_config.weight_block_size={block}: only [128, 128] is supported")
        return HfQuant(quantized_format("fp8_block"), "deepseek")
    if method == "mxfp4":
        return HfQuant(quantized_format("mxfp4"), "gpt-oss")
    if method == "modelopt":
        return _modelopt(qc.get("quant_algo"), qc.get("group_size", 16))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization_config.quant_method={method!r} is not one of {_KNOWN_METHODS}")


def _modelopt(algo, group_size) -> HfQuant:
    if algo != "NVFP4":
        raise NotImplementedError(f"ModelOpt quant_algo={algo!r}: only 'NVFP4' is supported")
    if group_size != 16:
        raise ValueError(f"ModelOpt NVFP4 group_size={group_size}, expected 16")
    return HfQuant(quantized_format("nvfp4"), "modelopt")


def _compressed_tensors(qc: Mapping[str, Any]) -> HfQuant:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ValueError(f"quantization_config.config_groups must be an object, got {type(groups).__name__}")
    for name, g in groups.items():
        if not isinstance(g, Mapping):
            raise ValueError(f"quantization_config.config_groups.{name} must be an object, got {type(g).__name__}")
        if g.get("weights") is not None and not isinstance(g["weights"], Mapping):
            raise ValueError(f"quantization_config.config_groups.{name}.weights must be an object")
    schemes = {name: g.get("weights") for name, g in groups.items() if g.get("weights")}
    if not schemes:
        raise ValueError("quantization_config.config_groups: no group quantizes weights")
    found = {}
    for name, w in schemes.items():
        fmt_name = groups[name].get("format") or qc.get("format")
        found[name] = _ct_scheme(w, fmt_name, f"quantization_config.config_groups.{name}")
    distinct = set(found.values())
    if len(distinct) > 1:
        raise NotImplementedError(f"config_groups quantize layers differently ({found}); one scheme is supported")
    return HfQuant(distinct.pop(), "compressed-tensors")


def _ct_scheme(w: Mapping[str, Any], fmt_name: str | None, where: str) -> type[QuantizedExperts]:
    bits, typ, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):  # bool("false") is True: a string would silently drop the zero points
        raise ValueError(f"{where}.weights.symmetric={symmetric!r} must be true or false (a JSON boolean)")
    if fmt_name == "nvfp4-pack-quantized":
        if w.get("group_size", 16) != 16:
            raise ValueError(f"{where}.weights.group_size={w.get('group_size')}: NVFP4 groups are 16")
        return quantized_format("nvfp4")
    if fmt_name == "mxfp4-pack-quantized":
        if w.get("group_size", 32) != 32:
            raise ValueError(f"{where}.weights.group_size={w.get('group_size')}: MXFP4 groups are 32")
        return quantized_format("mxfp4")
    if fmt_name == "float-quantized":
        if typ != "float" or bits != 8 or strategy != "block":
            raise NotImplementedError(f"{where}: float-quantized {typ}{bits} {strategy}: only FP8 'block' is supported")
        if list(w.get("block_structure") or []) != [FP8_BLOCK, FP8_BLOCK]:
            raise NotImplementedError(f"{where}.weights.block_structure={w.get('block_structure')}: only [128, 128]")
        return quantized_format("fp8_block")
    if fmt_name == "pack-quantized":
        if typ != "int" or bits not in (4, 8):
            raise NotImplementedError(f"{where}: pack-quantized {typ}{bits}: int4 and int8 are supported")
        if strategy == "group":
            group = w.get("group_size")
            if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
                raise ValueError(f"{where}.weights.group_size={group!r}: a positive group size is needed")
        elif strategy == "channel":
            group = None
        else:
            raise NotImplementedError(f"{where}.weights.strategy={strategy!r}: 'group' and 'channel' are supported")
        if w.get("actorder") not in (None, False, "weight", "static"):
            raise NotImplementedError(f"{where}.weights.actorder={w.get('actorder')!r}: act-order is not supported")
        return quantized_format("int", bits=bits, group_size=group, symmetric=symmetric)
    raise ValueError(
        f"{where}: compressed-tensors format {fmt_name!r} is not one of 'pack-quantized', 'float-quantized', "
        "'nvfp4-pack-quantized', 'mxfp4-pack-quantized'"
    )


_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _names(tensors: Mapping[str, Any]) -> dict[str, str]:
    for names in _PER_EXPERT_NAMES:
        if any(k.startswith(f"experts.0.{names[0]}.") for k in tensors):
            return dict(zip(PROJECTIONS, names, strict=True))
    return dict(zip(PROJECTIONS, _PER_EXPERT_NAMES[0], strict=True))


# The dtypes each on-disk tensor may have. The stored dtype decides how the bytes are decoded: a tensor of another
# dtype is refused, never cast or reinterpreted (an FP8 e5m2 weight read as e4m3 gives other values, a float32
# weight_packed cast to int32 loses its bit pattern).
_FLOATS = tuple(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16))  # exact in float32
_E4M3 = (np.dtype(ml_dtypes.float8_e4m3fn),)
_BYTES = (np.dtype(np.uint8),)  # packed e2m1 nibble pairs
_E8M0 = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu))  # the same encoding either way
_INT32 = (np.dtype(np.int32), np.dtype(np.uint32))  # compressed-tensors' packed int32 words
_INTS = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def _take(
    tensors: Mapping[str, Any],
    key: str,
    shape: tuple[int, ...] | None,
    what: str = "",
    dtypes: tuple[np.dtype, ...] | None = None,
) -> np.ndarray:
    if key not in tensors:
        raise ValueError(f"missing tensor {key!r}{what}")
    value = np.asarray(tensors[key])
    if dtypes is not None and value.dtype not in dtypes:
        expected = " or ".join(d.name for d in dtypes)
        raise ValueError(f"{key}: dtype {value.dtype.name}, expected {expected} (the stored dtype decides decoding)")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{key}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def _bytes_of_int32_rows(packed: np.ndarray) -> np.ndarray:
    """int32 `[rows, n]` -> uint8 `[rows, 4n]`, each row's little-endian bit stream as bytes."""
    return np.ascontiguousarray(packed.astype("<i4")).view(np.uint8)


def _int32_rows_of_bytes(b: np.ndarray) -> np.ndarray:
    """uint8 `[rows, m]` -> int32 `[rows, ceil(m/4)]` (zero padded), the inverse of `_bytes_of_int32_rows`."""
    rows, m = b.shape
    padded = np.zeros((rows, -(-m // 4) * 4), np.uint8)
    padded[:, :m] = b
    return padded.view("<i4").astype(np.int32)


def _codes_of_stream(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Bytes `[rows, m]` (a bit stream per row) -> unsigned codes `[rows, n]` of `bits` bits."""
    if bits == 8:
        return b[:, :n]
    return np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1)[:, :n]


def _stream_of_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return codes.astype(np.uint8)
    if codes.shape[1] % 2:
        codes = np.pad(codes, ((0, 0), (0, 1)))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def projection_from_hf(
    tensors: Mapping[str, Any], prefix: str, scheme: Scheme, source: Source, n_out: int, n_in: int
) -> dict[str, np.ndarray]:
    """One projection's on-disk tensors (`{prefix}weight_packed`, ...; weight `[out, in]`) -> in-memory fields
    `{q, scale, zero?, scale2?}` (`[in, out]` orientation). Raises `ValueError` naming the key on a mismatch."""
    scheme.check_dims(n_in, f"{prefix}weight (in={n_in})")
    zp_key = f"{prefix}weight_zero_point"
    if (scheme.kind != "int" or scheme.symmetric) and zp_key in tensors:
        raise ValueError(
            f"{zp_key}: the checkpoint holds a zero point but the {scheme.name} scheme is symmetric (the config's "
            "`symmetric` contradicts the tensors)"
        )
    if scheme.kind == "fp8_block":
        grid = (-(-n_out // FP8_BLOCK), -(-n_in // FP8_BLOCK))
        q = _take(tensors, f"{prefix}weight", (n_out, n_in), dtypes=_E4M3)
        scale_key = f"{prefix}weight_scale_inv" if source == "deepseek" else f"{prefix}weight_scale"
        scale = _take(tensors, scale_key, None, dtypes=_FLOATS)
        if tuple(scale.shape) != grid:
            raise ValueError(
                f"{scale_key}: scale grid {tuple(scale.shape)} does not match weight [{n_out}, {n_in}] in 128x128 "
                f"blocks, expected {grid}"
            )
        return {"q": q.T, "scale": scale.astype(np.float32).T}
    G = n_in // scheme.group(n_in)
    scale_key = f"{prefix}weight_scale"
    if scheme.kind == "int":
        bits = scheme.bits
        packed = _take(tensors, f"{prefix}weight_packed", (n_out, -(-n_in * bits // 32)), dtypes=_INT32)
        if f"{prefix}weight_shape" in tensors:
            shape = tuple(int(v) for v in _take(tensors, f"{prefix}weight_shape", None, dtypes=_INTS).reshape(-1))
            if shape != (n_out, n_in):
                raise ValueError(f"{prefix}weight_shape: {shape}, expected {(n_out, n_in)}")
        g_idx_key = f"{prefix}weight_g_idx"
        if g_idx_key in tensors:
            g_idx = _take(tensors, g_idx_key, None, dtypes=_INTS).reshape(-1)
            if not np.array_equal(g_idx, np.arange(n_in) // scheme.group(n_in)):
                raise NotImplementedError(f"{g_idx_key}: act-order (a permuted group index) is not supported")
        codes = _codes_of_stream(_bytes_of_int32_rows(packed), bits, n_in)  # [out, in] unsigned q + 2^(b-1)
        q = np.ascontiguousarray(codes.T) if bits == 8 else pack_nibbles(codes.T)
        scale = _take(tensors, scale_key, None, dtypes=_FLOATS)
        if tuple(scale.shape) != (n_out, G):
            raise ValueError(
                f"{scale_key}: scale grid {tuple(scale.shape)} does not match weight [{n_out}, {n_in}] in groups "
                f"of {scheme.group(n_in)}, expected {(n_out, G)}"
            )
        out = {"q": q, "scale": scale.astype(np.float32).T}
        if not scheme.symmetric:
            zp_shape = (-(-n_out * bits // 32), G)
            zp = _take(tensors, zp_key, zp_shape, " (asymmetric scheme: a zero point is required)", _INT32)
            zp_codes = _codes_of_stream(_bytes_of_int32_rows(zp.T), bits, n_out)  # [G, out]
            out["zero"] = (zp_codes.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
        return out
    weight_key = f"{prefix}weight" if source == "modelopt" else f"{prefix}weight_packed"
    packed = _take(tensors, weight_key, (n_out, n_in // 2), dtypes=_BYTES)
    scale = _take(tensors, scale_key, None, dtypes=_E8M0 if scheme.kind == "mxfp4" else _E4M3)
    if tuple(scale.shape) != (n_out, G):
        raise ValueError(
            f"{scale_key}: scale grid {tuple(scale.shape)} does not match weight [{n_out}, {n_in}] in groups of "
            f"{scheme.group(n_in)}, expected {(n_out, G)}"
        )
    out = {"q": np.ascontiguousarray(packed.T)}
    if scheme.kind == "mxfp4":
        out["scale"] = scale.view(np.uint8).T
        return out
    out["scale"] = scale.T
    if source == "modelopt":
        key = f"{prefix}weight_scale_2"
        s2 = _take(tensors, key, None, " (NVFP4: the per-tensor scale is required)", _FLOATS)
        s2 = s2.astype(np.float32).reshape(-1)
        if s2.size != 1:
            raise ValueError(f"{key}: expected one value, got shape {s2.shape}")
        out["scale2"] = np.asarray(s2[0], np.float32)
    else:
        key = f"{prefix}weight_global_scale"
        gs = _take(tensors, key, None, " (NVFP4: the global scale is required)", _FLOATS)
        gs = gs.astype(np.float32).reshape(-1)
        if gs.size != 1:
            raise ValueError(f"{key}: expected one value, got shape {gs.shape}")
        out["scale2"] = np.asarray(np.float32(1) / gs[0], np.float32)  # w = fp4·scale/global
    return out


def projection_to_hf(fields: Mapping[str, np.ndarray], prefix: str, scheme: Scheme, source: Source):
    """The inverse of `projection_from_hf` for one projection of one expert."""
    q = np.asarray(fields["q"])
    scale = np.asarray(fields["scale"])
    if scheme.kind == "fp8_block":
        key = f"{prefix}weight_scale_inv" if source == "deepseek" else f"{prefix}weight_scale"
        s = scale.T.astype(np.float32 if source == "deepseek" else ml_dtypes.bfloat16)
        return {f"{prefix}weight": np.ascontiguousarray(q.T), key: np.ascontiguousarray(s)}
    if scheme.kind == "int":
        bits = scheme.bits
        codes = q.T if bits == 8 else unpack_nibbles(q).T  # [out, in], q + 2^(b-1)
        n_out, n_in = codes.shape
        out = {
            f"{prefix}weight_packed": _int32_rows_of_bytes(_stream_of_codes(codes, bits)),
            f"{prefix}weight_scale": np.ascontiguousarray(scale.T.astype(ml_dtypes.bfloat16)),
            f"{prefix}weight_shape": np.array([n_out, n_in], np.int64),
        }
        if not scheme.symmetric:
            zp = (np.asarray(fields["zero"]).astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)  # [G, out]
            out[f"{prefix}weight_zero_point"] = np.ascontiguousarray(_int32_rows_of_bytes(_stream_of_codes(zp, bits)).T)
        return out
    weight_key = f"{prefix}weight" if source == "modelopt" else f"{prefix}weight_packed"
    out = {weight_key: np.ascontiguousarray(q.T)}
    out[f"{prefix}weight_scale"] = np.ascontiguousarray(scale.T)
    if scheme.kind == "nvfp4":
        s2 = np.float32(np.asarray(fields["scale2"]))
        if source == "modelopt":
            out[f"{prefix}weight_scale_2"] = np.asarray(s2, np.float32)
        else:
            out[f"{prefix}weight_global_scale"] = np.asarray([np.float32(1) / s2], np.float32)
    return out


def format_from_hf_tensors(
    tensors: Mapping[str, Any], cfg, quant: HfQuant, *, layout: str = "auto"
) -> QuantizedExperts | PerExpert:
    """One MoE block's routed experts from its checkpoint tensors (keys relative to the block) in `quant`'s format.

    Per-expert keys `experts.{e}.{gate,up,down}_proj.<suffix>` (Mixtral `w1/w3/w2`), or gpt-oss's fused
    `experts.gate_up_proj_blocks/_scales` (gate and up rows interleaved) and `experts.down_proj_blocks/_scales`
    with `experts.gate_up_proj_bias`, `experts.down_proj_bias`. Every array is checked against `cfg` (the message
    names the key). Host arrays (numpy, or anything `np.asarray` reads); the result is placed in `layout`.
    """
    fields = fields_from_hf_tensors(tensors, cfg, quant)
    experts = from_host(fields, quant.fmt, layout)
    check_experts(experts, cfg, "experts")
    return experts


def fields_from_hf_tensors(tensors: Mapping[str, Any], cfg, quant: HfQuant) -> dict[str, np.ndarray]:
    """`format_from_hf_tensors` on the host: `{field: np.ndarray [E, ...]}` for `moejax.weights.from_host`."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    scheme = quant.fmt.scheme
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    per: dict[str, list[np.ndarray]] = {}
    if quant.source == "gpt-oss":
        if scheme.kind != "mxfp4":
            raise ValueError(f"the gpt-oss layout holds MXFP4, not {scheme.name}")
        for fused, parts, (n_out, n_in) in (
            ("experts.gate_up_proj", ("gate", "up"), (2 * I, H)),
            ("experts.down_proj", ("down",), (H, I)),
        ):
            scheme.check_dims(n_in, f"{fused}_blocks (in={n_in})")
            blocks = _take(tensors, f"{fused}_blocks", (E, n_out, n_in // 32, 16), dtypes=_BYTES)
            scales = _take(tensors, f"{fused}_scales", (E, n_out, n_in // 32), dtypes=_E8M0).view(np.uint8)
            blocks = blocks.reshape(E, n_out, n_in // 2)
            for i, p in enumerate(parts):
                rows = slice(i, None, len(parts))  # gate_up: gate the even rows, up the odd rows
                per[f"{p}_q"] = [np.ascontiguousarray(blocks[e, rows].T) for e in range(E)]
                per[f"{p}_scale"] = [np.ascontiguousarray(scales[e, rows].T) for e in range(E)]
        fields = {name: np.stack(vs) for name, vs in per.items()}
        if cfg.expert_bias:
            bias = _take(tensors, "experts.gate_up_proj_bias", (E, 2 * I))
            fields |= {
                "gate_bias": bias[:, 0::2],
                "up_bias": bias[:, 1::2],
                "down_bias": _take(tensors, "experts.down_proj_bias", (E, H)),
            }
        return fields
    names = _names(tensors)
    for p in PROJECTIONS:
        for e in range(E):
            prefix = f"experts.{e}.{names[p]}."
            for k, v in projection_from_hf(tensors, prefix, scheme, quant.source, *dims[p]).items():
                per.setdefault(f"{p}_{k}", []).append(np.asarray(v))  # (ascontiguousarray makes 0-d 1-d)
    fields = {name: np.stack(vs) for name, vs in per.items()}
    if cfg.expert_bias:
        for p in PROJECTIONS:
            fields[f"{p}_bias"] = np.stack(
                [_take(tensors, f"experts.{e}.{names[p]}.bias", (dims[p][0],)) for e in range(E)]
            )
    return fields


def format_to_hf_tensors(experts: Experts, quant: HfQuant) -> dict[str, np.ndarray]:
    """The inverse of `format_from_hf_tensors`: routed experts (either layout) -> checkpoint tensors (host numpy),
    keys relative to the block, in `quant.source`'s layout."""
    fmt = format_of(experts)
    if fmt is not quant.fmt:
        raise ValueError(f"experts are {fmt.__name__}, the checkpoint layout holds {quant.fmt.__name__}")
    stacked = as_stacked(experts)
    fields = {name: np.asarray(v) for name, v in stacked.fields().items()}
    E = stacked.num_experts
    scheme = fmt.scheme
    out: dict[str, np.ndarray] = {}
    if quant.source == "gpt-oss":
        for fused, parts in (("experts.gate_up_proj", ("gate", "up")), ("experts.down_proj", ("down",))):
            q = np.stack([fields[f"{p}_q"].transpose(0, 2, 1) for p in parts], axis=2)  # [E, out, parts, in/2]
            s = np.stack([fields[f"{p}_scale"].transpose(0, 2, 1) for p in parts], axis=2)
            n_out = q.shape[1] * len(parts)
            out[f"{fused}_blocks"] = np.ascontiguousarray(q.reshape(E, n_out, -1, 16))
            out[f"{fused}_scales"] = np.ascontiguousarray(s.reshape(E, n_out, -1))
        if "gate_bias" in fields:
            bias = np.stack([fields["gate_bias"], fields["up_bias"]], axis=-1).reshape(E, -1)
            out["experts.gate_up_proj_bias"] = bias
            out["experts.down_proj_bias"] = fields["down_bias"]
        return out
    names = dict(zip(PROJECTIONS, _PER_EXPERT_NAMES[0], strict=True))
    for p in PROJECTIONS:
        for e in range(E):
            one = {k.removeprefix(f"{p}_"): v[e] for k, v in fields.items() if k.startswith(f"{p}_")}
            bias = one.pop("bias", None)
            prefix = f"experts.{e}.{names[p]}."
            out |= projection_to_hf(one, prefix, scheme, quant.source)
            if bias is not None:
                out[f"{prefix}bias"] = bias
    return out


# -- qwix interop (optional: qwix is not a dependency) ------------------------------------------------------------


def to_qwix(experts: Experts) -> dict[str, Any]:
    """Routed experts -> `{"gate" | "up" | "down": qwix.QArray}`, each `[E, in, out]` (stacked).

    qwix 0.1.8 holds one unpacked code per element (`int8`, `int4`, `float8_e4m3fn`, `float4_e2m1fn` qvalues), a
    float scale tiled evenly over the array and a zero point of the qvalue's dtype: `w = (q - zp) · scale`.
    int8/int4 (symmetric or not) and MXFP4 convert exactly. NVFP4's two scales are multiplied into one float32 scale
    (rounded to float32). FP8 blocks convert when 128 divides both dims (qwix tiles evenly; partial edge blocks raise
    `NotImplementedError`). Biases are not part of a QArray.
    """
    from qwix._src.core.qarray import QArray  # qwix 0.1.8 exports QArray from here

    stacked = as_stacked(experts)
    s = getattr(stacked, "scheme", None)
    if s is None:
        raise TypeError(f"to_qwix takes quantized experts, got {type(stacked).__name__}")
    out = {}
    for p in PROJECTIONS:
        q = getattr(stacked, f"{p}_q")
        scale = getattr(stacked, f"{p}_scale")
        zero = getattr(stacked, f"{p}_zero")
        if s.kind == "fp8_block":
            if any(d % FP8_BLOCK for d in q.shape[1:]):
                raise NotImplementedError(f"{p}: qwix tiles evenly; FP8 {q.shape[1:]} has partial 128-blocks")
            out[p] = QArray(q, scale, None, jnp.float8_e4m3fn)
            continue
        codes = unpack_nibbles(q, axis=1) if s.packed else q  # [E, in, out]
        if s.kind == "int":
            signed = (codes.astype(jnp.int16) - (1 << (s.bits - 1))).astype(jnp.int8)
            qvalue = signed.astype(jnp.int4) if s.packed else signed
            zp = None if zero is None else zero.astype(qvalue.dtype)
            out[p] = QArray(qvalue, scale, zp, qvalue.dtype)
            continue
        qvalue = jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
        if s.kind == "mxfp4":
            sf = e8m0_to_f32(scale)
        else:
            sf = scale.astype(jnp.float32) * getattr(stacked, f"{p}_scale2")[:, None, None]
        out[p] = QArray(qvalue, sf, None, jnp.float4_e2m1fn)
    return out


def from_qwix(qarrays: Mapping[str, Any], fmt: type[QuantizedExperts]) -> QuantizedExperts:
    """The inverse of `to_qwix` for int8/int4 (symmetric or not), FP8 block and MXFP4 formats.

    Raises:
      ValueError: a QArray's qvalue dtype, scale tiling or zero point does not fit `fmt` (naming the projection).
    """
    s = fmt.scheme
    if s.kind == "nvfp4":
        raise NotImplementedError("NVFP4 keeps two scales; a qwix QArray has one (to_qwix multiplies them)")
    fields = {}
    for p in PROJECTIONS:
        qa = qarrays[p]
        qvalue, scale, zp = qa.qvalue, qa.scale, qa.zero_point
        E, n_in, n_out = qvalue.shape
        want = {"int": jnp.int8 if s.bits == 8 else jnp.int4, "fp8_block": jnp.float8_e4m3fn}.get(
            s.kind, jnp.float4_e2m1fn
        )
        if qvalue.dtype != want:
            raise ValueError(f"{p}: qvalue dtype {qvalue.dtype}, {fmt.__name__} needs {jnp.dtype(want)}")
        grid = (E, -(-n_in // FP8_BLOCK), -(-n_out // FP8_BLOCK)) if s.kind == "fp8_block" else None
        grid = grid or (E, n_in // s.group(n_in), n_out)
        if tuple(scale.shape) != grid:
            raise ValueError(f"{p}: scale shape {tuple(scale.shape)}, {fmt.__name__} needs {grid}")
        if (zp is not None) != (s.kind == "int" and not s.symmetric):
            raise ValueError(f"{p}: zero point {'given' if zp is not None else 'missing'} for {fmt.__name__}")
        if s.kind == "fp8_block":
            fields |= {f"{p}_q": qvalue, f"{p}_scale": scale.astype(jnp.float32)}
            continue
        if s.kind == "int":
            codes = (qvalue.astype(jnp.int16) + (1 << (s.bits - 1))).astype(jnp.uint8)
            fields[f"{p}_scale"] = scale.astype(jnp.float32)
            if zp is not None:
                fields[f"{p}_zero"] = zp.astype(jnp.int8)
        else:  # mxfp4: the float32 scale must be a power of two
            exp = jnp.frexp(scale.astype(jnp.float32))[1] - 1
            fields[f"{p}_scale"] = jnp.clip(exp + 127, 0, 254).astype(jnp.uint8)
            codes = jax.lax.bitcast_convert_type(qvalue, jnp.uint4).astype(jnp.uint8)
        fields[f"{p}_q"] = pack_nibbles(codes, axis=1) if s.packed else codes
    return fmt(**fields)
