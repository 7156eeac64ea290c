"""Compile moejax for TPU on a CPU-only host (deviceless AOT): the compile table of RESULTS.md.

Needs the `tpu-compile` extra (`pip install -e ".[tpu-compile]"`: jax[tpu] at the CI's JAX version, which pins the
matching libtpu). With `JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost`,
`jax.experimental.topologies.get_topology_desc("v5e:2x2", "tpu")` gives compile-only TPU devices, and
`jax.jit(f).lower(<ShapeDtypeStructs placed on them>).compile()` runs XLA's TPU compiler and Mosaic TPU in full.
Mosaic checks each kernel's VMEM at compile time (a tile too large fails with RESOURCE_EXHAUSTED ... vmem); the
compiled program's `memory_analysis()` gives its HBM use (arguments + outputs + temporaries), checked here against
the chip's HBM. (`cost_analysis()` is not used: it counts a loop body once.)

    python benchmarks/tpu_compile.py                      # every case, v5e and v6e
    python benchmarks/tpu_compile.py --chips v5e qwen3-T1-pallas --json out.json
    python benchmarks/tpu_compile.py --fused qwen3-T1-pallas-int4   # the routed experts on the fused kernel

tests/test_tpu_compile.py compiles a subset (`CI_CASES`) of this table.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
from pathlib import Path

# Before JAX initialises: no TPU metadata server or worker lookup on a CPU host.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no /tmp/libtpu_lockfile: several processes compile

# This checkout and model_layers, also when imported from its file (tests/test_tpu_compile.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from model_layers import MODEL_LAYERS

import moejax
from moejax.quantized import format_by_name

GiB = 1 << 30
# topology name, HBM per chip.
CHIPS = {"v5e": ("v5e:2x2", 16 * GiB), "v6e": ("v6e:2x2", 32 * GiB)}
LAYERS = {
    **MODEL_LAYERS,
    "gpt-oss-120b": moejax.MoEConfig.preset(
        "gpt_oss", hidden_size=2880, num_experts=128, top_k=4, intermediate_size=2880
    ),
}
# label: (layer, T, impl, weights). weights: "bfloat16", "float32" or a quantized format's name.
QUANTIZED = ("int8", "int4", "fp8_block", "mxfp4", "nvfp4")
CASES = {
    f"{short}-T{T}-{impl}{'' if w == 'bfloat16' else '-' + w}": (layer, T, impl, w)
    for short, layer in (("qwen3", "qwen3-30b-a3b"), ("gptoss", "gpt-oss-120b"), ("dsv3", "deepseek-v3"))
    for T in (1, 8, 2048)
    for impl in ("pallas", "xla", "ragged")
    for w in ("bfloat16", *QUANTIZED)
    if not (impl == "ragged" and (T <= 8 or w != "bfloat16"))  # ragged: prefill, dense weights
    and not (impl == "xla" and w not in ("bfloat16", "int8"))  # the XLA plans: one quantized kind for reference
    and not (layer == "deepseek-v3" and w == "bfloat16")  # 22.5 GB of bf16 experts: over one chip's HBM
    and not (layer == "gpt-oss-120b" and w in ("int8", "int4"))  # groups of 128 do not divide 2880
}
# What CI compiles (tests/test_tpu_compile.py): both kernels, ragged_dot and one XLA plan, on small-but-real
# shapes, in about 30 s on 2 cores.
CI_LAYER = moejax.MoEConfig.preset("qwen3_moe", hidden_size=1024, num_experts=16, top_k=4, intermediate_size=512)


@functools.cache
def chip(name: str):
    """The first compile-only device of chip `name`'s topology, and its HBM bytes."""
    from jax.experimental import topologies

    topology, hbm = CHIPS[name]
    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0], hbm


def abstract_inputs(cfg: moejax.MoEConfig, T: int, weights: str, device):
    """ShapeDtypeStructs of the layer's parameters (stacked layout) and of x `[T, H]`, placed on `device`."""
    sharding = SingleDeviceSharding(device)
    if weights in ("bfloat16", "float32"):
        init = lambda k: moejax.init_params(cfg, k, jnp.dtype(weights), layout="stacked")
    else:
        init = lambda k: moejax.init_params(cfg, k, jnp.bfloat16, fmt=format_by_name(weights), layout="stacked")
    params = jax.eval_shape(init, jax.random.key(0))
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    x = jax.ShapeDtypeStruct((T, cfg.hidden_size), jnp.bfloat16, sharding=sharding)
    return jax.tree.map(place, params), x


