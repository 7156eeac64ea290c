"""The extension points take a new piece from outside the library: here a dispatch mode (`moejax.dispatch`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.dispatch import Dispatch
from moejax.stats import routing_stats


@dataclasses.dataclass(frozen=True)
class Halves(Dispatch):
    """A dispatch mode written outside the library: the pipeline on each half of the rows, one after the other."""

    def run(self, body, operands, rows, *, cfg, with_stats):
        half = rows["x"].shape[0] // 2
        parts = [
            body(operands, jax.tree.map(lambda a, s=s: a[s], rows)) for s in (slice(None, half), slice(half, None))
        ]
        outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), parts[0][0], parts[1][0])
        return outputs, (parts[0][1] + parts[1][1]) if with_stats else None

    def routed_sum(self, step, x_e, slots, routing, *, cfg, num_tokens):
        return step(x_e, slots), routing_stats(routing, cfg)


def test_a_dispatch_mode_from_outside_the_library_equals_the_local_one():
    cfg = moejax.MoEConfig.preset("longcat_flash")  # zero experts: the once-terms run inside each half too
    params = moejax.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4, cfg.hidden_size))
    y, stats = moejax.moe_forward(params, x, cfg, impl="xla", dispatch=Halves(), return_stats=True)
    local, local_stats = moejax.moe_forward(params, x, cfg, impl="xla", return_stats=True)
    np.testing.assert_allclose(y, local, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(stats.expert_load, local_stats.expert_load)
    assert int(stats.calls) == 2  # one per half: the mode's own statistics
