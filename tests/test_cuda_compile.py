"""The Mosaic GPU kernels compile for Hopper (sm_90a) at real layer sizes on this CPU-only host: no spills, no
serialized wgmma. Needs the `cuda-compile` extra (`pip install -e ".[cuda-compile]"`); skipped without it.

Route: JAX's deviceless ahead-of-time compile. The CUDA PJRT plugin builds a compile-only H100 topology from a
target description; `jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).compile()` against it runs
XLA's GPU compiler, which runs Mosaic GPU's whole pipeline on each `mosaic_gpu_v2` custom call (MLIR -> NVVM ->
PTX -> ptxas -> cubin). ptxas's `-v` log (`MOSAIC_GPU_DUMP_PTXAS=1`, written to stdout by the plugin) gives
registers, spills, stack and static shared memory per kernel; the dynamic shared memory Mosaic reserves is read
from each kernel's `gpu.launch` while lowering. The kernels pick compiled mode themselves (`interpret=None`: the
lowering platform decides).

The compile runs in a subprocess of this file (by hand: `python tests/test_cuda_compile.py --out r.json [CASE...]`)
with its own environment: `JAX_PLATFORMS=cpu` (no driver probing), `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` (no CUDA
runtime needed), the ptxas of nvidia-cuda-nvcc-cu12 first on PATH, and stdout free for the plugin's log. Two
private details of jax 0.10 are used, in the subprocess only: the launch record of Mosaic's serde pass and the
target-config text; the extra pins the versions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from benchmark_scripts import load

# label: (layer, T, dtype[, quantized format]). Layers: benchmarks/model_layers.py, and gpt-oss-120b from
# test_pallas_lowering.VARIANTS.
# Decode T <= 8 runs the union-of-experts decode kernels, larger T the grouped prefill kernels.
CASES = {
    "qwen3-T1": ("qwen3-30b-a3b", 1, "bfloat16"),
    "qwen3-T2048": ("qwen3-30b-a3b", 2048, "bfloat16"),
    "dsv3-T8": ("deepseek-v3", 8, "bfloat16"),
    "dsv3-T16384": ("deepseek-v3", 16384, "bfloat16"),
    "gptoss-T8": ("gpt-oss-120b", 8, "bfloat16"),
    "gptoss-T2048": ("gpt-oss-120b", 2048, "bfloat16"),
    "mixtral-T8": ("mixtral-8x7b", 8, "bfloat16"),
    "mixtral-T2048": ("mixtral-8x7b", 2048, "bfloat16"),
    # float32 weights: TF32 wgmma over transposed weights.
    "qwen3-T4-f32": ("qwen3-30b-a3b", 4, "float32"),
    "qwen3-T2048-f32": ("qwen3-30b-a3b", 2048, "float32"),
    # Quantized weights (moejax.quantized formats, a 4th field): codes and scales dequantized in registers.
    "qwen3-T1-int8": ("qwen3-30b-a3b", 1, "bfloat16", "int8"),
    "qwen3-T2048-int8": ("qwen3-30b-a3b", 2048, "bfloat16", "int8"),
    "qwen3-T1-fp8": ("qwen3-30b-a3b", 1, "bfloat16", "fp8_block"),
    "qwen3-T2048-fp8": ("qwen3-30b-a3b", 2048, "bfloat16", "fp8_block"),
}
# The suite compiles a representative subset (suite time): each kernel body once (bf16 decode and prefill, gpt-oss's
# biases and activation, the float32 TF32 path, int8 decode, FP8 prefill). DeepSeek-V3's and Mixtral's bf16 layers
# build the same kernels as Qwen3-30B-A3B's (same registers and shared memory), only at other sizes. The whole table:
# `MOEJAX_CUDA_COMPILE_ALL=1 pytest tests/test_cuda_compile.py`, or `python tests/test_cuda_compile.py --out r.json`.
SUITE_CASES = ["qwen3-T1", "qwen3-T2048", "gptoss-T8", "qwen3-T4-f32", "qwen3-T1-int8", "qwen3-T2048-fp8"]
RUN_CASES = list(CASES) if os.environ.get("MOEJAX_CUDA_COMPILE_ALL") == "1" else SUITE_CASES
# The backward (`jax.grad` w.r.t. the experts and x through impl="pallas": the forward's two kernels, then the
# backward's grouped_matmul and tgmm_tiles): the suite compiles the bf16 one; float32 reads TF32's transposed views.
GRAD_CASES = {
    "qwen3-T512-grad": ("qwen3-30b-a3b", 512, "bfloat16"),
    "gptoss-T256-grad": ("gpt-oss-120b", 256, "bfloat16"),
    "qwen3-T256-f32-grad": ("qwen3-30b-a3b", 256, "float32"),
}
GRAD_RUN_CASES = list(GRAD_CASES) if os.environ.get("MOEJAX_CUDA_COMPILE_ALL") == "1" else ["qwen3-T512-grad"]
# By hand only (`python tests/test_cuda_compile.py --out r.json qwen3-T1-int4 ...`): the suite has no time for them.
EXTRA_CASES = {
    f"qwen3-T{T}-{name}": ("qwen3-30b-a3b", T, "bfloat16", name)
    for name in ("int4", "mxfp4", "nvfp4")
    for T in (1, 2048)
}
BROKEN = "broken-gate_up-bn256"  # compile_broken below
_TIMEOUT_S = 420


def _find(module: str):
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a missing parent package
        return None


def _nvcc_bin() -> Path | None:
    spec = _find("nvidia.cuda_nvcc")
    if spec is None or not spec.submodule_search_locations:
        return None
    ptxas = Path(next(iter(spec.submodule_search_locations))) / "bin" / "ptxas"
    return ptxas.parent if ptxas.exists() else None


def _missing_extra() -> str | None:
    missing = [m for m in ("jax_cuda12_plugin", "jax_plugins.xla_cuda12") if _find(m) is None]
    if _nvcc_bin() is None:
        missing.append("nvidia-cuda-nvcc-cu12 (ptxas)")
    if not missing:
        return None
    return f"needs the cuda-compile extra (pip install -e '.[cuda-compile]'): missing {', '.join(missing)}"


def _compile_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
        MOSAIC_GPU_DUMP_PTXAS="1",
        PATH=f"{_nvcc_bin()}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]),
    )
    env.pop("XLA_FLAGS", None)  # one CPU device is enough here
    return env


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile every case in one subprocess (one JAX start-up; the compile is mostly single-threaded and parallel
    workers gained nothing on 2 cores); returns ({label: result}, seconds)."""
    reason = _missing_extra()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("cuda_compile") / "result.json"
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--out", str(out), *RUN_CASES, *GRAD_RUN_CASES, BROKEN]
    proc = subprocess.run(cmd, env=_compile_env(), capture_output=True, text=True, timeout=_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"compile subprocess failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    results = json.loads(out.read_text())
    return results, time.perf_counter() - start


def problems(kernel: dict) -> list[str]:
    """What disqualifies a compiled kernel: another target than sm_90a, register spills, serialized wgmma."""
    found = []
    if kernel["arch"] != "sm_90a":
        found.append(f"compiled for {kernel['arch']}")
    if (kernel["spill_stores"], kernel["spill_loads"]) != (0, 0):
        found.append(f"spills {kernel['spill_stores']}/{kernel['spill_loads']} bytes")
    if any("C7511" in w for w in kernel["warnings"]):
        found.append("wgmma serialized (ptxas C7511)")
    return found


@pytest.mark.parametrize("label", RUN_CASES)
def test_kernels_compile_for_sm90a_without_spills(compiled, label):
    r = compiled[0][label]
    assert r.get("error") is None, r["error"]
    kernels = r["kernels"]
    assert len(kernels) == r["mosaic_calls"] == 2, r  # gate/up + activation, then down
    assert {k["kernel"] for k in kernels} == {"moe_gate_up_tiles_mosaic_gpu_kernel", "moe_down_tiles_mosaic_gpu_kernel"}
    for k in kernels:
        assert not problems(k), (k["kernel"], problems(k), k)
        assert 0 < k["registers"] <= 255 and k["dynamic_smem"] is not None, k


@pytest.mark.parametrize("label", GRAD_RUN_CASES)
def test_backward_kernels_compile_for_sm90a_without_spills(compiled, label):
    r = compiled[0][label]
    assert r.get("error") is None, r["error"]
    names = {k["kernel"].removesuffix("_mosaic_gpu_kernel") for k in r["kernels"]}
    assert {"moe_grouped_matmul", "moe_tgmm_tiles"} <= names, names
    for k in r["kernels"]:
        assert not problems(k), (k["kernel"], problems(k), k)
        assert 0 < k["registers"] <= 255 and k["dynamic_smem"] is not None, k


def test_the_check_catches_spills(compiled):
    """The negative control: 256 output columns per gate/up item spill and serialize wgmma, and the check says so."""
    r = compiled[0][BROKEN]
    assert r.get("error") is None, r["error"]
    (kernel,) = r["kernels"]
    assert problems(kernel) == [
        f"spills {kernel['spill_stores']}/{kernel['spill_loads']} bytes",
        "wgmma serialized (ptxas C7511)",
    ], kernel


def test_report_registers_and_shared_memory(compiled, capsys):
    """ptxas's report per kernel, printed also when the run passes."""
    results, seconds = compiled
    lines = [
        f"compiled {len(results)} cases for sm_90a in {seconds:.0f} s",
        f"{'case':<16} {'kernel':<18} {'arch':<7} {'regs':>4} {'spills st/ld':>12} {'stack':>5} {'smem st+dyn':>14}",
    ]
    for label, r in results.items():
        for k in r["kernels"] if label != BROKEN else []:
            smem = f"{k['static_smem']}+{k['dynamic_smem']}"
            spills = f"{k['spill_stores']}/{k['spill_loads']}"
            name = k["kernel"].removesuffix("_mosaic_gpu_kernel")
            lines.append(
                f"{label:<16} {name:<18} {k['arch']:<7} {k['registers']:>4} {spills:>12} {k['stack']:>5} {smem:>14}"
            )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert all(r["kernels"] for r in results.values()), results


# --- the subprocess ---------------------------------------------------------------------------------------------
# H100 SXM (sm_90a): the fields XLA needs of xla/backends/gpu/target_config/specs/h100_sxm.txtpb.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers.*?(\d+) bytes smem")


def parse_ptxas(text: str) -> list[dict]:
    """One dict per ptxas entry function of a `ptxas -v` log, with the warnings of its block."""
    kernels = []
    pending: list[str] = []
    for block in re.split(r"(?=ptxas info\s+: (?:\(C\d+\)|0 bytes gmem))", text):
        pending += [ln.strip() for ln in block.splitlines() if "ptxas warning" in ln or "(C7511)" in ln]
        m = _ENTRY.search(block)
        if not m:
            continue
        props, used = _PROPS.search(block), _USED.search(block)
        kernels.append(
            {
                "kernel": m.group(1),
                "arch": m.group(2),
                "registers": int(used.group(1)) if used else None,
                "static_smem": int(used.group(2)) if used else None,
                "stack": int(props.group(1)) if props else None,
                "spill_stores": int(props.group(2)) if props else None,
                "spill_loads": int(props.group(3)) if props else None,
                "warnings": pending,
            }
        )
        pending = []
    return kernels


@contextlib.contextmanager
def _capture_fd1():
    """What C++ writes to file descriptor 1 (the plugin's ptxas log) while the block runs."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        out: list[str] = []
        try:
            yield out
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _record_launches(launches: list[dict]) -> None:
    """Record each Mosaic kernel's dynamic shared memory from its gpu.launch when lowered (jax 0.10 private)."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    from jaxlib.mlir import ir

    serde = mgpu_core._run_serde_pass

    def record(module, *, serialize, ir_version=None):
        if serialize:

            def visit(op):
                if op.name == "gpu.launch":
                    smem_op = op.operands[-1].owner  # dynamicSharedMemorySize is the last operand
                    value = smem_op.attributes["value"] if "value" in smem_op.attributes else None  # noqa: SIM401
                    func = op.parent
                    while func is not None and func.name != "func.func":
                        func = func.parent
                    name = ir.StringAttr(func.attributes["sym_name"]).value if func is not None else "?"
                    # gpu-kernel-outlining names the kernel `<host func>_kernel`.
                    launches.append(
                        {"kernel": name + "_kernel", "dynamic_smem": ir.IntegerAttr(value).value if value else None}
                    )
                return ir.WalkResult.ADVANCE

            module.operation.walk(visit)
        return serde(module, serialize=serialize, ir_version=ir_version)

    mgpu_core._run_serde_pass = record


def _layer(name: str):
    MODEL_LAYERS = load("model_layers").MODEL_LAYERS

    if name in MODEL_LAYERS:
        return MODEL_LAYERS[name]
    if name == "gpt-oss-120b":
        from test_pallas_lowering import VARIANTS

        import moejax

        return moejax.MoEConfig.preset("gpt_oss", **VARIANTS["gpt_oss"])
    raise KeyError(name)


def compile_case(layer: str, T: int, dtype: str, *rest, grad: bool = False) -> dict:
    *fmt_name, topology, launches = rest
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    import moejax

    cfg = _layer(layer)
    sharding = NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())
    dtype = getattr(jnp, dtype)
    from moejax.quantized import format_by_name

    fmt = format_by_name(fmt_name[0]) if fmt_name else moejax.ExpertWeights
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, dtype, fmt=fmt, layout="stacked"), jax.random.key(0))
    x = jax.ShapeDtypeStruct((T, cfg.hidden_size), dtype)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), (params, x))
    del launches[:]
    t0 = time.perf_counter()
    forward = lambda p, x: moejax.moe_forward(p, x, cfg, impl="pallas")
    backward = jax.grad(lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32)), argnums=(0, 1))
    lowered = jax.jit(backward if grad else forward).trace(*args).lower()
    calls = lowered.as_text().count("stablehlo.custom_call @mosaic_gpu_v2")
    with _capture_fd1() as log:
        lowered.compile()
    kernels = parse_ptxas(log[0])
    for k in kernels:
        k["dynamic_smem"] = next((x["dynamic_smem"] for x in launches if x["kernel"] == k["kernel"]), None)
    return {"mosaic_calls": calls, "kernels": kernels, "seconds": time.perf_counter() - t0, "error": None}


