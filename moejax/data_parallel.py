"""Data parallelism of `moe_forward`: when x (or the parameters) live on a mesh, each device routes and computes
the rows it holds, with no gather of x.

`moe_forward` is a per-row function (a row's output depends only on that row, see the batch-invariance note in
the README), so splitting the rows over devices changes nothing but where they are computed. The plans inside
are not sharding-aware (a sort over all pairs, loops whose buffers carry one sharding), so on a mesh the forward
runs inside one `shard_map` over all mesh axes, where every array is a plain per-device array:

  1. The row axes: on a mesh with Explicit axes (`jax.make_mesh`'s default) and for concrete arrays, the axes x's
     own sharding splits its leading dims over; for a traced x on an Auto mesh (its type does not say how it
     is split), the leading mesh axes whose sizes divide the number of rows (XLA moves a data-split x to that
     split without a gather: it is the same split, or a finer one).
  2. x in, out over the row axes; parameters and token ids replicated (`P()`: a sharded parameter is gathered,
     as `moe_forward` needs every expert). Devices along the other axes compute the same rows.

Expert parallelism (experts split over a mesh axis) is `moejax.parallel.moe_forward_ep`; this module only
splits rows. It lives apart from `moejax.parallel` because that module builds on `moejax.forward`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

Array = jax.Array


def _array_placement(a) -> tuple[object, P | None] | None:
    """(mesh, spec) of array `a` when it lives on a mesh of more than one device; spec None when unknown."""
    if a is None or not hasattr(a, "shape"):
        return None
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh, sharding.spec
        return None
    try:
        sharding = jax.typeof(a).sharding
    except (AttributeError, TypeError):
        return None
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty or sharding.mesh.size <= 1:
        return None
    if any(t == AxisType.Manual for t in sharding.mesh.axis_types):  # inside a shard_map: already per device
        return None
    explicit = all(t == AxisType.Explicit for t in sharding.mesh.axis_types)
    return sharding.mesh, (sharding.spec if explicit else None)


def _row_spec(spec: P | None, mesh, shape: tuple[int, ...]) -> P:
    """The PartitionSpec of x `[..., H]` inside the shard_map: its own leading-dim split (H never split), or for
    an unknown split the leading mesh axes whose sizes divide the rows, on the first dim."""
    ndim = len(shape)
    if spec is not None:
        entries = tuple(spec) + (None,) * (ndim - len(spec))
        return P(*entries[: ndim - 1], None)
    axes, size = [], 1
    for name in mesh.axis_names:
        if shape[0] % (size * mesh.shape[name]):
            break
        axes.append(name)
        size *= mesh.shape[name]
    return P(tuple(axes) if axes else None, *(None,) * (ndim - 1))


def mesh_of(params, x: Array, token_ids: Array | None):
    """The mesh `moe_forward`'s inputs live on (x first, then the parameters), or None on one device."""
    for a in (x, token_ids, *jax.tree.leaves(params)):
        found = _array_placement(a)
        if found is not None:
            return found[0]
    return None


def over_rows(
    forward: Callable[..., Any],
    params,
    x: Array,
    token_ids: Array | None,
    mesh,
    *,
    with_stats: bool = False,
    adapter_ids: Array | None = None,
) -> Any:
    """`forward(params, x, token_ids)` (a per-row function `[..., H] -> [..., H]`) with x's rows split over the
    mesh as in the module docstring. Jit-able. With `with_stats`, `forward` returns `(y, MoEStats)` and the
    statistics are summed over the mesh axes the rows are split over (one call, not one per shard). With
    `adapter_ids` (LoRA ids, shaped like token_ids), `forward(params, x, token_ids, adapter_ids)`, the ids split
    with the rows; `params` may be any pytree (replicated), e.g. `(params, lora)`."""
    placed = _array_placement(x)
    spec = placed[1] if placed is not None else P()
    x_spec = _row_spec(spec, mesh, tuple(x.shape))
    tid_spec = P(*tuple(x_spec)[:-1])
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    param_specs = jax.tree.map(lambda _: P(), params)
    if explicit:  # array types carry their sharding and must equal the in_specs: reshard (no-op when equal)

        def place(a, s):
            return jax.sharding.reshard(a, NamedSharding(mesh, s))

        params = jax.tree.map(place, params, param_specs)
        x = place(x, x_spec)
        token_ids = None if token_ids is None else place(token_ids, tid_spec)
        adapter_ids = None if adapter_ids is None else place(adapter_ids, tid_spec)
    row_args = (token_ids,) if adapter_ids is None else (token_ids, adapter_ids)
    out_specs = x_spec
    if with_stats:
        row_axes = tuple(a for entry in tuple(x_spec)[:-1] if entry for a in _names(entry))
        forward = functools.partial(_summed_stats, forward, row_axes=row_axes)
        out_specs = (x_spec, P())
    fn = jax.shard_map(
        forward,
        mesh=mesh,
        in_specs=(param_specs, x_spec, *(tid_spec,) * len(row_args)),
        out_specs=out_specs,
        check_vma=False,
    )
    return fn(params, x, *row_args)


def _names(entry) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry."""
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _summed_stats(forward: Callable[..., Any], params, x, *row_args, row_axes: tuple[str, ...]):
    """`forward`'s `(y, stats)` with the stats summed over the row shards, as one call: the union is that of the
    summed expert load (the distinct experts the whole batch chose), not a sum of the shards' unions."""
    y, stats = forward(params, x, *row_args)
    if row_axes:
        summed = jax.lax.psum(stats, row_axes)
        union = jnp.sum(summed.expert_load > 0, dtype=jnp.int32)
        stats = dataclasses.replace(summed, calls=stats.calls, union_size=union)
    return y, stats
