"""Host integer ids to int32 without wrapping: the one clip used by eager calls (`moejax.eager.host_ids`, to int32's
range before the jit cache), adapter ids (`moejax.lora.as_adapter_ids`, to [-1, n]) and token ids
(`moejax.routing.as_token_ids`, to [-1, vocab_size]).

A cast to int32 wraps (2**32 + 1 becomes 1, a valid id); clipping first, in the ids' own integer type, keeps an
out-of-range id out of range, so that inside jit it clamps to its documented value and `checked_moe_forward`
raises for it. Device arrays and tracers are clamped by their owners inside the program, in their own type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HOST_IDS = (list, tuple, np.ndarray, np.integer, int)  # what counts as host ids (a bool is an int: refused below)


def clip_host_ids(name: str, ids: Any, low: int, high: int) -> np.ndarray:
    """Host ids (a list, tuple, Python or numpy integer, numpy array) as an int32 numpy array of the same shape,
    each value clipped to [low, high] before the cast: Python ints exactly (numpy would turn [-1, 2**63] into
    float64 and 2**64 into an object), numpy arrays in their own integer type.
    `low` and `high` must lie in int32's range.

    Raises:
      TypeError: naming `name`, for values that are not integers (bools included) or ids of another type.
      ValueError: naming `name`, for a ragged list.
    """
    if isinstance(ids, bool) or not isinstance(ids, HOST_IDS):
        raise TypeError(f"{name} must be integers, got {type(ids).__name__}")
    if isinstance(ids, list | tuple | int):
        try:
            shape = np.shape(ids)
        except ValueError as err:
            raise ValueError(f"{name} must be a rectangular list of ints, got a ragged one") from err
        flat = np.asarray(ids, dtype=object).reshape(-1).tolist()
        if not all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in flat):
            raise TypeError(f"{name} must be integers, got {sorted({type(v).__name__ for v in flat})}")
        return np.array([min(max(int(v), low), high) for v in flat], np.int32).reshape(shape)
    host = np.asarray(ids)
    if host.size == 0:
        return host.astype(np.int32)
    if not np.issubdtype(host.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {host.dtype}")
    info = np.iinfo(host.dtype)  # the bounds within the ids' own type (numpy refuses a bound it cannot hold)
    return np.clip(host, max(low, info.min), min(high, info.max)).astype(np.int32)
