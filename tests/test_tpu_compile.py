"""moejax compiles for TPU on this CPU-only host (deviceless AOT, v5e and v6e): the Mosaic TPU kernels of
impl="pallas" fit VMEM (Mosaic checks it while compiling) and the programs fit HBM (`memory_analysis`); "auto"
and "pallas" choose by the platform and chip the program is compiled for. Needs the `tpu-compile` extra
(`pip install -e ".[tpu-compile]"`: jax[tpu], which pins libtpu); skipped without it.

Small-but-real shapes here (compile time: grouped programs take 15-25 s at full size on 2 cores); the full table
at Qwen3-30B-A3B, gpt-oss-120b and DeepSeek-V3 sizes is `python benchmarks/tpu_compile.py` (RESULTS.md).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

# Read by libtpu when the topology is first built (after JAX's CPU backend is up: that is fine).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no /tmp/libtpu_lockfile: several processes compile

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu-compile]"'
)
COMPILE = Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_compile.py"


@pytest.fixture(scope="module")
def tpu_compile():
    spec = importlib.util.spec_from_file_location("tpu_compile", COMPILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tpu_compile"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["tpu_compile"]


@pytest.mark.parametrize(
    "chip,T,weights",
    [
        ("v5e", 8, "bfloat16"),
        ("v5e", 64, "bfloat16"),
        ("v6e", 8, "int8"),
        ("v5e", 1, "mxfp4"),  # 4-bit codes with 8-bit scales (the two halves, e8m0) decoded in VMEM
        ("v6e", 1, "fp8_block"),  # e4m3 codes, the expanded block scales
        ("v6e", 64, "int8"),  # quantized prefill on the tile kernels
    ],
)
def test_pallas_compiles_for_tpu_within_vmem_and_hbm(tpu_compile, chip, T, weights):
    row = tpu_compile.compile_one(tpu_compile.CI_LAYER, T, "pallas", weights, chip)
    assert tpu_compile.problems(row, "pallas") == [], row
    # decode and quantized grouped: the gate/up and down tile kernels; dense grouped: 3 gmm
    assert row["compiled_tpu_custom_calls"] == (3 if T > 8 and weights == "bfloat16" else 2), row
    assert 0 < row["hbm_fraction"] < 0.5, row


def test_auto_runs_a_kernel_only_on_the_chip_validated_json_lists(tpu_compile, tmp_path, monkeypatch):
    """With a validated row for v5e only: "auto" lowered for a v5e chip holds the Mosaic TPU kernels, for a v6e
    chip not (its grouped call takes ragged_dot there, chosen while lowering for TPU); the host's backend (CPU)
    plays no part. Lowered, not compiled: the choice is made while lowering."""
    import jax

    import moejax
    import pallas_kernels

    rows = [{"kernel": "moe_grouped", "device_kind": "TPU v5 lite", "jax_version": jax.__version__}]
    table = tmp_path / "validated.json"
    table.write_text(json.dumps(rows))
    monkeypatch.setattr(pallas_kernels, "is_validated", functools.partial(pallas_kernels.is_validated, path=table))
    cfg = tpu_compile.CI_LAYER
    texts = {}
    for chip in ("v5e", "v6e"):
        params, x = tpu_compile.abstract_inputs(cfg, 64, "bfloat16", tpu_compile.chip(chip)[0])
        fn = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl="auto"))
        texts[chip] = fn.lower(params, x).as_text()
    assert "tpu_custom_call" in texts["v5e"] and "ragged_dot" not in texts["v5e"]
    assert "tpu_custom_call" not in texts["v6e"] and "ragged_dot" in texts["v6e"]
