"""Every backend of the routed experts against the oracles, one suite: a backend gets every case by adding a class
that names it (as tokamax's `RaggedDotTestBase`).

`BackendCases` holds the cases; each `Test*` class below sets `impl` (the backend's registry name), the experts
layout it reads fastest, and whether it serves decode-sized calls only. The cases draw random inputs at awkward
sizes (hypothesis): T = 1, 7 and a few hundred; H and I not multiples of 8; E = 1; top-k = E; ids of zero and
remote experts; a row that picks one expert twice; every activation; biases; input scales. Forward against the
float64 numpy oracle (`oracles.routed_sum`, written from the spec, not through moejax); gradients against
`jax.grad` of the dense float32 reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multihost_worker import numpy_params
from native_inputs import ACTIVATIONS, dense, rows
from oracles import assert_close, routed_sum
from tables import FULL

import moejax
from moejax import backends
from moejax.backends import native
from moejax.params import with_experts_layout
from moejax.slots import Slots
from moejax.weights import FusedExpertWeights, to_layout

# (T, H, I, E, K); a decode backend runs T = 3 for the rows past its size
SIZES = [(1, 13, 7, 1, 1), (7, 24, 11, 5, 5), (300, 20, 9, 6, 2), (5, 16, 12, 3, 2)]
DECODE_ROWS = 3


def random_slots(T: int, K: int, E: int, seed: int, *, in_scale: bool = False, zero_weight: bool = False) -> Slots:
    """Random slots with skipped ids (-1 and >= E: zero or remote experts, weight 0) and, without input scales, a
    row that picks one expert in two slots (hash routing does); input scales (Llama-4) come with distinct ids.
    `zero_weight`: row 2's first slot keeps its expert with weight 0 (no output, but a weight gradient)."""
    rng = np.random.default_rng(seed)
    if in_scale:
        idx = np.stack([rng.permutation(np.arange(-1, E + 2))[:K] for _ in range(T)]).astype(np.int32)
    else:
        idx = rng.integers(-1, E + 2, (T, K)).astype(np.int32)
        if K > 1 and T > 0:
            idx[0, 1] = idx[0, 0]
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    w[(idx < 0) | (idx >= E)] = 0.0
    if zero_weight and T > 2 and K > 1:
        w[2, 0] = 0.0
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (T, K)).astype(np.float32)) if in_scale else None
    return Slots(jnp.asarray(idx), jnp.asarray(w), scale)


