"""Eager calls of the public entry points (`moe_forward`, `route`, `moe_forward_ep`) through a cached `jax.jit`.

Called outside jit, the entry points would run op by op: each `fori_loop`/`scan` of a plan traces a body
closing over that call's arrays, so every call compiled its loops again (50 calls, 50 compiles, ~0.5 s each)
and the compiled programs piled up in jax's caches (~3.5 MB per call). `cached_when_eager` sends such calls
through a `jax.jit` of the entry point: one program per (shapes, dtypes, shardings, static arguments), compiled
on the first call and reused after.

A call runs as written, with no jit of its own, when
  * an argument is traced (the caller's jit, grad or vmap compiles it with the rest of its program);
  * an argument holds something jit would change or reject: a Python scalar or list, a numpy array of a dtype
    jax narrows (float64, int64), a non-array object, or an unhashable value for a static argument. The body
    then raises its own error (or handles the value) exactly as before.
Errors the body raises while it is traced (shape, dtype and config checks) propagate unchanged through jit.
An eager call computes what the same call under the caller's jit computes; on a data-parallel mesh with Auto
axes that includes the choice of row split (x's type does not carry it under jit, `moejax.dispatch.rows`).

Each entry point keeps at most `max_programs()` compiled programs (default `MAX_PROGRAMS` = 32), the least
recently called dropped first, so that a server calling eagerly with a new row count per request does not keep
every program for the life of the process; a call whose program was dropped compiles it again. Row counts are
not padded to buckets instead: a padded batch runs other plans and other reduction trees than the unpadded one,
so a row's output would depend on the batch it came in (rows are batch-invariant only for a fixed row count), and
eager calls must give what jit gives. What this bounds is moejax's own share: jax itself keeps the traces of its
jnp functions at every new shape (`jax.clear_caches()` releases them), about as much again per row count (a
small block on CPU: ~3.7 MB per new row count without the bound, ~1.8 MB with it). Under the caller's own jit
nothing here applies: its programs are the caller's to keep.

Host integer ids (lists, numpy arrays) are converted to int32 before the cache, so their cache key is that of
an int32 array; values outside int32 are first clipped to its range, so an id of 2**32 + 1 stays out of range
(clamped to "no adapter" or the last token row, raised by `checked_moe_forward`) instead of wrapping to 1.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import jax
import numpy as np

from moejax.ids import clip_host_ids

F = TypeVar("F", bound=Callable[..., Any])

_INT32 = np.iinfo(np.int32)
MAX_PROGRAMS = 32  # compiled programs kept per entry point (module docstring); `set_max_programs` changes it
_max_programs = MAX_PROGRAMS


def max_programs() -> int:
    """How many compiled programs each entry point keeps for its eager calls."""
    return _max_programs


def set_max_programs(n: int) -> None:
    """Keep at most `n` (>= 1) compiled programs per entry point for eager calls; the least recently called
    beyond `n` are dropped at each entry point's next new program."""
    global _max_programs
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"max programs must be an integer >= 1, got {n!r}")
    _max_programs = n


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


def _leaf_key(leaf: Any) -> Hashable:
    """What of an array argument selects a compiled program: shape, dtype, weak type and sharding."""
    return (leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False), getattr(leaf, "sharding", None))


def _call_key(arguments: dict[str, Any], static: frozenset[str]) -> _Key | None:
    """The key of the program a call with these bound arguments runs through the cache (static values, the
    arrays' tree and leaves), or None when the call runs as written (see the module docstring)."""
    leaves, tree = jax.tree.flatten({name: value for name, value in arguments.items() if name not in static})
    if not all(map(_jit_keeps, leaves)):
        return None
    statics = tuple((name, value) for name, value in arguments.items() if name in static)
    key = (statics, tree, tuple(map(_leaf_key, leaves)))
    try:
        return _Key(key, hash(key))
    except TypeError:  # an unhashable static argument: the body sees it as given
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class _Key:
    """A call key with its hash computed once: hashing a config walks all its fields, and a lookup hashes twice."""

    key: tuple
    hash: int

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.key == other.key


class _Programs:
    """The compiled programs of one entry point's eager calls, least recently called first: one `jax.jit` per
    call key, each of a fresh wrapper of the function, so that dropping one releases what jax caches for it
    (its executable, and the traces and lowerings jax keys weakly on the function)."""

    def __init__(self, fn: Callable[..., Any], static: frozenset[str]):
        self._fn = fn
        self._static = tuple(static)
        self._jitted: collections.OrderedDict[_Key, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # concurrent eager callers share the cache

    def get(self, key: _Key) -> Any:
        with self._lock:
            jitted = self._jitted.get(key)
            if jitted is not None:
                self._jitted.move_to_end(key)
                return jitted
            fn = self._fn
            jitted = jax.jit(functools.wraps(fn)(lambda *a, **k: fn(*a, **k)), static_argnames=self._static)
            self._jitted[key] = jitted
            dropped = []
            while len(self._jitted) > _max_programs:
                dropped.append(self._jitted.popitem(last=False)[1])
        for old in dropped:
            old.clear_cache()
        return jitted

    def __len__(self) -> int:
        return len(self._jitted)

    def clear(self) -> None:
        with self._lock:
            dropped, self._jitted = list(self._jitted.values()), collections.OrderedDict()
        for old in dropped:
            old.clear_cache()


def cached_when_eager(static_argnames: Iterable[str], host_id_args: Iterable[str] = ()) -> Callable[[F], F]:
    """Decorate a public entry point: eager calls run through cached `jax.jit`s of it (module docstring).

    Args:
      static_argnames: the arguments that are static under jit (configs, modes, meshes, flags).
      host_id_args: integer-id arguments whose host values are converted by `host_ids` on every call.

    The decorated function keeps the signature and docstring; `fn.uncached` is the undecorated function,
    `fn.cached_programs()` the number of programs its eager calls keep (at most `max_programs()`), and
    `fn.clear_cache()` drops them.
    """
    static = frozenset(static_argnames)
    id_args = tuple(host_id_args)

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        programs = _Programs(fn, static)

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
            key = _call_key(arguments, static)
            if key is None:
                return fn(*bound.args, **bound.kwargs)
            return programs.get(key)(**arguments)

        call.uncached = fn
        call.cached_programs = programs.__len__
        call.clear_cache = programs.clear
        return call

    return decorate
