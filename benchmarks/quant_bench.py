"""Decode (T=1) of one MoE layer per quantized format vs dense bfloat16 / float32 on CPU, and routed-expert memory.

    JAX_PLATFORMS=cpu python benchmarks/quant_bench.py [--layer qwen3-30b-a3b] [--formats int8 int4 ...] [--rounds 20]

Each format is timed on the per-expert layout (the CPU plans, `impl="auto"`): dense bfloat16 with bfloat16 x, the
others with float32 x; a new random token each round. Rounds interleave the formats, so the load of a shared CPU
falls on all of them alike. Prints the minimum and median step time, the median relative to dense bfloat16, and the
bytes of the routed experts relative to bfloat16.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.bench import MODEL_LAYERS
from moejax.quantized import format_by_name
from moejax.weights import ExpertWeights, expert_fields

FORMATS = {
    "float32": (ExpertWeights, jnp.float32),
    "bfloat16": (ExpertWeights, jnp.bfloat16),
    "int8": (format_by_name("int8"), jnp.bfloat16),
    "fp8_block": (format_by_name("fp8_block"), jnp.bfloat16),
    "int4": (format_by_name("int4"), jnp.bfloat16),
    "int4_asym": (format_by_name("int4", symmetric=False), jnp.bfloat16),
    "mxfp4": (format_by_name("mxfp4"), jnp.bfloat16),
    "nvfp4": (format_by_name("nvfp4"), jnp.bfloat16),
}


def routed_bytes(params: moejax.MoEParams) -> int:
    return sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in expert_fields(params.experts).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="qwen3-30b-a3b", choices=sorted(MODEL_LAYERS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    cfg = MODEL_LAYERS[args.layer]
    bf16_bytes = 3 * cfg.num_experts * cfg.hidden_size * cfg.intermediate_size * 2
    print(f"{args.layer}: H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size}, T=1")
    step = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg))
    xs = [jax.random.normal(jax.random.key(i), (1, cfg.hidden_size)) for i in range(args.rounds + 1)]
    cases = {}
    for name in args.formats:  # build and compile every case first
        fmt, dtype = FORMATS[name]
        params = moejax.init_params(cfg, jax.random.key(0), dtype, fmt=fmt, layout="per_expert")
        x_dtype = jnp.bfloat16 if name == "bfloat16" else jnp.float32  # quantized: float32 x, one-row products
        step(params, xs[0].astype(x_dtype)).block_until_ready()
        cases[name] = (params, x_dtype, routed_bytes(params) / bf16_bytes, [])
    for x in xs[1:]:  # interleaved rounds: a shared CPU's load falls on every format alike
        for params, x_dtype, _, times in cases.values():
            xt = x.astype(x_dtype)
            t0 = time.perf_counter()
            step(params, xt).block_until_ready()
            times.append(time.perf_counter() - t0)
    base = np.median(cases["bfloat16"][3]) if "bfloat16" in cases else None
    print(f"{'format':10s} {'memory/bf16':>11s} {'x dtype':>8s} {'min ms':>8s} {'median ms':>9s} {'median/bf16':>11s}")
    for name, (_, x_dtype, mem, times) in cases.items():
        ratio = f"{np.median(times) / base:11.2f}" if base else ""
        row = f"{name:10s} {mem:11.3f} {jnp.dtype(x_dtype).name:>8s} {min(times) * 1e3:8.2f}"
        print(f"{row} {np.median(times) * 1e3:9.2f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
