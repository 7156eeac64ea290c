"""`Local`: every row on the device at hand, every expert there too (no mesh)."""

from __future__ import annotations

import dataclasses

from moejax.dispatch.base import Dispatch
from moejax.stats import routing_stats


@dataclasses.dataclass(frozen=True)
class Local(Dispatch):
    """The pipeline as written: one device routes and computes all rows."""

    def run(self, body, operands, rows, *, cfg, with_stats):
        del cfg, with_stats
        return body(operands, rows)

    def routed_sum(self, step, x_e, slots, routing, *, cfg, num_tokens):
        del num_tokens
        return step(x_e, slots), routing_stats(routing, cfg)
