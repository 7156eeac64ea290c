"""benchmarks/gpu_bench.py runs its --smoke mode on CPU (kernels interpreted, tiny shapes) and its --dry-run plan."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_bench"]


def test_dry_run_lists_the_real_layers(gpu_bench, capsys):
    assert gpu_bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
        assert name in out


def test_without_gpu_the_full_run_refuses(gpu_bench):
    assert gpu_bench.main([]) == 2


def test_smoke_checks_and_times_every_implementation(gpu_bench, tmp_path):
    """Run as a script, as users do, and with XLA:CPU's cheap pipeline: the interpreted kernels' programs compile
    in 2/3 of the CPU time (the float32 checks below hold either way; the timings are only checked positive)."""
    out = tmp_path / "bench.json"
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env = {**os.environ, "XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS"), fast]))}
    command = [sys.executable, str(BENCH), "--smoke", "--backward", "--out", str(out)]
    run = subprocess.run(command, env=env, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["ceilings"]["copy_gb_s"] > 0
    checks = {c["kernel"]: c for c in result["checks"]}
    assert set(checks) == {"moe_decode", "moe_grouped", "moe_grouped_vjp"}
    assert all(checks[k]["passed"] and checks[k]["max_rel_error"] < 1e-5 for k in ("moe_decode", "moe_grouped"))
    # the backward rounds dg, du and dy to the weights' bf16 as its products take them
    assert checks["moe_grouped_vjp"]["passed"] and 0 < checks["moe_grouped_vjp"]["max_rel_error"] < 2e-2
    assert {(r["T"], r["impl"]) for r in result["rows"]} == {
        (T, impl) for T in (2, 40) for impl in ("pallas", "xla", "ragged_dot")
    }
    assert all("error" not in r and r["us"] > 0 for r in result["rows"])
    # interpreted Mosaic GPU kernels cannot run a grad program on CPU: the other impls are timed
    assert {r["impl"] for r in result["training"]} == {"xla", "ragged"}
    assert all("error" not in r and r["train_us"] > 0 for r in result["training"])
    rows = gpu_bench.validation_rows(result["checks"], "NVIDIA H200")
    assert [r["kernel"] for r in rows] == ["moe_decode", "moe_grouped", "moe_grouped_vjp"]
    assert all(r["jax_version"] and r["date"] for r in rows)
