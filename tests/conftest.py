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
