"""Dispatch modes: where the rows of an MoE call go and how their routed sum comes back, one module each.

`moejax.moe_forward(..., dispatch=mode)` runs any of them (default: `Local`, or `Rows` when the inputs live on a
mesh); `moejax.MoE` picks one at construction. A new mode is a frozen dataclass implementing `Dispatch`.
"""

from __future__ import annotations

from typing import Literal

from moejax.dispatch.base import Dispatch
from moejax.dispatch.ep import ExpertParallel
from moejax.dispatch.ep_all_to_all import CAPACITY_FACTOR, EPAllToAll, all_to_all_capacity, check_capacity_factor
from moejax.dispatch.ep_psum import EPPsum, localize
from moejax.dispatch.local import Local
from moejax.dispatch.rows import Rows, mesh_of

EPMode = Literal["replicated", "all_to_all"]
EP_MODES = ("replicated", "all_to_all")

__all__ = [
    "CAPACITY_FACTOR",
    "EP_MODES",
    "Dispatch",
    "EPAllToAll",
    "EPMode",
    "EPPsum",
    "ExpertParallel",
    "Local",
    "Rows",
    "all_to_all_capacity",
    "expert_parallel",
    "localize",
    "mesh_of",
]


def expert_parallel(
    mode: EPMode,
    mesh,
    *,
    expert_axis: str = "expert",
    tensor_axis: str | None = None,
    placement=None,
    capacity_factor: float = CAPACITY_FACTOR,
    transport: str = "auto",
) -> ExpertParallel:
    """The EP dispatch of `mode` ("replicated": `EPPsum`, "all_to_all": `EPAllToAll` with `capacity_factor` and
    `transport`). Raises `ValueError` for an unknown mode, a capacity_factor that is not a finite number > 0, or
    an unknown transport."""
    if mode not in EP_MODES:
        raise ValueError(f"mode={mode!r} is not one of {EP_MODES}")
    check_capacity_factor(capacity_factor)
    if mode == "replicated":
        return EPPsum(mesh, expert_axis, tensor_axis, placement)
    return EPAllToAll(mesh, expert_axis, tensor_axis, placement, capacity_factor, transport)
