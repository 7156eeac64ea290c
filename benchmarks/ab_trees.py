"""Two checkouts of moejax side by side: `moe_forward` timed in each, interleaved, on the Qwen3-30B-A3B layer (float32).

Each round runs one process per checkout (A, then B), each importing moejax from its own tree, compiling, then
timing the cases (median of --calls calls after a warm-up); rounds alternate A and B so both see the same stretches
of load. For a refactor that should change nothing: run it before a merge with the old tree as A.

    git worktree add /tmp/old <old commit>    # plus its built extension: cp moejax/_native_cpu*.so /tmp/old/moejax/
    python benchmarks/ab_trees.py /tmp/old . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = [(1, "auto"), (8, "auto"), (512, "auto"), (1, "cpu"), (8, "cpu"), (128, "cpu")]


def measure(calls: int) -> dict[str, float]:
    """In the child: median seconds per call of each case with the moejax on sys.path."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moejax
    from moejax.weights import to_layout

    # The Qwen3-30B-A3B layer (benchmarks/model_layers.py), spelled out: any checkout's moejax builds it.
    cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=2048, num_experts=128, top_k=8, intermediate_size=768)
    params = moejax.init_params(cfg, jax.random.key(0), jnp.float32)
    per_expert = dataclasses.replace(params, experts=to_layout(params.experts, "per_expert"))
    out = {}
    for T, impl in CASES:
        x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size), jnp.float32)
        f = jax.jit(lambda p, x, impl=impl: moejax.moe_forward(p, x, cfg, impl=impl))
        p = per_expert if impl == "cpu" else params
        jax.block_until_ready(f(p, x))
        times = []
        for _ in range(calls if T < 128 else max(3, calls // 3)):
            start = time.perf_counter()
            jax.block_until_ready(f(p, x))
            times.append(time.perf_counter() - start)
        out[f"T={T} {impl}"] = float(np.median(times))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", nargs="?", help="checkout A (root of a moejax tree)")
    parser.add_argument("b", nargs="?", help="checkout B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT" + json.dumps(measure(args.calls)))
        return
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for name, tree in (("A", args.a), ("B", args.b)):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "JAX_PLATFORMS": "cpu"}
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--calls", str(args.calls)]
            run = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True)
            line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))
            results[name].append(json.loads(line[len("RESULT") :]))
    print(f"{'case':12} {'A ms':>9} {'B ms':>9} {'B/A':>6}   (median over {args.rounds} rounds)")
    for key in results["A"][0]:
        a = statistics.median(r[key] for r in results["A"]) * 1e3
        b = statistics.median(r[key] for r in results["B"]) * 1e3
        print(f"{key:12} {a:9.2f} {b:9.2f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
