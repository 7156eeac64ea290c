"""The protocol every dispatch mode implements: where the rows of one MoE call go, and how the routed sum of
their (token, slot) pairs comes back. `moejax.forward` runs the one pipeline around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from moejax.config import MoEConfig
from moejax.routing import Routing
from moejax.slots import Slots
from moejax.stats import MoEStats

Array = jax.Array
# body(operands, rows) -> (outputs, stats | None): the pipeline on the rows one device holds. `operands` is the
# replicated pytree `(params, adapters)`; `rows` a dict of per-row arrays whose leading dims are x's (`rows["x"]`
# is x itself); `outputs` a dict of per-row arrays with the same leading dims.
Body = Callable[[Any, dict[str, Array]], tuple[dict[str, Array], MoEStats | None]]
# step(x_e [R, H], slots [R, K], *, num_pairs=None) -> [R, H] float32: the pipeline's expert step (with the
# experts it holds, `step.num_experts` of them).
Step = Callable[..., Array]


class Dispatch:
    """A dispatch mode: subclasses are frozen, hashable dataclasses (static under jit), one module each.

    The pipeline calls, in order:
      1. `check(operands, cfg, impl)` at trace time: `(operands to run, operands to check the inputs against)`.
      2. `run(body, operands, rows, cfg=..., with_stats=...)`: `body` on the devices and rows the mode chooses
         (directly, or inside a `shard_map`), returning its per-row outputs for all rows and the call's stats.
      3. Inside `body`, once per device: `routed_sum(step, x_e, slots, routing, cfg=..., num_tokens=...)`: the
         routed sum `[R, H]` float32 of this device's rows, fully reduced, and this device's `MoEStats`.
      4. `reduce_shared`: None, or the reduction of the shared expert's partial sums (a split intermediate axis).
    """

    @property
    def num_devices(self) -> int:
        """n of the per-device `MoEStats` fields (1: one device holds every expert)."""
        return 1

    @property
    def reduce_shared(self) -> Callable[[Array], Array] | None:
        return None

    def check(self, operands: Any, cfg: MoEConfig, impl: str) -> tuple[Any, Any]:
        """Trace-time checks of the mode; `(operands to run, a view of them for the input checks)`."""
        del cfg, impl
        return operands, operands

    def run(
        self, body: Body, operands: Any, rows: dict[str, Array], *, cfg: MoEConfig, with_stats: bool
    ) -> tuple[dict[str, Array], MoEStats | None]:
        raise NotImplementedError(f"{type(self).__name__}.run")

    def routed_sum(
        self, step: Step, x_e: Array, slots: Slots, routing: Routing, *, cfg: MoEConfig, num_tokens: int
    ) -> tuple[Array, MoEStats]:
        raise NotImplementedError(f"{type(self).__name__}.routed_sum")