def routed_grads(impl, experts, x, slots, act, probe):
    """Gradients of `<routed, probe>` w.r.t. the experts, x, the output weights and the input scales."""

    def loss(experts, x, out_weight, in_scale):
        s = Slots(slots.indices, out_weight, in_scale)
        return jnp.sum(backends.run_routed(impl, experts, x, s, act) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(experts, x, slots.out_weight, slots.in_scale)


def reference_grads(experts, x, slots, act, probe):
    """`routed_grads` of the dense float32 reference on the `[in, out]` stacked view, brought back to `experts`'
    format (layout, and the `[out, in]` fused format)."""
    stacked = to_layout(experts, "stacked")
    if isinstance(stacked, FusedExpertWeights):
        stacked = stacked.as_dense()
    got = routed_grads("reference", stacked, x, slots, act, probe)
    d = got[0]
    if isinstance(experts, FusedExpertWeights):
        d = FusedExpertWeights.from_dense(d)
    return (to_layout(d, experts.layout), *got[1:])


_routed = jax.jit(backends.run_routed, static_argnames=("impl", "act"))

cases = st.fixed_dictionaries(
    {
        "act": st.sampled_from(sorted(ACTIVATIONS)),
        "sizes": st.sampled_from(SIZES),
        "bias": st.booleans(),
        "in_scale": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


# -- the whole layer (routing, shared expert and combine around the backend) --------------------------------------


def layout_of(impl: str) -> str:
    """The experts layout `impl` reads fastest."""
    return "per_expert" if impl.startswith("cpu") or impl == "native" else "stacked"


def layer_inputs(cfg, T, seed, dtype=jnp.float32, layout="stacked"):
    """Params, x [T, H] and token ids drawn with numpy (`numpy_params`, cast to the dtypes `init_params` gives):
    examples have new shapes, and jax.random would compile its programs again for each (1-3 s of CPU each)."""
    rng = np.random.default_rng(seed)
    dtypes = jax.eval_shape(lambda k: moejax.init_params(cfg, k, dtype, layout="stacked"), jax.random.key(0))
    params = jax.tree.map(lambda a, s: jnp.asarray(np.asarray(a).astype(s.dtype)), numpy_params(cfg, seed), dtypes)
    x = jnp.asarray(rng.standard_normal((T, cfg.hidden_size)).astype(dtype))
    token_ids = jnp.asarray(rng.integers(0, cfg.vocab_size, T), jnp.int32) if cfg.hash_routing else None
    return with_experts_layout(params, layout), x, token_ids


layer_forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


@st.composite
def layer_cases(draw, max_rows):
    """A family at a random size: E up to 256, K up to 8, T rows, rows random or all the same token."""
    family = draw(st.sampled_from(moejax.FAMILIES))
    E = draw(st.sampled_from([8, 16, 64, 256]))
    K = draw(st.integers(1, min(8, E)))
    overrides = {"num_experts": E, "top_k": K}
    if family == "deepseek_v3":
        overrides |= {"n_group": 4, "topk_group": 2} if E >= 16 else {"n_group": 2, "topk_group": 1}
    cfg = moejax.MoEConfig.preset(family, **overrides)
    T = draw(st.integers(1, max_rows))
    if max_rows <= 8:
        T = min(T, 64 // K)
    same_rows = draw(st.booleans())
    return cfg, T, same_rows, draw(st.integers(0, 2**16))


def check_layer(impl, cfg, T, same_rows, seed):
    """`moe_forward` with `impl` equals it with the dense reference (rows random or all the same token)."""
    params, x, tid = layer_inputs(cfg, T, seed)
    if same_rows:
        x = jnp.broadcast_to(x[0], x.shape)
        tid = None if tid is None else jnp.broadcast_to(tid[0], tid.shape)
    ref = layer_forward(params, x, cfg, tid, "reference")
    got = layer_forward(with_experts_layout(params, layout_of(impl)), x, cfg, tid, impl)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


decode_layers, grouped_layers = layer_cases(max_rows=8), layer_cases(max_rows=300)


# One case, run by every subclass: hypothesis sees several executors of the same test. The classes hold nothing
# but constants, so their runs do not share state.
SHARED = [HealthCheck.differing_executors]


class BackendCases:
    """The cases every backend passes. Subclasses set `impl`, and `layout` / `decode` where they differ."""

    impl: str
    layout = "stacked"
    decode = False  # serves decode-sized calls only (at most 8 rows)
    bfloat16_tol = 1e-2

    def inputs(self, act, sizes, bias, in_scale, seed, dtype="float32"):
        T, H, I, E, K = sizes
        if self.decode and T > 8:
            T = DECODE_ROWS
        experts = to_layout(dense(E, H, I, dtype=dtype, bias=bias, seed=seed), self.layout)
        return (
            experts,
            rows(T, H, seed + 1),
            random_slots(T, K, E, seed + 2, in_scale=in_scale, zero_weight=True),
            ACTIVATIONS[act],
        )

    @settings(max_examples=2, suppress_health_check=SHARED)  # each example compiles new shapes
    @given(case=cases)
    def test_forward_equals_the_oracle(self, case):
        experts, x, slots, act = self.inputs(**case)
        got = _routed(self.impl, experts, x, slots, act)
        assert got.dtype == jnp.float32 and got.shape == x.shape
        assert_close(got, routed_sum(experts, x, slots, act), 3e-5, what=self.impl)

    @settings(max_examples=2, suppress_health_check=SHARED)
    @given(case=cases)
    def test_gradients_equal_the_reference(self, case):
        experts, x, slots, act = self.inputs(**case)
        probe = rows(x.shape[0], x.shape[1], case["seed"] + 3)
        got = routed_grads(self.impl, experts, x, slots, act, probe)
        assert_close(got, reference_grads(experts, x, slots, act, probe), 2e-4, floor=1e-3, what=self.impl)
        assert float(jnp.abs(got[1]).max()) > 1e-3 or not bool(jnp.any(slots.out_weight > 0))

    @pytest.mark.slow  # the developer's loop keeps the float32 routed cases
    @settings(max_examples=2, suppress_health_check=SHARED)
    @given(data=st.data())
    def test_layer_equals_the_reference(self, data):
        """Every family's routing, shared expert and combine around the backend (`impl=` of `moe_forward`)."""
        check_layer(self.impl, *data.draw(decode_layers if self.decode else grouped_layers))

    @pytest.mark.slow
    def test_bfloat16_weights(self):
        """bf16 weights: the forward within bf16 resolution of the float32 oracle; gradients in bf16, the
        reference's float32 math on the widened weights."""
        experts, x, slots, act = self.inputs("gpt_oss", (12, 24, 16, 4, 2), False, False, 5, dtype="bfloat16")
        assert_close(_routed(self.impl, experts, x, slots, act), routed_sum(experts, x, slots, act), 2e-2)
        probe = rows(x.shape[0], x.shape[1], 8)
        got = routed_grads(self.impl, experts, x, slots, act, probe)
        assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(got[0]))
        assert_close(got, reference_grads(experts, x, slots, act, probe), self.bfloat16_tol, floor=1e-3)


class TestXlaDecode(BackendCases):
    impl, decode = "xla_decode", True


class TestXlaGrouped(BackendCases):
    impl = "xla_grouped"


class TestCpuDecode(BackendCases):
    impl, layout, decode = "cpu_decode", "per_expert", True


class TestCpuGrouped(BackendCases):
    impl, layout = "cpu_grouped", "per_expert"


class TestRagged(BackendCases):
    impl = "ragged"


@pytest.mark.skipif(not native.available(), reason="the native extension is not built")
class TestNative(BackendCases):
    impl, layout = "native", "per_expert"


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL,
    reason="interpreted kernels: MOEJAX_TESTS_FULL=1 (the suite checks them in tests/test_pallas_*.py)",
)
class TestPallasGrouped(BackendCases):
    """The Mosaic GPU kernels, interpreted on CPU (forward and their own grouped backward)."""

    impl = "pallas_grouped"
