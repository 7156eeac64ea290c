"""The grouped backward kernels without a device: the Mosaic GPU ones lower for CUDA (their sm_90a compile is in
test_cuda_compile.py), the megablox ones compile for TPU v5e and v6e (deviceless AOT: Mosaic TPU checks VMEM).
Small-but-real shapes in the suite; `MOEJAX_TPU_COMPILE_ALL=1` adds Qwen3-30B-A3B's and gpt-oss-120b's layers at
T = 2048 (about a minute each on 2 cores). TPU compile needs the `tpu-compile` extra (skipped without it)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.activations import GatedActivation
from pallas_kernels.grouped_backward import moe_grouped_vjp

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

SMALL = (256, 512, 256, 8, 2)  # (T, H, I, E, K): H and I multiples of the 64-wide tiles and of TPU's 128 lanes
FULL = {"qwen3-30b-a3b": (2048, 2048, 768, 128, 8), "gpt-oss-120b": (2048, 2880, 2880, 128, 4)}


def _vjp(x, gate, up, down, indices, weights, cotangent, gate_bias, up_bias, down_bias, **options):
    act = GatedActivation("gpt_oss", limit=7.0)
    biases = dict(gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias)
    return moe_grouped_vjp(
        x, gate, up, down, indices, weights, activation=act, cotangent=cotangent, **biases, **options
    )


def _args(dims, dtype, sharding=None):
    T, H, I, E, K = dims
    s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    weights = (s((E, H, I)), s((E, H, I)), s((E, I, H)))
    routing = (s((T, K), jnp.int32), s((T, K), jnp.float32), s((T, H), jnp.float32))
    return (s((T, H)), *weights, *routing, s((E, I)), s((E, I)), s((E, H)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_backward_lowers_for_cuda(dtype):
    lower = lambda f: jax.jit(f).trace(*_args(SMALL, dtype)).lower(lowering_platforms=("cuda",)).as_text()
    text = lower(_vjp)
    for kernel in ("moe_grouped_matmul", "moe_tgmm_tiles"):
        assert kernel in text
    # g, u, y recomputed; dh and both halves of dx; 3 tgmm.
    assert text.count("mosaic_gpu_v2") == 9
    # Held routing weights (routing replay) and a frozen base: no y, no weight gradients.
    held = lower(functools.partial(_vjp, out_weight_grads=False, weight_grads=False))
    assert "moe_tgmm_tiles" not in held and held.count("mosaic_gpu_v2") == 5


TPU_CASES = [("v5e", "small")]  # v6e, and the full layers on both: MOEJAX_TPU_COMPILE_ALL=1
if os.environ.get("MOEJAX_TPU_COMPILE_ALL") == "1":
    TPU_CASES += [("v6e", "small")] + [(chip, layer) for chip in ("v5e", "v6e") for layer in FULL]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu-compile]"')
@pytest.mark.parametrize("chip,layer", TPU_CASES)
def test_backward_compiles_for_tpu(chip, layer):
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=f"{chip}:2x2", platform="tpu").devices[0]
    args = _args(SMALL if layer == "small" else FULL[layer], jnp.bfloat16, jax.sharding.SingleDeviceSharding(device))
    compiled = jax.jit(_vjp).lower(*args).compile()
    # megablox: gmm for g, u, y (the recomputed forward), gmm transposed for dh and both halves of dx, 3 tgmm.
    assert compiled.as_text().count("tpu_custom_call") == 9
    assert compiled.memory_analysis().temp_size_in_bytes < 16 * 2**30  # v5e's HBM


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu-compile]"')
def test_auto_backward_runs_the_kernels_only_on_a_validated_chip(tmp_path, monkeypatch):
    """With validated rows for v5e only, `jax.grad` through impl="auto" lowered for v5e calls the backward's
    megablox kernels (6 gmm, 3 tgmm; the forward's value is not needed), for v6e none (`routed_vjp`)."""
    import json

    from jax.experimental import topologies

    import moejax
    import pallas_kernels

    rows = [
        {"kernel": kernel, "device_kind": "TPU v5 lite", "jax_version": jax.__version__}
        for kernel in ("moe_grouped", "moe_grouped_vjp")
    ]
    (tmp_path / "validated.json").write_text(json.dumps(rows))
    validated = functools.partial(pallas_kernels.is_validated, path=tmp_path / "validated.json")
    monkeypatch.setattr(pallas_kernels, "is_validated", validated)
    cfg = moejax.MoEConfig.preset("qwen3_moe", num_experts=8, top_k=2, hidden_size=512, intermediate_size=256)
    counts = {}
    for chip in ("v5e", "v6e"):
        device = topologies.get_topology_desc(topology_name=f"{chip}:2x2", platform="tpu").devices[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        place = lambda a, sharding=sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        init = lambda k: moejax.init_params(cfg, k, jnp.bfloat16, layout="stacked")
        params = jax.tree.map(place, jax.eval_shape(init, jax.random.key(0)))
        x = place(jax.ShapeDtypeStruct((256, 512), jnp.bfloat16))
        loss = lambda p, x: jnp.sum(moejax.moe_forward(p, x, cfg, impl="auto").astype(jnp.float32))
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
        counts[chip] = len(re.findall(r"call @t?gmm", text))
    assert counts == {"v5e": 9, "v6e": 0}, counts
