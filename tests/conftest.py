"""Test set-up: 8 simulated CPU devices for shard_map tests (must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: the order within each file is kept