def compile_broken(topology, launches: list[dict]) -> dict:
    """A kernel that must fail the check: gate_up_tiles at Qwen3-30B-A3B sizes with 256 output columns (valid for
    TileBlockSizes and within shared memory, but two 64x256 float32 accumulators need 256 registers a thread)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_kernels import gpu_tiles

    sharding = NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())
    bs = gpu_tiles.TileBlockSizes(block_n=256, block_k=64, max_concurrent_steps=2)
    E, H, I, NT = 128, 2048, 768, 64
    shapes = [((NT * 64, H), jnp.bfloat16), ((E, H, I), jnp.bfloat16), ((E, H, I), jnp.bfloat16)]
    shapes += [((NT,), jnp.int32), ((NT,), jnp.int32), ((1,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    del launches[:]
    lowered = jax.jit(lambda *a: gpu_tiles.gate_up_tiles(*a, block_sizes=bs)).trace(*args).lower()
    with _capture_fd1() as log:
        lowered.compile()
    return {"mosaic_calls": 1, "kernels": parse_ptxas(log[0]), "error": None}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="compile Mosaic GPU kernels for sm_90a (run by the test)")
    ap.add_argument("--out", type=Path, required=True)
    every = [*CASES, *GRAD_CASES, *EXTRA_CASES, BROKEN]
    ap.add_argument("cases", nargs="*", help=f"of {every}; default: all but the extra")
    opts = ap.parse_args(argv)
    if unknown := set(opts.cases) - set(every):
        ap.error(f"unknown cases {sorted(unknown)}")
    os.environ.update(_compile_env())  # also when run by hand; before jax is imported
    os.environ.pop("XLA_FLAGS", None)
    from jax.experimental import topologies

    launches: list[dict] = []
    _record_launches(launches)
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H100_TARGET_CONFIG)
    results = {}
    for label in opts.cases or [*CASES, *GRAD_CASES, BROKEN]:
        try:
            if label == BROKEN:
                results[label] = compile_broken(topology, launches)
            elif label in GRAD_CASES:
                results[label] = compile_case(*GRAD_CASES[label], topology, launches, grad=True)
            else:
                results[label] = compile_case(*{**CASES, **EXTRA_CASES}[label], topology, launches)
        except Exception as err:  # a kernel that does not compile: report it per case, go on with the others
            results[label] = {"error": f"{type(err).__name__}: {str(err)[-3000:]}", "kernels": [], "mosaic_calls": 0}
        print(label, json.dumps(results[label]), flush=True)
    opts.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_pallas_lowering (gpt-oss-120b's shape)
    sys.exit(main(sys.argv[1:]))
