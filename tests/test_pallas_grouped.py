"""The grouped prefill kernels in Mosaic GPU interpret mode on CPU: equal to the plain-jnp reference and to
`moe_forward(impl="reference")` on random inputs with awkward shapes (H, I not multiples of the blocks), E=256,
empty experts, zero-computation expert ids, T from 1 to a few hundred, bf16 and float32; and the block-aligned
metadata, a property test (hypothesis) without the kernels."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_decode import assert_close, random_case

import moejax
from moejax import backends
from pallas_kernels import GatedActivation, gpu_grouped, gpu_tiles, platform

CASES = [
    # Many rows over few experts: several tiles per expert, the last one partly padding; I above one block.
    dict(T=150, K=2, E=4, H=72, I=80, dtype=jnp.bfloat16, act=GatedActivation()),
    # E=256 with most experts empty (interpretation costs time per tile and per weight byte: keep both few).
    dict(T=6, K=2, E=256, H=40, I=24, dtype=jnp.float32, act=GatedActivation("gelu_tanh")),
    # Zero-computation ids (>= E) and repeated ids; clamped SwiGLU applied after the activation.
    dict(
        T=24,
        K=4,
        E=6,
        H=40,
        I=24,
        dtype=jnp.bfloat16,
        id_range=9,
        act=GatedActivation(limit=0.5, clamp_order="after_activation"),
    ),
    # One row (one pair): the smallest layout; gpt-oss activation.
    dict(T=1, K=1, E=8, H=40, I=24, dtype=jnp.float32, act=GatedActivation("gpt_oss", limit=0.5)),
    # Weights on the input (Llama-4).
    dict(T=40, K=1, E=8, H=40, I=24, dtype=jnp.bfloat16, scale=True, act=GatedActivation()),
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c['T']}K{c['K']}E{c['E']}" for c in CASES])
def test_grouped_kernel_equals_reference(case):
    case = dict(case)
    act, dtype = case.pop("act"), case["dtype"]
    args = random_case(case["T"] * 100 + case["K"], **case)
    got = jax.jit(lambda *a: gpu_grouped.moe_grouped(*a, activation=act))(*args)  # interpreted: lowered for CPU
    want = jax.jit(lambda *a: gpu_grouped.moe_grouped_reference(*a, activation=act))(*args)
    assert got.dtype == want.dtype == jnp.float32 and got.shape == want.shape
    assert_close(got, want, dtype)


def test_tile_kernels_equal_their_references():
    rng = np.random.default_rng(0)
    E, H, I = 3, 64, 128
    x = jnp.asarray(rng.standard_normal((2 * 64, H)), jnp.bfloat16)
    gate, up = (jnp.asarray(rng.standard_normal((E, H, I)) / 8, jnp.bfloat16) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, I, H)) / 8, jnp.bfloat16)
    tile_expert = jnp.array([2, 0, 2], jnp.int32)
    tile_block = jnp.array([1, 0, 0], jnp.int32)
    num_tiles = jnp.array([2], jnp.int32)  # the third tile is not in use

    @jax.jit
    def both(x, gate, up, down):
        h = gpu_tiles.gate_up_tiles(x, gate, up, tile_expert, tile_block, num_tiles, interpret=True)
        return h, gpu_tiles.down_tiles(h, down, tile_expert, num_tiles, rows_out=16, interpret=True)

    h, y = both(x, gate, up, down)
    h_ref = gpu_tiles.gate_up_tiles_reference(x, gate, up, tile_expert, tile_block, num_tiles)
    y_ref = gpu_tiles.down_tiles_reference(h_ref, down, tile_expert, num_tiles, rows_out=16)
    live = 2 * 64
    assert_close(h[:live], h_ref[:live], jnp.bfloat16)
    assert_close(y[: 2 * 16], y_ref[: 2 * 16], jnp.float32)


def test_independent_interpreted_kernels_never_give_wrong_numbers():
    """XLA:CPU may run two kernels with no data dependency between them at once, and the interpreter simulates one
    GPU per process: with `interpret=None` that is an error, never wrong numbers, and `reset_interpreter()` makes
    the interpreter usable again; `interpret=True` orders the two by JAX's effects."""
    rng = np.random.default_rng(1)
    E, H, I = 3, 64, 64
    x = jnp.asarray(rng.standard_normal((64, H)), jnp.bfloat16)
    gate, up = (jnp.asarray(rng.standard_normal((E, H, I)) / 8, jnp.bfloat16) for _ in range(2))
    tables = (jnp.array([2], jnp.int32), jnp.array([0], jnp.int32), jnp.array([1], jnp.int32))
    want = [
        gpu_tiles.gate_up_tiles_reference(x, gate, up, *tables),
        gpu_tiles.gate_up_tiles_reference(x, up, gate, *tables),
    ]

    def two(interpret):
        tiles = functools.partial(gpu_tiles.gate_up_tiles, interpret=interpret)
        return jax.jit(lambda x, g, u: (tiles(x, g, u, *tables), tiles(x, u, g, *tables)))(x, gate, up)

    try:
        got = two(None)
    except jax.errors.JaxRuntimeError as err:
        assert "interpreted at once" in str(err)
        platform.reset_interpreter()
    else:
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, jnp.bfloat16)
    for g, w in zip(two(True), want, strict=True):
        assert_close(g, w, jnp.bfloat16)
    (got,) = jax.jit(lambda x, g, u: (gpu_tiles.gate_up_tiles(x, g, u, *tables),))(x, gate, up)
    assert_close(got, want[0], jnp.bfloat16)


