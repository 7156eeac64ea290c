"""`Rows`: data parallelism. On a mesh each device routes and computes the rows of x it holds, with no gather of x.

The forward is a per-row function, so splitting the rows over devices changes nothing but where they are
computed. The plans inside are not sharding-aware, so the pipeline runs inside one `shard_map` over all mesh axes:

  1. The row axes: on a mesh with Explicit axes and for concrete arrays, the axes x's own sharding splits its
     leading dims over; for a traced x on an Auto mesh (its type does not say how it is split), the leading mesh
     axes whose sizes divide the number of rows (XLA moves a data-split x to that split without a gather).
  2. The per-row operands split over the row axes; the parameters replicated (`P()`: a sharded parameter is
     gathered, every expert is needed). Devices along the other axes compute the same rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.dispatch.local import Local
from moejax.sharding import match_specs, shard_map


@dataclasses.dataclass(frozen=True)
class Rows(Local):
    """Rows split over `mesh` (None: the mesh the inputs live on; on none, `Local`). Each device runs the local
    pipeline; the statistics are summed over the row shards (the union is that of the whole batch)."""

    mesh: Mesh | None = None

    def run(self, body, operands, rows, *, cfg, with_stats):
        mesh = self.mesh if self.mesh is not None else mesh_of(operands, rows["x"], rows.get("token_ids"))
        if mesh is None:
            return body(operands, rows)
        x = rows["x"]
        placed = _array_placement(x)
        x_spec = _row_spec(placed[1] if placed is not None else P(), mesh, tuple(x.shape))
        row_spec = P(*tuple(x_spec)[:-1])  # a prefix: every per-row operand splits its leading dims like x
        in_specs = (P(), row_spec)
        operands, rows = match_specs((operands, rows), in_specs, mesh)
        if with_stats:
            row_axes = tuple(a for entry in tuple(row_spec) if entry for a in _names(entry))
            body = functools.partial(_summed_stats, body, row_axes=row_axes)
        return shard_map(body, mesh, in_specs, (row_spec, P()))(operands, rows)


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


def mesh_of(operands, x, token_ids=None):
    """The mesh the forward's inputs live on (x first, then the operands), or None on one device."""
    for a in (x, token_ids, *jax.tree.leaves(operands)):
        found = _array_placement(a)
        if found is not None:
            return found[0]
    return None


def _names(entry) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry."""
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _summed_stats(body, operands, rows, *, row_axes: tuple[str, ...]):
    """`body`'s `(outputs, stats)` with the stats summed over the row shards, as one call: the union is that of the
    summed expert load (the distinct experts the whole batch chose), not a sum of the shards' unions."""
    outputs, stats = body(operands, rows)
    if row_axes:
        summed = jax.lax.psum(stats, row_axes)
        union = jnp.sum(summed.expert_load > 0, dtype=jnp.int32)
        stats = dataclasses.replace(summed, calls=stats.calls, union_size=union)
    return outputs, stats
