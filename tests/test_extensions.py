"""The extension points take new pieces from outside the library, with no change to library code: an expert backend
registered here (`moejax.backends.register`), a weight format declared here (an `ExpertFormat` subclass) running
through it and through the XLA plans, with and without LoRA adapters, and a dispatch mode written here (a
`moejax.dispatch.Dispatch`); last, all three together in one call."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import backends
from moejax.backends.reference import reference_routed
from moejax.dispatch import Dispatch
from moejax.lora import LoRAPair, _target_shapes, from_pairs, stack
from moejax.slots import Slots
from moejax.stats import routing_stats
from moejax.weights import ArraySpec, ExpertFormat, ExpertWeights

Array = jax.Array
forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


def halves(experts, x: Array, slots: Slots, act, *, block_rows=None) -> Array:
    """A backend: the reference on the first and the second half of the rows apart (an even number of rows)."""
    del block_rows
    T = x.shape[0]
    if T % 2:
        raise NotImplementedError(f"halves: serves an even number of rows, got T={T}")
    part = lambda v, rows: None if v is None else v[rows]
    run = lambda rows: reference_routed(experts, x[rows], jax.tree.map(lambda v: part(v, rows), slots), act)
    return jnp.concatenate([run(slice(0, T // 2)), run(slice(T // 2, T))])


@pytest.fixture
def registered():
    backends.register(backends.Backend("halves", halves))
    yield "halves"
    backends.unregister("halves")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledExperts(ExpertFormat):
    """A weight format declared in the test: float weights `[in, out]` times one float32 scale per expert."""

    gate: Array  # [E, H, I]
    up: Array  # [E, H, I]
    down: Array  # [E, I, H]
    scale: Array  # [E] float32

    @classmethod
    def declare(cls, cfg):
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        scale_init = lambda key, shape, dtype: 1 + jax.random.uniform(key, shape, jnp.float32)
        return {
            "gate": ArraySpec((E, H, I), ("expert", "embed", "mlp")),
            "up": ArraySpec((E, H, I), ("expert", "embed", "mlp")),
            "down": ArraySpec((E, I, H), ("expert", "mlp", "embed")),
            "scale": ArraySpec((E,), ("expert",), "float32", scale_init),
        }

    def gate_up(self, x):
        x = x.astype(jnp.float32)
        return jnp.dot(x, self.gate) * self.scale, jnp.dot(x, self.up) * self.scale

    def down_proj(self, h):
        return jnp.dot(h, self.down) * self.scale

    def dequantize(self):
        s = self.scale[..., None, None]
        return ExpertWeights(self.gate * s, self.up * s, self.down * s)


def _setup(T, fmt=ScaledExperts):
    cfg = moejax.MoEConfig.preset("qwen2_moe", num_experts=8, top_k=2)  # softmax router, sigmoid-gated shared
    params = moejax.init_params(cfg, jax.random.key(0), fmt=fmt, layout="stacked")
    x = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size))
    return cfg, params, x


def _lora(cfg):
    """A stack of one random adapter on every target (B not zero, so that the deltas show)."""
    rng, pairs = np.random.default_rng(0), {}
    for name, (lead, n_in, n_out) in _target_shapes(cfg).items():
        a = rng.standard_normal((*lead, 2, n_in), np.float32) / np.sqrt(n_in)
        pairs[name] = LoRAPair(jnp.asarray(a), jnp.asarray(rng.standard_normal((*lead, n_out, 2), np.float32)), 0.5)
    return stack([from_pairs(pairs)])


def test_a_backend_registered_in_the_test_runs_under_moe_forward(registered):
    cfg, params, x = _setup(4)
    assert registered in moejax.IMPLS and registered not in backends.candidates("auto", 4, cfg.top_k)
    got = forward(params, x, cfg, None, registered)
    np.testing.assert_allclose(got, forward(params, x, cfg, None, "reference"), rtol=1e-6, atol=1e-6)
    with pytest.raises(NotImplementedError, match="halves: serves an even number of rows"):
        moejax.moe_forward(params, x[:3], cfg, impl=registered)


def test_unregistered_backend_is_gone():
    backends.register(backends.Backend("halves", halves))
    with pytest.raises(ValueError, match="'halves' is taken"):
        backends.register(backends.Backend("halves", halves))
    backends.unregister("halves")
    assert "halves" not in moejax.IMPLS
    cfg, params, x = _setup(2, ExpertWeights)
    with pytest.raises(ValueError, match="impl='halves' is not one of"):
        moejax.moe_forward(params, x, cfg, impl="halves")


@pytest.mark.parametrize(("impl", "T"), [("halves", 4), ("xla_decode", 4), ("xla_grouped", 12)])
def test_a_format_declared_in_the_test_runs_through_the_new_backend_and_the_plans(registered, impl, T):
    cfg, params, x = _setup(T)
    dense = dataclasses.replace(params, experts=params.experts.dequantize())
    want = forward(dense, x, cfg, None, "reference")
    np.testing.assert_allclose(forward(params, x, cfg, None, impl), want, rtol=2e-5, atol=2e-5)
    assert float(jnp.max(jnp.abs(want))) > 0.1  # not a vacuous comparison
    # LoRA wraps the new format as any other: each row's adapter deltas on the format's own projections
    lora, ids = _lora(cfg), jnp.arange(T, dtype=jnp.int32) % 2
    want = forward(dense, x, cfg, None, "reference", lora=lora, adapter_ids=ids)
    got = forward(params, x, cfg, None, impl, lora=lora, adapter_ids=ids)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    plain = forward(params, x, cfg, None, impl)
    np.testing.assert_array_equal(got[0::2], plain[0::2])  # adapter id 0: the base output bit for bit
    assert not np.allclose(got[1::2], plain[1::2], atol=1e-3)  # rows with adapter 1 changed


@dataclasses.dataclass(frozen=True)
class HalvesDispatch(Dispatch):
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
    halves = moejax.moe_forward(params, x, cfg, impl="xla", dispatch=HalvesDispatch(), return_stats=True)
    local = moejax.moe_forward(params, x, cfg, impl="xla", return_stats=True)
    np.testing.assert_allclose(halves.y, local.y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(halves.stats.expert_load, local.stats.expert_load)
    assert int(halves.stats.calls) == 2  # one per half: the mode's own statistics


def test_a_format_backend_and_dispatch_mode_from_the_test_together(registered):
    """The test's weight format, through the test's backend, under the test's dispatch mode: the dense reference."""
    cfg, params, x = _setup(8)
    dense = dataclasses.replace(params, experts=params.experts.dequantize())
    want = forward(dense, x, cfg, None, "reference")
    got = moejax.moe_forward(params, x, cfg, impl=registered, dispatch=HalvesDispatch())
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert float(jnp.max(jnp.abs(want))) > 0.1
