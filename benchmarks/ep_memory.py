"""Per-device compiled memory of `moe_forward_ep(mode="all_to_all")` at n = 1, 2, 4, 8 CPU devices.

`python benchmarks/ep_memory.py [--tokens 4096] [--run] [--json PATH]`

For each size n of the expert axis it compiles the jitted EP forward (x split over the axis, experts placed by
`shard_params`) and prints XLA's `memory_analysis()` of the compiled program: temporary bytes (buffers that live
only during the call: dispatch buffers, the plan's work arrays), argument and output bytes, all per device, with
the bytes one device sends per call (`moejax.parallel.communication_bytes`) and the buffer sizes of
`moejax.dispatch.all_to_all_capacity` (rows C per block and round, pairs P per compute chunk). Nothing is run:
compiling is enough.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# This checkout's moejax, not an installed one, when run as a script (sys.path[0] is benchmarks/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before jax is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax import dispatch, parallel, sharding
from moejax.params import with_experts_layout

DEVICES = (1, 2, 4, 8)


def run_ms(compiled, cfg: moejax.MoEConfig, num_tokens: int, mesh, dtype: jnp.dtype, repeats: int = 3) -> float:
    """Median wall time in ms of the compiled forward on `init_params` weights and random tokens (all n devices
    share the host's cores: this follows the total work, not a multi-device speed-up)."""
    params = with_experts_layout(moejax.init_params(cfg, jax.random.key(0), dtype=dtype), "stacked")
    params = sharding.shard_params(params, cfg, mesh)
    x = jax.random.normal(jax.random.key(1), (num_tokens, cfg.hidden_size), dtype)
    x = jax.device_put(x, NamedSharding(mesh, P("expert")))
    jax.block_until_ready(compiled(params, x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(cfg: moejax.MoEConfig, num_tokens: int, n: int, dtype: jnp.dtype, run: bool = False) -> dict:
    """Compile the all_to_all forward on an n-device expert axis; its per-device memory and bytes sent (and, with
    `run`, its time)."""
    mesh = jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n])
    init = functools.partial(moejax.init_params, cfg, dtype=dtype)
    params = jax.eval_shape(lambda key: with_experts_layout(init(key), "stacked"), jax.random.key(0))
    params = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, s)),
        params,
        sharding.partition_specs(cfg),
    )
    x = jax.ShapeDtypeStruct((num_tokens, cfg.hidden_size), dtype, sharding=NamedSharding(mesh, P("expert")))
    fn = jax.jit(functools.partial(parallel.moe_forward_ep, cfg=cfg, mesh=mesh, mode="all_to_all"))
    start = time.perf_counter()
    compiled = fn.lower(params, x).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    sent = parallel.communication_bytes(cfg, num_tokens, mode="all_to_all", expert_size=n, dtype=dtype)
    rows, pairs = dispatch.all_to_all_capacity(cfg, num_tokens, n, dispatch.CAPACITY_FACTOR)
    return {
        "devices": n,
        "rows_per_block": rows,
        "pairs_per_chunk": pairs,
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "sent_bytes": sent["total"],
        "compile_s": round(seconds, 2),
        "run_ms": round(run_ms(compiled, cfg, num_tokens, mesh, dtype), 1) if run else None,
    }


def _table(rows: list[dict]) -> str:
    base = rows[0]["temp_bytes"]
    head = (
        f"{'n':>3} {'rows C':>7} {'pairs P':>8} {'temp MB':>9} {'vs n=1':>7} {'args MB':>8} {'out MB':>7} "
        f"{'sent MB':>8} {'compile s':>10} {'run ms':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['devices']:>3} {r['rows_per_block']:>7} {r['pairs_per_chunk']:>8} {r['temp_bytes'] / 1e6:>9.2f} "
            f"{r['temp_bytes'] / base:>7.2f} {r['argument_bytes'] / 1e6:>8.2f} {r['output_bytes'] / 1e6:>7.2f} "
            f"{r['sent_bytes'] / 1e6:>8.2f} {r['compile_s']:>10.1f} {'-' if r['run_ms'] is None else r['run_ms']:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--run", action="store_true", help="also run each program and time it")
    parser.add_argument("--json", nargs="?", const="", metavar="PATH", help="results file (default: results/)")
    args = parser.parse_args()
    cfg = moejax.MoEConfig.preset(
        "deepseek_v3",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_experts=args.experts,
        top_k=args.top_k,
        shared_intermediate_size=args.intermediate,
    )
    rows = [measure(cfg, args.tokens, n, jnp.dtype(args.dtype), args.run) for n in DEVICES]
    cfg_line = (
        f"deepseek_v3 semantics, T={args.tokens} H={args.hidden} I={args.intermediate} E={args.experts} "
        f"K={args.top_k} {args.dtype}, mode=all_to_all, per device"
    )
    print(cfg_line)
    print(_table(rows))
    if args.json is not None:
        from report import write  # benchmarks/report.py: the results files' one schema

        write("ep_memory", rows, args.json or None, notes=f"{cfg_line}; jax {jax.__version__}")


if __name__ == "__main__":
    main()
