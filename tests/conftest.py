"""Test set-up: 8 simulated CPU devices for shard_map tests (must be set before jax is imported)."""

import os

# XLA:CPU's cheap pipeline (-O0, no expensive LLVM passes, the older elemental emitters instead of the fusion
# emitters): compiles are most of the suite's CPU time. -O0 cut them by a fifth (tests/test_pallas_grouped.py 53.1
# -> 42.7 CPU s, tests/test_quantized.py 61.4 -> 51.5); the elemental emitters halve what is left (16 forwards of
# four families: 9.5 -> 4.1 CPU s of compiles). Tests of bits across batches compile with
# XLA's default pipeline (xla_pipeline.DEFAULT_PIPELINE): the cheap one hides the exp bits that change with a loop's
# vector body and tail. The default pipeline for all: set XLA_FLAGS yourself.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis

hypothesis.settings.register_profile(
    "moejax",
    max_examples=12,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile("moejax")

# Files whose tests run longest (a compile subprocess, a notebook kernel, an interpreted-kernel benchmark) go first.
# `pytest -n 2 --dist worksteal` hands each worker half of the collection and lets an idle worker take tests from
# the end of the other's queue; a long test collected last (test_tpu_compile, test_notebooks) would then run alone
# on one core at the end of the suite.
LONG_FIRST = ("test_cuda_compile.py", "test_tpu_compile.py", "test_notebooks.py", "test_gpu_bench_smoke.py")


def _order(item) -> int:
    return int(item.path.name not in LONG_FIRST)


def pytest_collection_modifyitems(items):
    items.sort(key=_order)  # stable: the order within each file is kept