def compile_one(cfg: moejax.MoEConfig, T: int, impl: str, weights: str, chip_name: str) -> dict:
    """Compile `moe_forward(impl=impl)` for one chip. Returns seconds, HBM use, and the program's custom calls;
    `error` instead where compilation failed (a VMEM overflow among others)."""
    device, hbm = chip(chip_name)
    fn = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl=impl))
    start = time.perf_counter()
    try:
        params, x = abstract_inputs(cfg, T, weights, device)
        lowered = fn.lower(params, x)
        compiled = lowered.compile()
    except Exception as err:  # the table records any compiler error as the result
        return {"chip": chip_name, "error": f"{type(err).__name__}: {str(err)[:400]}"}
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    used = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    # Pallas TPU kernels are the program's tpu_custom_calls before XLA compiles it (XLA:TPU implements ragged_dot
    # with tpu_custom_calls of its own); the compiled program must still hold them.
    stablehlo = lowered.as_text()
    compiled_text = compiled.as_text()
    return {
        "chip": chip_name,
        "device_kind": device.device_kind,
        "compile_s": round(seconds, 2),
        "hbm_bytes": int(used),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "hbm_fraction": round(used / hbm, 4),
        "tpu_custom_calls": len(re.findall(r"stablehlo\.custom_call @tpu_custom_call", stablehlo)),
        "compiled_tpu_custom_calls": compiled_text.count('custom_call_target="tpu_custom_call"'),
        "ragged_dot": "ragged_dot" in stablehlo,
    }


# EP over the 4 chips of the topology (label: layer, T, mode, impl): bf16 experts split 4 ways.
EP_CASES = {
    f"{short}-T{T}-ep4-{mode}-{impl}": (layer, T, mode, impl)
    for short, layer in (("qwen3", "qwen3-30b-a3b"), ("gptoss", "gpt-oss-120b"), ("dsv3", "deepseek-v3"))
    for T, mode in ((8, "replicated"), (2048, "all_to_all"))
    for impl in ("pallas", "xla")
}


