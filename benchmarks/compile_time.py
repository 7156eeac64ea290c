"""Compile time of one jitted MoE layer on CPU, per weight format and row count, native kernels on and off.

    JAX_PLATFORMS=cpu python benchmarks/compile_time.py [--layer qwen3-30b-a3b] [--rows 1 8 512 2048]
        [--formats float32 bfloat16 int4 ...] [--repeats 2]

The target: the layer compiles in <= 2 s. Abstract weights (`jax.eval_shape` of `init_params`): nothing
is allocated, so the full-size layer compiles on any machine. Each case is a fresh `jax.jit` (no cache hit):
trace + lower, then XLA's compile, timed apart; the min of `--repeats`. "native off" is
`moejax.backends.native.enable(False)` (the XLA plans), the compile a build without the extension pays.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
from model_layers import MODEL_LAYERS  # this script's directory is on sys.path
from quant_bench import FORMATS  # the formats quant_bench times (this script's directory is on sys.path)

import moejax
from moejax.backends import native


def compile_seconds(cfg: moejax.MoEConfig, params, x) -> tuple[float, float]:
    """(trace + lower, compile) seconds of a fresh jit of the layer."""
    forward = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg))
    t0 = time.perf_counter()
    lowered = forward.lower(params, x)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="qwen3-30b-a3b", choices=sorted(MODEL_LAYERS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 512, 2048])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cfg = MODEL_LAYERS[args.layer]
    print(f"{args.layer}: H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size}; "
          f"native built: {native.available()} ({native.isa()})")  # fmt: skip
    print(f"{'format':10s} {'T':>5s} {'native':>6s} {'impl':>14s} {'lower s':>8s} {'compile s':>9s} {'total s':>8s}")
    for name in args.formats:
        fmt, dtype = FORMATS[name]
        init = functools.partial(moejax.init_params, cfg, dtype=dtype, fmt=fmt, layout="per_expert")
        params = jax.eval_shape(init, jax.random.key(0))
        x_dtype = jnp.bfloat16 if name == "bfloat16" else jnp.float32
        for T in args.rows:
            x = jax.ShapeDtypeStruct((T, cfg.hidden_size), x_dtype)
            for on in (True, False):
                native.enable(on)
                try:
                    impl = moejax.chosen_impl(params, x, cfg)
                    runs = [compile_seconds(cfg, params, x) for _ in range(args.repeats)]
                finally:
                    native.enable(None)
                lower, comp = min(runs, key=sum)
                print(f"{name:10s} {T:5d} {'on' if on else 'off':>6s} {impl:>14s} {lower:8.2f} {comp:9.2f} "
                      f"{lower + comp:8.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
