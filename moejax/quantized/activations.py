"""int8 activations for int8 and 4-bit weights (`Scheme.activations == "int8"`): the definition, once, in plain jnp.

An explicit opt-in (never a default): the native CPU kernels (csrc/act8.h) then multiply int8 activations with
the weight codes in integers (`vpdpbusd` with VNNI, `vpmaddubsw` / `vpmaddwd` on AVX2) instead of converting every
code to float32.
The semantics, which every implementation follows (the reference and the XLA plans run this function; the Pallas
kernels raise `NotImplementedError`, ragged_dot takes no quantized weights):

  1. each row's input to each projection (x for gate and up, the activation output h for down) is cut into groups
     of `Scheme.activation_group` inputs along `in` (the weight's group; 32 for per-channel int4; a projection's
     last group may be partial);
  2. per group `s = max|x_g| / 127` (float32), `q = round_half_even(x / s)` in [-127, 127] (0 where s = 0); a
     group holding NaN or inf gives NaN;
  3. the weight-only math runs on `q · s` (float32).

The error this adds, measured by `benchmarks/act8_bench.py` (H=2048, I=768 like Qwen3-30B-A3B, top-8 of 16
experts, 64 rows, random normal weights and inputs; "outliers": 8 channels of every row at 30x): the relative
Frobenius error of the routed output with int8 activations against the same 4-bit weights with float32
activations is 1.6e-2 (normal) / 3.5e-2 (outliers) for int4 g128, symmetric or not; 1.2e-2 / 1.9e-2 for MXFP4;
0.97e-2 / 1.4e-2 for NVFP4 (finer groups, finer activation scales). The 4-bit weights themselves are 1.7-2.1e-1
from the float32 weights on the same inputs: the option adds 5-20% to the quantization error already there.
The speed (decode T=1, the kernels alone): docs/FORMATS.md "int8 activations".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
INT8_MAX = 127.0


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def int8_activations(x: Array, group: int) -> Array:
    """`x [R, n]` -> float32 `[R, n]`: each group of `group` inputs quantized to int8 and back (`q · s`).

    Symmetric, `s = max|x_g| / 127`, round-half-to-even, the module docstring's steps 1-2. Gradients pass straight
    through (the straight-through estimator of qwix / AQT's fake quantization): the backward of every backend is
    the reference's, and the rounding's own derivative is zero almost everywhere.
    """
    x = x.astype(jnp.float32)
    R, n = x.shape
    pad = -n % group
    xg = jnp.pad(x, ((0, 0), (0, pad))).reshape(R, -1, group)  # [R, G, group]; zeros never raise a group's max
    scale = jnp.max(jnp.abs(xg), axis=-1, keepdims=True) / INT8_MAX  # NaN in the group: NaN; inf: inf
    q = jnp.where(scale > 0, jnp.clip(jnp.round(xg / scale), -INT8_MAX, INT8_MAX), 0.0)
    deq = jnp.where(jnp.isfinite(scale), q * scale, jnp.nan)  # NaN or inf in a group: the whole group NaN
    return deq.reshape(R, -1)[:, :n]


@int8_activations.defjvp
def _straight_through(group, primals, tangents):
    (x,), (dx,) = primals, tangents
    return int8_activations(x, group), dx.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Int8Inputs:
    """One expert's dense float32 weights whose projections take int8-quantized inputs: the reference form of a
    quantized expert with `activations="int8"` (what `moejax.backends.reference` computes with)."""

    dense: Any  # ExpertWeights, one expert, float32
    group: int  # Scheme.activation_group

    @property
    def padded_rows(self) -> int:
        return 1

    def gate_up(self, x: Array) -> tuple[Array, Array]:
        return self.dense.gate_up(int8_activations(x, self.group))

    def down_proj(self, h: Array) -> Array:
        return self.dense.down_proj(int8_activations(h, self.group))

    def ffn(self, x: Array, act) -> Array:
        gate, up = self.gate_up(x)
        return self.down_proj(act(gate, up))

    def dequantize(self) -> Int8Inputs:
        return self