def compile_ep(cfg: moejax.MoEConfig, T: int, mode: str, impl: str, chip_name: str) -> dict:
    """Compile `moe_forward_ep` over the 4 chips of `chip_name`'s topology (experts split over "expert"; tokens
    replicated, or split in all_to_all mode). HBM per chip."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from moejax.parallel import moe_forward_ep
    from moejax.sharding import partition_specs

    topology, hbm = CHIPS[chip_name]
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = Mesh(np.array(devices), ("expert",))
    start = time.perf_counter()
    try:
        params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, jnp.bfloat16, layout="stacked"), jax.random.key(0))
        place = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
        params = jax.tree.map(place, params, partition_specs(cfg))
        x_spec = P() if mode == "replicated" else P("expert")
        x = jax.ShapeDtypeStruct((T, cfg.hidden_size), jnp.bfloat16, sharding=NamedSharding(mesh, x_spec))
        fn = jax.jit(lambda p, x: moe_forward_ep(p, x, cfg, mesh=mesh, mode=mode, impl=impl))
        compiled = fn.lower(params, x).compile()
    except Exception as err:  # the table records any compiler error as the result
        return {"chip": chip_name, "error": f"{type(err).__name__}: {str(err)[:400]}"}
    mem = compiled.memory_analysis()
    used = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return {
        "chip": chip_name,
        "compile_s": round(time.perf_counter() - start, 2),
        "hbm_bytes": int(used),
        "hbm_fraction": round(used / hbm, 4),
        "compiled_tpu_custom_calls": compiled.as_text().count('custom_call_target="tpu_custom_call"'),
    }


def kernel_vmem(cfg: moejax.MoEConfig, T: int, weights: str, device_kind: str) -> dict:
    """The TPU kernels' tiles for this layer and chip, and an estimate of the VMEM they take (double-buffered
    inputs and outputs plus float32 accumulators, the larger of the two kernels; quantized tiles: codes and scale
    rows, plus the float32/bf16 temporaries of one 256-row decoded chunk), next to the scoped limit Mosaic gets."""
    from moejax.backends.pallas import quantized_weights
    from pallas_kernels import TpuGroupedBlockSizes
    from pallas_kernels.tpu_tiles import TpuTileBlockSizes, quant_pair, vmem_limit

    H, I, K = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    quant, dtype = None, jnp.dtype(weights if weights in ("bfloat16", "float32") else "bfloat16")
    if weights not in ("bfloat16", "float32"):
        init = lambda k: moejax.init_params(cfg, k, jnp.bfloat16, fmt=format_by_name(weights), layout="stacked")
        quant = quant_pair(*quantized_weights("vmem", jax.eval_shape(init, jax.random.key(0)).experts)[::2])
    rows = 8 if T <= 8 else TpuGroupedBlockSizes.default(T * K, H, I, dtype, device_kind).gate_up[0]
    if T > 8 and quant is None:  # megablox gmm
        b = TpuGroupedBlockSizes.default(T * K, H, I, dtype, device_kind)
        used = max(2 * (tm * tk + tk * tn) * dtype.itemsize + 3 * tm * tn * 4 for tm, tk, tn in (b.gate_up, b.down))
        return {"tiles": (b.gate_up, b.down), "vmem_bytes": int(used), "vmem_limit": vmem_limit(device_kind)}
    b = TpuTileBlockSizes.default(H, I, dtype, device_kind, quant, rows)

    def weight(q, k: int, n: int) -> float:  # one buffer of one weight tile, and the decode temporaries
        if q is None:
            return k * n * dtype.itemsize, 0
        scale_rows = -(-k // q.group) * (1 + q.has_zero)
        return k * n * q.code_bytes + scale_rows * n * q.scale_itemsize, 256 * n * (4 + 4 + 2)

    (gu, gu_tmp), (dn, dn_tmp) = (
        weight(quant and quant[0], b.block_h, b.block_i),
        weight(quant and quant[1], b.block_i_down, b.block_h_down),
    )
    gate_up = 2 * (2 * gu + rows * b.block_h * 2 + rows * b.block_i * 2) + 2 * rows * b.block_i * 4 + gu_tmp
    down = 2 * (dn + rows * b.block_i_down * 2 + rows * b.block_h_down * 4) + rows * b.block_h_down * 4 + dn_tmp
    tiles = (b.block_h, b.block_i, b.block_i_down, b.block_h_down)
    return {"tiles": tiles, "vmem_bytes": int(max(gate_up, down)), "vmem_limit": vmem_limit(device_kind)}


def compile_fused(cfg: moejax.MoEConfig, T: int, weights: str, chip_name: str) -> dict:
    """Compile the routed experts alone on the fused TPU kernel (`TpuTileBlockSizes.default(..., fused=True)`:
    decode, or the tiled prefill) for one chip; `error` where it failed or the whole-H tiles do not fit."""
    from moejax.backends.pallas import quantized_weights
    from pallas_kernels import TpuDecodeBlockSizes, TpuGroupedBlockSizes, moe_tpu_decode, moe_tpu_grouped
    from pallas_kernels.tpu_tiles import quant_pair

    device, _ = chip(chip_name)
    params, x = abstract_inputs(cfg, T, weights, device)
    e = params.experts
    w = quantized_weights("fused", e) if weights not in ("bfloat16", "float32") else (e.gate, e.up, e.down)
    H, I, K, kind = cfg.hidden_size, cfg.intermediate_size, cfg.top_k, device.device_kind
    quant, dtype = quant_pair(w[0], w[2]), jnp.dtype("bfloat16" if weights != "float32" else weights)
    ids = jax.ShapeDtypeStruct((T, K), jnp.int32, sharding=x.sharding)
    slot_w = jax.ShapeDtypeStruct((T, K), jnp.float32, sharding=x.sharding)
    start = time.perf_counter()
    try:
        if T <= 8:
            bs = TpuDecodeBlockSizes.default(H, I, dtype, kind, quant, fused=True)
            fn = functools.partial(moe_tpu_decode, block_sizes=bs, device_kind=kind)
        else:
            g = TpuGroupedBlockSizes.default(T * K, H, I, dtype, kind, quant)
            tiles = TpuDecodeBlockSizes.default(H, I, dtype, kind, quant, rows=g.gate_up[0], fused=True)
            bs = TpuGroupedBlockSizes(g.gate_up, g.down, tiles)
            fn = functools.partial(moe_tpu_grouped, block_sizes=bs, device_kind=kind)
        if (bs.fused_block_i if T <= 8 else bs.tiles.fused_block_i) is None:
            return {"chip": chip_name, "error": "the fused kernel's tiles do not fit VMEM"}
        compiled = jax.jit(fn).lower(x, *w, ids, slot_w).compile()
    except Exception as err:  # the table records any compiler error as the result
        return {"chip": chip_name, "error": f"{type(err).__name__}: {str(err)[:400]}"}
    mem = compiled.memory_analysis()
    used = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return {
        "chip": chip_name,
        "compile_s": round(time.perf_counter() - start, 2),
        "hbm_bytes": int(used),
        "fused_block_i": bs.fused_block_i if T <= 8 else bs.tiles.fused_block_i,
        "compiled_tpu_custom_calls": compiled.as_text().count('custom_call_target="tpu_custom_call"'),
    }


def problems(row: dict, impl: str) -> list[str]:
    """What is wrong with a compiled case: an error, HBM over the chip's, no Pallas TPU call for impl='pallas'."""
    if "error" in row:
        return [row["error"]]
    out = []
    if row["hbm_fraction"] > 1:
        out.append(f"HBM {row['hbm_bytes'] / GiB:.1f} GiB over the chip's")
    if impl == "pallas" and min(row["tpu_custom_calls"], row["compiled_tpu_custom_calls"]) == 0:
        out.append("no Pallas TPU call (tpu_custom_call) in the program of impl='pallas'")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"labels (default all): {', '.join(CASES)}")
    parser.add_argument("--chips", nargs="+", default=list(CHIPS), choices=list(CHIPS))
    parser.add_argument("--json", nargs="?", const="", metavar="PATH", help="results file (default: results/)")
    parser.add_argument("--ep", nargs="+", default=[], help=f"EP cases over 4 chips: {', '.join(EP_CASES)}")
    parser.add_argument("--fused", action="store_true", help="pallas cases: the routed experts on the fused kernel")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES] + [c for c in args.ep if c not in EP_CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}")
    rows, failed = [], 0
    print(f"jax {jax.__version__}; {os.cpu_count()} CPUs")
    print(f"{'case':28} {'chip':4} {'compile s':>9} {'HBM GiB':>8} {'HBM %':>6} {'tpu calls':>9}  problems")
    for label in args.ep:
        layer, T, mode, impl = EP_CASES[label]
        for chip_name in args.chips:
            row = {"case": label, **compile_ep(LAYERS[layer], T, mode, impl, chip_name)}
            bad = problems(row, impl) if "error" in row or row["hbm_fraction"] > 1 else []
            if impl == "pallas" and not bad and row["compiled_tpu_custom_calls"] == 0:
                bad = ["no tpu_custom_call in the program of impl='pallas'"]
            failed += bool(bad)
            rows.append({**row, "problems": bad})
            print(
                f"{label:28} {chip_name:4} {row.get('compile_s', '-'):>9} "
                f"{row.get('hbm_bytes', 0) / GiB:8.2f} {100 * row.get('hbm_fraction', 0):6.1f} "
                f"{row.get('compiled_tpu_custom_calls', '-'):>9}  {'; '.join(bad)[:300]}",
                flush=True,
            )
    for label in args.cases if args.fused else []:
        layer, T, _, weights = CASES[label]
        for chip_name in args.chips:
            row = {"case": f"{label}-fused", **compile_fused(LAYERS[layer], T, weights, chip_name)}
            failed += "error" in row
            rows.append(row)
            print(
                f"{label + '-fused':28} {chip_name:4} {row.get('compile_s', '-'):>9} "
                f"{row.get('hbm_bytes', 0) / GiB:8.2f} {'-':>6} {row.get('compiled_tpu_custom_calls', '-'):>9}  "
                f"{row.get('error', '')[:300] or 'block_i=' + str(row['fused_block_i'])}",
                flush=True,
            )
    for label in [] if args.fused else args.cases or ([] if args.ep else list(CASES)):
        layer, T, impl, weights = CASES[label]
        for chip_name in args.chips:
            row = {"case": label, **compile_one(LAYERS[layer], T, impl, weights, chip_name)}
            bad = problems(row, impl)
            failed += bool(bad)
            rows.append({**row, "problems": bad})
            if "error" in row:
                print(f"{label:28} {chip_name:4} {'-':>9} {'-':>8} {'-':>6} {'-':>9}  {'; '.join(bad)}", flush=True)
                continue
            print(
                f"{label:28} {chip_name:4} {row['compile_s']:9.1f} {row['hbm_bytes'] / GiB:8.2f} "
                f"{100 * row['hbm_fraction']:6.1f} {row['tpu_custom_calls']:9d}  {'; '.join(bad)}",
                flush=True,
            )
    if args.json is not None:
        from report import write  # benchmarks/report.py: the results files' one schema

        flat = [{k: "; ".join(map(str, v)) if isinstance(v, list | tuple) else v for k, v in r.items()} for r in rows]
        write("tpu_compile", flat, args.json or None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
