"""Eager calls of the public entry points (`moe_forward`, `route`, `moe_forward_ep`) through a cached `jax.jit`.

Called outside jit, the entry points would run op by op: each `fori_loop`/`scan` of a plan traces a body
closing over that call's arrays, so every call compiled its loops again (50 calls, 50 compiles, ~0.5 s each)
and the compiled programs piled up in jax's caches (~3.5 MB per call). `cached_when_eager` sends such calls
through one `jax.jit` of the entry point: one program per (shapes, dtypes, shardings, static arguments), compiled
on the first call and reused after.

A call runs as written, with no jit of its own, when
  * an argument is traced (the caller's jit, grad or vmap compiles it with the rest of its program);
  * an argument holds something jit would change or reject: a Python scalar or list, a numpy array of a dtype
    jax narrows (float64, int64), a non-array object, or an unhashable value for a static argument. The body
    then raises its own error (or handles the value) exactly as before.
Errors the body raises while it is traced (shape, dtype and config checks) propagate unchanged through jit.
An eager call computes what the same call under the caller's jit computes; on a data-parallel mesh with Auto
axes that includes the choice of row split (x's type does not carry it under jit, `moejax.dispatch.rows`).

Host integer ids (lists, numpy arrays) are converted to int32 before the cache, so their cache key is that of
an int32 array; values outside int32 are first clipped to its range, so an id of 2**32 + 1 stays out of range
(clamped to "no adapter" or the last token row, raised by `checked_moe_forward`) instead of wrapping to 1.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax
import numpy as np

from moejax.ids import clip_host_ids

F = TypeVar("F", bound=Callable[..., Any])

_INT32 = np.iinfo(np.int32)


def host_ids(ids: Any) -> Any:
    """Host integer ids (a list, tuple, numpy array or scalar) as an int32 numpy array, values beyond int32
    clipped to its range first (never wrapped; `moejax.ids.clip_host_ids`). Device arrays, tracers, None,
    non-integer values and ragged lists unchanged: the body's own check sees them."""
    try:
        return clip_host_ids("ids", ids, int(_INT32.min), int(_INT32.max))
    except (TypeError, ValueError):
        return ids


def _jit_keeps(leaf: Any) -> bool:
    """Whether jit passes `leaf` to the traced body as the same array: a concrete jax array, or a numpy array of
    a dtype jax keeps (not float64/int64, which jit would narrow without the body seeing them)."""
    if isinstance(leaf, jax.core.Tracer):
        return False
    if isinstance(leaf, jax.Array):
        return True
    if not isinstance(leaf, np.ndarray) or leaf.dtype.kind not in "biufc":
        return False
    return leaf.dtype == jax.dtypes.canonicalize_dtype(leaf.dtype)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _cacheable(arguments: dict[str, Any], static: frozenset[str]) -> bool:
    """Whether a call with these bound arguments may run through the cached jit (see the module docstring)."""
    for name, value in arguments.items():
        if name in static:
            if not _hashable(value):
                return False
        elif not all(_jit_keeps(leaf) for leaf in jax.tree.leaves(value)):
            return False
    return True


def cached_when_eager(static_argnames: Iterable[str], host_id_args: Iterable[str] = ()) -> Callable[[F], F]:
    """Decorate a public entry point: eager calls run through one cached `jax.jit` of it (module docstring).

    Args:
      static_argnames: the arguments that are static under jit (configs, modes, meshes, flags).
      host_id_args: integer-id arguments whose host values are converted by `host_ids` on every call.

    The decorated function keeps the signature and docstring; `fn.uncached` is the undecorated function.
    """
    static = frozenset(static_argnames)
    id_args = tuple(host_id_args)

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        jitted = jax.jit(fn, static_argnames=tuple(static))

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # a wrong call: Python's own error, from the function itself
                return fn(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            for name in id_args:
                arguments[name] = host_ids(arguments[name])
            if _cacheable(arguments, static):
                return jitted(**arguments)
            return fn(*bound.args, **bound.kwargs)

        call.uncached = fn
        return call

    return decorate