_layout = jax.jit(gpu_grouped.block_aligned_layout, static_argnums=1)


@hypothesis.settings(max_examples=8)
@hypothesis.given(
    shape=st.sampled_from([(1, 1), (7, 2), (64, 1), (150, 4)]),
    E=st.sampled_from([1, 3, 256]),
    extra=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_block_aligned_layout(shape, E, extra, seed):
    T, K = shape
    indices = np.random.default_rng(seed).integers(0, E + extra, (T, K))  # ids >= E: zero experts
    pair_row, row_pair, tile_expert, num_tiles = map(np.asarray, _layout(jnp.asarray(indices, jnp.int32), E))
    M = T * K
    ids = indices.reshape(-1)
    real = ids < E
    counts = np.bincount(ids[real], minlength=E)
    assert num_tiles[0] == np.sum(-(-counts // 64)) <= len(tile_expert) == gpu_grouped.max_tiles(M, E)
    # Every real pair has its own row, in a tile of its own expert; rows of one expert keep pair order.
    rows = pair_row[real]
    assert len(set(rows)) == len(rows) and np.all(rows < num_tiles[0] * 64)
    np.testing.assert_array_equal(tile_expert[rows // 64], ids[real])
    np.testing.assert_array_equal(row_pair[rows], np.flatnonzero(real))
    for e in range(E):
        assert np.all(np.diff(pair_row[ids == e]) > 0)
    # Zero-expert pairs get no row; every other row is padding.
    assert np.all(pair_row[~real] == len(row_pair))
    assert np.sum(row_pair < M) == np.sum(real)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "gpt_oss"])
def test_moe_forward_pallas_grouped_equals_reference(family):
    # qwen3.5: a sigmoid-gated shared expert; gpt-oss: expert biases and its activation. Few experts:
    # interpretation costs time per tile.
    cfg = moejax.MoEConfig.preset(family, hidden_size=40, intermediate_size=24, num_experts=4, top_k=2)
    params = jax.jit(lambda k: moejax.init_params(cfg, k, dtype=jnp.bfloat16, layout="stacked"))(jax.random.key(3))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 17, 40)), jnp.bfloat16)
    assert backends.candidates("pallas", 34, cfg.top_k) == ["pallas_grouped"]
    got = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas"))(params, x)
    want = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="reference"))(params, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert_close(got, want, jnp.bfloat16)
