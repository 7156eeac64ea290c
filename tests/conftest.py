"""Test set-up: 8 simulated CPU devices for shard_map tests (must be set before jax is imported)."""

import os
import pathlib

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


# The developer's loop, `pytest -n 2 -m "not slow"` (meant for <= 90 s on 2 cores), runs the configs, the Hugging
# Face interop, every family against its oracle and the shared backend cases' forward and gradients. The files
# below, the longest by `--durations=0`, are marked slow as a whole: each compiles many programs, or another
# platform's, or runs processes, notebooks, whole models. A single slow test elsewhere carries `pytest.mark.slow`.
SLOW_FILES = {
    # compiles for other platforms, interpreted Pallas kernels
    "test_cuda_compile.py",
    "test_tpu_compile.py",
    "test_native_cross_compile.py",
    "test_backward_compile.py",
    "test_pallas_backward.py",
    "test_pallas_decode.py",
    "test_pallas_grouped.py",
    "test_pallas_quantized.py",
    "test_pallas_lowering.py",
    "test_tpu_kernels.py",
    # notebooks, processes, whole models, transformers, the benchmark scripts, training loops
    "test_notebooks.py",
    "test_multihost.py",
    "test_qwen3_moe_example.py",
    "test_hf_transformers.py",
    "test_gpu_bench_smoke.py",
    "test_cli.py",
    "test_routing_replay.py",
    "test_quant_accuracy.py",
    "test_lora_nnx.py",
    # the native kernels' and the plans' own files, LoRA, gradients, parallelism, eager caches, formats
    "test_native_cpu.py",
    "test_native_layer.py",
    "test_native_lora.py",
    "test_native_backward.py",
    "test_native_lora_backward.py",
    "test_native_act8.py",
    "test_plans.py",
    "test_cpu_plans.py",
    "test_quantized.py",
    "test_weight_formats.py",
    "test_extensions.py",
    "test_lora.py",
    "test_lora_safety.py",
    "test_lora_ep.py",
    "test_backward.py",
    "test_replay_ids.py",
    "test_parallel.py",
    "test_data_parallel.py",
    "test_ep_ragged.py",
    "test_placement.py",
    "test_stats.py",
    "test_eager.py",
    "test_hf_writes.py",
    # the whole forward's options, quantized checkpoints, adapters, edge inputs, routing analysis, the pool
    "test_forward.py",
    "test_hf_quantized.py",
    "test_hf_adapter.py",
    "test_edge_inputs.py",
    "test_analysis.py",
    "test_native_threads.py",
}


# A renamed file must not slip into the developer's loop unnoticed.
assert all((pathlib.Path(__file__).parent / name).exists() for name in SLOW_FILES), "SLOW_FILES names a missing file"


def pytest_collection_modifyitems(items):
    items.sort(key=_order)  # stable: the order within each file is kept
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker("slow")
