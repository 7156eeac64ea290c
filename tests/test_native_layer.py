"""The whole MoE layer on the native CPU path: router logits, routed experts and shared expert (with its gate)
batch-invariant across batch sizes, inside the dispatch modes' `shard_map`, with gradients; the switch off."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moejax
from moejax import backends
from moejax.backends import native, native_layer
from moejax.dispatch import EPAllToAll, EPPsum, Rows

built = pytest.mark.skipif(not native.available(), reason="the native extension is not built")

# Families whose router / shared expert differ: softmax (Qwen3), gated shared expert (Qwen2), sigmoid + groups +
# correction bias + ungated shared expert (DeepSeek-V3), router bias + expert biases (gpt-oss), sigmoid after
# top-k + input scale + shared expert (Llama-4).
FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4")
H = 96


def _layer(family: str, dtype=jnp.float32, seed=0):
    cfg = moejax.MoEConfig.preset(family, hidden_size=H, intermediate_size=40)
    params = moejax.init_params(cfg, jax.random.key(seed), dtype, layout="per_expert")
    return cfg, params


def _rows(T: int, seed: int, dtype=jnp.float32) -> np.ndarray:
    return np.array(jax.random.normal(jax.random.key(seed), (T, H), jnp.float32).astype(dtype))


def _forward(params, x, cfg):
    return np.asarray(moejax.moe_forward(params, jnp.asarray(x), cfg))


def _assert_row_invariant(params, cfg, sizes, what: str, dtype=jnp.float32):
    """The row's output alone equals its output at several positions inside batches of `sizes` rows, bit for bit."""
    row = _rows(1, 7, dtype)
    alone = _forward(params, row, cfg)[0]
    for T in sizes:
        x = _rows(T, 100 + T, dtype)
        positions = sorted({0, T // 2, T - 1})
        x[positions] = row[0]
        got = _forward(params, x, cfg)
        for pos in positions:
            np.testing.assert_array_equal(got[pos], alone, err_msg=f"{what} T={T} position {pos}")


@built
@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_layer_output_does_not_depend_on_the_batch(family):
    cfg, params = _layer(family)
    _assert_row_invariant(params, cfg, (2, 7, 64, 300), family)
