"""Random normal draws for `init_params`: the values of `jax.random.normal`, with fewer compiles when eager.

Eager `jax.random.normal(key, shape)` compiles one program per shape (threefry and the inverse error function:
~0.2 CPU s each), so a new small config cost ~2 CPU s of compiles in `init_params` (the test suite makes
hundreds). Threefry's counter is the element's flat index (`jax_threefry_partitionable`, the default), so the
first n values of a draw of any longer 1-D shape are the n values of `shape`: a small draw is cut on the host
from a draw of a power-of-two length, one compile per length. Scaled and cast on the host too, bit for bit as
the eager ops did: numpy's float32 operations (a Python scalar operand is taken as float32) and ml_dtypes' casts
round as XLA's do, and a division by a constant is XLA's product with the float32 reciprocal (`divided`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_HOST_MAX = 1 << 20  # larger draws run as one program of their own shape (no padding, no host copy)
_MIN_LENGTH = 256


def standard_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array | np.ndarray:
    """`jax.random.normal(key, shape, float32)`: a numpy array for a small draw with a concrete key, else the
    jax array itself (inside `jit`, or a large shape)."""
    n = math.prod(shape)
    if isinstance(key, jax.core.Tracer) or n > _HOST_MAX or not jax.config.jax_threefry_partitionable:
        return jax.random.normal(key, shape, jnp.float32)
    length = max(_MIN_LENGTH, 1 << max(n - 1, 0).bit_length())
    return np.asarray(jax.random.normal(key, (length,), jnp.float32))[:n].reshape(shape)


def divided(values: jax.Array | np.ndarray, divisor: float) -> jax.Array | np.ndarray:
    """`values / divisor` as eager XLA computes it: on the host, times the float32 reciprocal of the float32
    divisor (XLA's simplifier turns a division by a constant into that product)."""
    if isinstance(values, np.ndarray):
        return values * (np.float32(1.0) / np.float32(divisor))
    return values / divisor


def as_array(values: jax.Array | np.ndarray, dtype: Any) -> jax.Array:
    """`values` cast to `dtype`, on the host when they are there, as a jax array."""
    if isinstance(values, np.ndarray):
        return jnp.asarray(values.astype(jnp.dtype(dtype)))
    return values.astype(dtype)
