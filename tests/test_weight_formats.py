"""The weight-format interface: a format defined here, in the test, runs through every plan, the reference, expert
parallelism (both modes) and the nnx module with no change to library code; the layouts; the declared checks."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from tables import table

import moejax
from moejax import parallel, sharding
from moejax.params import array_specs, with_experts_layout
from moejax.slots import expert_activation
from moejax.weights import (
    ArraySpec,
    ExpertFormat,
    ExpertWeights,
    FusedExpertWeights,
    PerExpert,
    check_experts,
    to_layout,
)

Array = jax.Array


def _int8_init(key, shape, dtype):
    return jax.random.randint(key, shape, -127, 128, dtype=jnp.int32).astype(jnp.int8)


def _scale_init(fan_in):
    def init(key, shape, dtype):  # |w| ~ 1/sqrt(fan_in), like the dense init
        return (1 + 0.1 * jax.random.uniform(key, shape, jnp.float32)) / (73.0 * fan_in**0.5)

    return init


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8PerChannel(ExpertFormat):
    """int8 weights `[in, out]` with a float32 scale per output channel: `w = q · scale[out]`."""

    gate_q: Array  # [E, H, I] int8
    gate_scale: Array  # [E, I] float32
    up_q: Array
    up_scale: Array
    down_q: Array  # [E, I, H] int8
    down_scale: Array  # [E, H] float32

    @classmethod
    def declare(cls, cfg):
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        return {
            "gate_q": ArraySpec((E, H, I), ("expert", "embed", "mlp"), "int8", _int8_init),
            "gate_scale": ArraySpec((E, I), ("expert", "mlp"), "float32", _scale_init(H)),
            "up_q": ArraySpec((E, H, I), ("expert", "embed", "mlp"), "int8", _int8_init),
            "up_scale": ArraySpec((E, I), ("expert", "mlp"), "float32", _scale_init(H)),
            "down_q": ArraySpec((E, I, H), ("expert", "mlp", "embed"), "int8", _int8_init),
            "down_scale": ArraySpec((E, H), ("expert", "embed"), "float32", _scale_init(I)),
        }

    def gate_up(self, x):
        x = x.astype(jnp.float32)
        gate = jnp.dot(x, self.gate_q.astype(jnp.float32)) * self.gate_scale
        up = jnp.dot(x, self.up_q.astype(jnp.float32)) * self.up_scale
        return gate, up

    def down_proj(self, h):
        return jnp.dot(h, self.down_q.astype(jnp.float32)) * self.down_scale

    def dequantize(self):
        def w(q, scale):
            return q.astype(jnp.float32) * scale[..., None, :]

        return ExpertWeights(
            w(self.gate_q, self.gate_scale), w(self.up_q, self.up_scale), w(self.down_q, self.down_scale)
        )


def _setup(family="qwen3_next", T=5, layout="stacked", seed=0, **overrides):
    cfg = moejax.MoEConfig.preset(family, **{"num_experts": 8, **overrides})
    kp, kx, kt = jax.random.split(jax.random.key(seed), 3)
    params = moejax.init_params(cfg, kp, fmt=Int8PerChannel, layout=layout)
    x = jax.random.normal(kx, (T, cfg.hidden_size), jnp.float32)
    tid = jax.random.randint(kt, (T,), 0, cfg.vocab_size) if cfg.hash_routing else None
    return cfg, params, x, tid


def _dense(params):
    return dataclasses.replace(params, experts=params.experts.dequantize())


forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


PLANS = [
    ("reference", 5, "stacked"),
    ("xla_decode", 5, "stacked"),
    ("xla_grouped", 37, "stacked"),
    ("cpu_decode", 5, "per_expert"),
    ("cpu_grouped", 37, "per_expert"),
    ("auto", 3, "per_expert"),
    ("auto", 40, "stacked"),
]
# Llama-4 through every plan: its router score scales the rows the format's gate_up reads. Qwen3-Next's shared
# expert and LongCat's zero experts are plan-level features the format's methods never see: two plans each (the
# full table: MOEJAX_TESTS_FULL=1, tests/tables.py).
EVERY_PLAN = table(
    {"plan": PLANS, "family": ["qwen3_next", "llama4", "longcat_flash"]},
    [(plan, "llama4") for plan in PLANS]
    + [(PLANS[2], "qwen3_next"), (PLANS[5], "qwen3_next"), (PLANS[3], "longcat_flash"), (PLANS[6], "longcat_flash")],
)


@pytest.mark.parametrize(("impl", "T", "layout", "family"), [(*plan, family) for plan, family in EVERY_PLAN])
def test_test_format_runs_through_every_plan(impl, T, layout, family):
    """Every plan on the int8 format equals the dense reference of its dequantized weights."""
    cfg, params, x, tid = _setup(family, T, layout)
    want = forward(_dense(params), x, cfg, tid, "reference")
    got = forward(params, x, cfg, tid, impl)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert float(jnp.max(jnp.abs(want))) > 0.1  # not a vacuous comparison


def test_kernels_refuse_the_test_format_and_auto_falls_back():
    cfg, params, x, tid = _setup(T=3)
    with pytest.raises(NotImplementedError, match="Int8PerChannel"):
        moejax.moe_forward(params, x, cfg, tid, impl="pallas")
    kernels = ["pallas_decode", "cpu_decode", "xla_decode"]
    assert moejax.backends.candidates("auto", 3, cfg.top_k)[-2:] == kernels[1:]
    assert moejax.chosen_impl(params, x, cfg, tid) == "xla_decode"  # stacked: the CPU plans step aside
    per_expert = with_experts_layout(params, "per_expert")
    assert moejax.chosen_impl(per_expert, x, cfg, tid) == "cpu_decode"


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_test_format_under_expert_parallelism(mode):
    cfg, params, x, tid = _setup("deepseek_v3", T=12, num_experts=16, n_group=4, topk_group=2)
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = sharding.shard_params(params, cfg, mesh, tensor_axis="tensor")
    assert sharded.experts.gate_q.sharding.spec == P("expert", None, "tensor")
    assert sharded.experts.down_scale.sharding.spec == P("expert", None)
    ep = jax.jit(
        lambda p, x: parallel.moe_forward_ep(p, x, cfg, mesh=mesh, mode=mode, tensor_axis="tensor", impl="xla"),
    )
    want = forward(_dense(params), x, cfg, tid, "reference")
    np.testing.assert_allclose(ep(sharded, x), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_test_format_in_the_nnx_module(layout):
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=8)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), fmt=Int8PerChannel, layout=layout)
    x = jax.random.normal(jax.random.key(1), (4, cfg.hidden_size))
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(y, moejax.moe_forward(_dense(layer.params), x, cfg, impl="reference"), atol=2e-5)
    one = layer.experts[2] if layout == "per_expert" else layer.experts
    assert one.gate_q[...].dtype == jnp.int8
    axes = ("embed", "mlp") if layout == "per_expert" else ("expert", "embed", "mlp")
    assert one.gate_q.get_metadata()["out_sharding"] == axes


def test_layouts_convert_both_ways_and_hold_separate_buffers():
    cfg, params, _, _ = _setup()
    per_expert = to_layout(params.experts, "per_expert")
    assert isinstance(per_expert, PerExpert) and per_expert.num_experts == cfg.num_experts
    assert per_expert.parts[3].gate_q.shape == (cfg.hidden_size, cfg.intermediate_size)
    chex.assert_trees_all_equal(to_layout(per_expert, "stacked"), params.experts)
    assert to_layout(per_expert, "per_expert") is per_expert  # no-op
    default = moejax.init_params(cfg, jax.random.key(0))
    assert isinstance(default.experts, PerExpert)  # a CPU backend: the layout XLA:CPU reads in place
    with pytest.raises(ValueError, match="layout='rows'"):
        to_layout(params.experts, "rows")


def test_array_specs_come_from_the_declaration():
    cfg = moejax.MoEConfig.preset("gpt_oss", num_experts=4)
    specs = array_specs(cfg, Int8PerChannel)
    assert specs["experts.down_scale"].shape == (4, cfg.hidden_size)
    assert "experts.gate_bias" not in specs  # the format decides its arrays, not the config's bias flag
    per_expert = array_specs(cfg, ExpertWeights, per_expert=True)  # its parts: FusedExpertWeights, [out, in]
    assert per_expert["experts.3.gate_up_bias"].shape == (2 * cfg.intermediate_size,)
    assert per_expert["experts.0.down_weight"].axes == ("embed", "mlp")
    assert array_specs(cfg, Int8PerChannel, per_expert=True)["experts.1.down_q"].axes == ("mlp", "embed")


def test_fused_parts_round_trip_and_compute_the_same():
    """`ExpertWeights` -> per-expert `FusedExpertWeights` parts -> stacked gives the same arrays back, and both
    formats compute the same expert outputs."""
    cfg = moejax.MoEConfig.preset("gpt_oss", num_experts=6)  # with expert biases
    dense = moejax.init_params(cfg, jax.random.key(0), layout="stacked").experts
    parts = to_layout(dense, "per_expert")
    assert isinstance(parts.parts[0], FusedExpertWeights) and parts.format is ExpertWeights
    chex.assert_trees_all_equal(to_layout(parts, "stacked"), dense)
    fused = FusedExpertWeights.from_dense(dense)
    chex.assert_trees_all_equal(fused.as_dense(), dense)
    act = expert_activation(cfg)
    x = jax.random.normal(jax.random.key(1), (5, cfg.hidden_size))
    for e in range(3):
        np.testing.assert_allclose(parts.parts[e].ffn(x, act), dense.expert(e).ffn(x, act), rtol=2e-5, atol=2e-5)


def test_wrong_dtype_or_shape_names_the_field():
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=8)
    params = moejax.init_params(cfg, jax.random.key(0), layout="stacked")
    x = jnp.ones((2, cfg.hidden_size))
    for dtype in (jnp.int8, ml_dtypes.float8_e4m3fn):
        quantized = dataclasses.replace(params.experts, up=params.experts.up.astype(dtype))
        with pytest.raises(TypeError, match=r"params.experts.up: dtype .* is not a dense float dtype"):
            moejax.moe_forward(dataclasses.replace(params, experts=quantized), x, cfg)
    int8 = moejax.init_params(cfg, jax.random.key(0), fmt=Int8PerChannel, layout="stacked").experts
    bad = dataclasses.replace(int8, gate_scale=int8.gate_scale.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="gate_scale: expected dtype float32, got bfloat16"):
        check_experts(bad, cfg)
    bad = dataclasses.replace(int8, down_q=int8.down_q[:, :-1])
    with pytest.raises(ValueError, match=r"down_q: expected shape \(8, 32, 64\), got \(8, 31, 64\)"):
        check_experts(bad, cfg)
    per_expert = to_layout(params.experts, "per_expert")
    short = PerExpert(per_expert.parts[:-1])
    with pytest.raises(ValueError, match="per-expert layout has 7 experts, expected 8"):
        check_experts(short, cfg)
    with pytest.raises(TypeError, match="must be an ExpertFormat"):
        check_experts({"gate": params.experts.gate}, cfg)
