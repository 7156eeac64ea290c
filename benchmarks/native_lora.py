"""The cost of LoRA adapters on the native CPU path: one MoE layer with a stack of adapters, native with adapters
against native without and against the CPU / XLA plans with adapters (what impl="auto" ran before the kernels
applied adapters).

Adapters: --adapters adapters of rank --rank on every target the layer has (router, routed experts' gate, up,
down), stacked (`moejax.lora.stack`'s layout: id 0 = none). Decode rows use adapter 1; prefill rows cycle through
every id, 0 included. Times: min over --rounds interleaved rounds of one jitted call each, float32, per-expert
layout.

    python benchmarks/native_lora.py --rows 1 512 --rounds 5
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from model_layers import MODEL_LAYERS  # this script's directory is on sys.path

import moejax
from moejax.backends import native
from moejax.lora import LoRAPair, _target_shapes, from_pairs


def adapter_stack(cfg, n: int, rank: int, key) -> moejax.lora.LoRAParams:
    """A stack of n random adapters of one rank on every target of `cfg` (`a [n+1, ..., r, in]`, id 0 zeros)."""
    pairs = {}
    for i, (name, (lead, n_in, n_out)) in enumerate(_target_shapes(cfg).items()):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        a = jax.random.normal(ka, (n + 1, *lead, rank, n_in)) * n_in**-0.5
        b = jax.random.normal(kb, (n + 1, *lead, n_out, rank)) * 0.01
        scale = jnp.asarray([0.0] + [2.0] * n, jnp.float32)
        pairs[name] = LoRAPair(a.at[0].set(0), b.at[0].set(0), scale)
    return from_pairs(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", default="qwen3-30b-a3b", choices=sorted(MODEL_LAYERS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--plans", nargs="+", default=["cpu"], help="the plans timed with adapters (cpu, xla)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native extension is not built")
    cfg = MODEL_LAYERS[args.layer]
    params = moejax.init_params(cfg, jax.random.key(0), jnp.float32, layout="per_expert")
    lora = adapter_stack(cfg, args.adapters, args.rank, jax.random.key(1))
    step = jax.jit(
        lambda p, x, lora, ids, impl: moejax.moe_forward(p, x, cfg, impl=impl, lora=lora, adapter_ids=ids),
        static_argnums=4,
    )
    print(
        f"{args.layer}: H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size}; "
        f"{args.adapters} adapters of rank {args.rank}; min of {args.rounds} rounds, ms per call"
    )
    for T in args.rows:
        x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size))
        ids = jnp.ones((T,), jnp.int32) if T <= 8 else jnp.arange(T, dtype=jnp.int32) % (args.adapters + 1)
        cases = {"native": (None, None, "native"), "native+lora": (lora, ids, "native")}
        cases |= {f"{plan}+lora": (lora, ids, plan) for plan in args.plans}
        ran = {}
        for name, (lo, i, impl) in cases.items():  # compile first
            step(params, x, lo, i, impl).block_until_ready()
            ran[name] = moejax.chosen_impl(params, x, cfg, impl=impl, lora=lo)
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.rounds):  # interleaved: a shared machine's load falls on every case alike
            for name, (lo, i, impl) in cases.items():
                t0 = time.perf_counter()
                step(params, x, lo, i, impl).block_until_ready()
                best[name] = min(best[name], time.perf_counter() - t0)
        base = best["native"]
        for name in cases:
            print(f"T={T:4d} {name:12s} ({ran[name]:11s}) {best[name] * 1e3:9.2f} ms  /native {best[name] / base:6.2f}")
    print(f"adapter stack: {sum(np.prod(a.shape) for a in jax.tree.leaves(lora)) * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
