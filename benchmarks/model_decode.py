"""Tokens per second of a whole tiny Qwen3-MoE model's greedy decode loop, per `impl=` of its MoE layers.

The model is `moejax.examples.qwen3_moe` (H=64, 16 experts, top-4, 3 MoE layers by default; a random checkpoint
written in the Hugging Face layout, or --checkpoint): `generate` is one jitted program (the prompt, then a
`lax.scan` of decode steps with the KV cache). Each impl's program is compiled once, then timed --rounds times
(the best is kept), the impls taking turns; tokens/s counts the generated tokens of every row. Every impl must
generate the same tokens. The backend impl="auto" runs for a decode step's MoE call (`moejax.chosen_impl`) is
recorded.

    python benchmarks/model_decode.py --json          # writes benchmarks/results/model_decode_<date>_<time>.json
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.examples import qwen3_moe

IMPLS = ("auto", "native", "cpu", "xla")


def decode_rates(params, cfg, prompt, steps: int, impls, rounds: int) -> dict[str, tuple[float, np.ndarray]]:
    """{impl: (best tokens/s over `rounds`, the tokens)}. The impls take turns in each round, so that a slow
    stretch of a shared machine, or the first program's warm-up, does not fall on one of them alone."""
    runs = {impl: functools.partial(qwen3_moe.generate, params, prompt, cfg, steps, impl=impl) for impl in impls}
    tokens = {impl: np.asarray(jax.block_until_ready(run())) for impl, run in runs.items()}  # compiles
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(rounds):
        for impl, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            best[impl] = min(best[impl], time.perf_counter() - start)
    return {impl: (prompt.shape[0] * steps / best[impl], tokens[impl]) for impl in impls}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="a Qwen3-MoE checkpoint directory (default: a random tiny one)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows decoded together")
    parser.add_argument("--prompt", type=int, default=4, help="prompt length")
    parser.add_argument("--steps", type=int, default=256, help="tokens generated per row")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=moejax.IMPLS)
    parser.add_argument("--json", nargs="?", const="", help="write a results file (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or tmp
        if args.checkpoint is None:
            qwen3_moe.write_random_checkpoint(tmp)
        cfg, params = qwen3_moe.load(path)
    rows = []
    for B in args.batch:
        prompt = jnp.asarray(np.random.default_rng(B).integers(0, cfg.vocab_size, (B, args.prompt)), jnp.int32)
        step_x = jax.ShapeDtypeStruct((B, 1, cfg.hidden_size), params.embed.dtype)
        rates = decode_rates(params, cfg, prompt, args.steps, args.impls, args.rounds)
        expected = rates[args.impls[0]][1]
        row = {"batch": B}
        for impl, (rate, tokens) in rates.items():
            if not np.array_equal(tokens, expected):
                print(f"B={B}: impl={impl} generated other tokens than impl={args.impls[0]}", file=sys.stderr)
                return 1
            chosen = moejax.chosen_impl(params.layers[0].mlp, step_x, cfg.moe, impl=impl)
            row |= {f"{impl}_tokens_per_s": round(rate, 1), **({"auto_runs": chosen} if impl == "auto" else {})}
            print(f"B={B:3d} impl={impl:>6} ({chosen:>10}): {rate:9.1f} tokens/s")
        rows.append(row)
    if args.json is not None:
        from report import write

        sizes = f"H={cfg.hidden_size}, E={cfg.moe.num_experts}, K={cfg.moe.top_k}, I={cfg.moe.intermediate_size}"
        notes = (
            f"moejax.examples.qwen3_moe ({sizes}, {cfg.num_layers} layers), greedy generate of {args.steps} tokens "
            f"after a {args.prompt}-token prompt as one jitted program; best of {args.rounds}; 'auto_runs' is what "
            "impl='auto' runs for a decode step's MoE call (moejax.chosen_impl)."
        )
        write("model_decode", rows, args.json or None, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
