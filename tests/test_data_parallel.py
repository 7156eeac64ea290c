"""Data parallelism: the forward on meshes without an expert axis (x split over `data`,
never gathered) equals the single-device result, and a row's output bits do not depend on its neighbours in the
batch (so splitting a batch cannot change them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from multihost_worker import numpy_params
from xla_pipeline import DEFAULT_PIPELINE

import moejax

SMALL = {"hidden_size": 32, "intermediate_size": 16}


def _params(cfg, layout="stacked", seed=0):
    """float32 params drawn with numpy: no random-number programs to compile (CPU time)."""
    return moejax.params.with_experts_layout(numpy_params(cfg, seed), layout)


# -- meshes without an expert axis ------------------------------------------------------------------------
MESHES = [
    ((8,), ("data",)),
    ((4, 2), ("data", "expert")),
]
DP_IMPLS = ["reference", "xla_decode", "xla_grouped", "cpu_decode", "cpu_grouped", "auto"]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("shape,names", MESHES, ids=["1d", "data_expert"])
def test_moe_forward_on_a_data_parallel_mesh(axis_type, shape, names):
    """Params replicated, x replicated or split over `data`: every impl gives the single-device result, eager and
    jitted, and the split x is never gathered (no all-gather in the compiled program). Every impl on the 1-D
    Explicit mesh; on the other meshes "auto" and "xla_grouped" (the sort of the grouped plan is what a split
    axis broke; each impl costs ~8 s of compiles: suite time). Eager on the 1-D meshes (both axis types)."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL)
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    x = jax.random.normal(jax.random.key(1), (8, cfg.hidden_size))
    ref = moejax.moe_forward(_params(cfg), x, cfg, impl="reference")
    forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))
    every_impl = len(shape) == 1 and axis_type == AxisType.Explicit
    for impl in DP_IMPLS if every_impl else ("auto", "xla_grouped"):
        layout = "per_expert" if impl.startswith("cpu") else "stacked"
        params = jax.device_put(_params(cfg, layout), NamedSharding(mesh, P()))
        for spec in (P(), P("data")):
            xs = jax.device_put(x, NamedSharding(mesh, spec))
            compiled = forward.lower(params, xs, cfg, impl=impl).compile()
            y = compiled(params, xs)
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5, err_msg=f"{impl} {spec} jit")
            if spec == P("data"):
                assert "all-gather" not in compiled.as_text(), f"{impl}: x was gathered"
                assert y.sharding.spec[0] is not None, f"{impl}: output not split over the rows"
            if impl == "auto" and len(shape) == 1:  # eager: op by op on 8 devices, ~4 s per mesh (suite time)
                eager = moejax.moe_forward(params, xs, cfg, impl=impl)
                np.testing.assert_allclose(eager, ref, rtol=1e-5, atol=1e-5, err_msg=f"{impl} {spec} eager")


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_layer_on_a_mesh_without_expert_axis(axis_type):
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(axis_type,) * 2)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (4, 2, cfg.hidden_size))
    ref = moejax.moe_forward(jax.device_get(layer.params), np.asarray(x), cfg, impl="reference")
    for xs in (x, jax.device_put(x, NamedSharding(mesh, P("data")))):
        np.testing.assert_allclose(layer(xs), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(nnx.jit(lambda m, v: m(v))(layer, xs), ref, rtol=1e-5, atol=1e-5)


# -- batch invariance -------------------------------------------------------------------------------------
INVARIANCE = [
    ("longcat_flash", 64, "xla_grouped", jnp.float32),
    ("qwen3_moe", 128, "xla_grouped", jnp.float32),
    ("longcat_flash", 64, "cpu_grouped", jnp.float32),
    ("qwen3_moe", 128, "cpu_grouped", jnp.float32),
    ("qwen3_moe", 8, "xla_decode", jnp.float32),
    ("qwen3_moe", 8, "cpu_decode", jnp.float32),
    ("longcat_flash", 64, "xla_grouped", jnp.bfloat16),
    ("qwen3_moe", 8, "xla_decode", jnp.bfloat16),
]


@pytest.mark.parametrize("family,T,impl,dtype", INVARIANCE)
def test_row_bits_do_not_depend_on_neighbours(family, T, impl, dtype):
    """For a fixed T a row's output is bit-identical whatever its neighbours, including batches where many
    neighbours choose the same experts as the row (near-copies of it), which change the load of its experts."""
    cfg = moejax.MoEConfig.preset(family)
    layout = "per_expert" if impl.startswith("cpu") else "stacked"
    params = moejax.init_params(cfg, jax.random.key(0), dtype, layout=layout)
    forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"), compiler_options=DEFAULT_PIPELINE)
    x = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size)).astype(dtype)
    base = forward(params, x, cfg, impl=impl)
    rows = (0, T // 2, T - 1)
    for seed in range(3):
        noise = jax.random.normal(jax.random.key(10 + seed), x.shape)
        for r in rows:
            # seed 0: random neighbours; seeds 1, 2: near-copies of row r, on the same experts
            neighbours = (noise if seed == 0 else x[r] + 1e-2 * seed * noise).astype(dtype)
            y = forward(params, neighbours.at[r].set(x[r]), cfg, impl=impl)
            np.testing.assert_array_equal(y[r], base[r], err_msg=f"row {r}, neighbours {seed}")


def _tree_sum(row: np.ndarray) -> np.float32:
    """numpy model of `routing.row_sum`: halves added pairwise in float32, an odd last element carried."""
    row = row.astype(np.float32)
    while row.size > 1:
        half = row.size // 2
        row = np.concatenate([row[:half] + row[half : 2 * half], row[2 * half :]])
    return row[0]


@pytest.mark.parametrize("N", [13, 16, 60, 256])
def test_routing_row_sums_are_one_fixed_tree(N):
    """The routing's sums (softmax denominators, top-k normalisation) are one fixed tree per row: a row's sum has
    the same bits alone and at any position of 9, 300 or 2048 rows, and equals the numpy model of the tree.
    (XLA's own reduce picks its loop order by the array's shape; a row's sum changed with the batch by an ulp.)"""
    from moejax.routing import row_sum

    rng = np.random.default_rng(N)
    fn = jax.jit(row_sum, compiler_options=DEFAULT_PIPELINE)
    row = rng.exponential(size=(1, N)).astype(np.float32)
    alone = np.asarray(fn(row))[0, 0]
    assert alone == _tree_sum(row[0])
    for T in (9, 300, 2048):
        x = rng.exponential(size=(T, N)).astype(np.float32)
        positions = (0, T // 2 + 1, T - 1)
        x[list(positions)] = row[0]
        sums = np.asarray(fn(x))[:, 0]
        assert all(sums[p] == alone for p in positions), (T, sums[list(positions)], alone)
