"""Expert-parallel communication and time on 8 simulated CPU devices: `python benchmarks/ep_bench.py [--json PATH]`.

For decode (T = 1, 8) and prefill (T = 512) it prints, per mode of `moejax.parallel.moe_forward_ep`, the bytes one
device sends per step computed from the shapes (`moejax.parallel.communication_bytes`: the static buffers of one
round), the bytes a ragged all-to-all would send for the routing of this run (the token rows that actually leave a
device, from the EP statistics), the rounds "all_to_all" runs for this routing (each sends the static buffers
again), and the measured step time next to the single-device `moe_forward`.

CPU devices here are threads of one process sharing the host's cores: times show the overhead of the dispatch
and the collectives, not a multi-GPU speed-up.
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
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax import dispatch, parallel, sharding

TOKENS = (1, 8, 512)


def _time(fn, *args, repeats: int) -> float:
    """Median wall time in ms of `fn(*args)` after one warm-up call (which compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def all_to_all_rounds(params, x, cfg: moejax.MoEConfig, n: int) -> int:
    """Rounds "all_to_all" mode runs for this routing: the busiest (source, destination) block's visits (tokens with
    a slot on the destination) over the rows a block holds per round (`dispatch.all_to_all_capacity`)."""
    T = x.shape[0]
    T_l = -(-T // n)
    indices = np.asarray(moejax.route(params, x, cfg).indices)  # [T, K]
    owner = np.where(indices < cfg.num_experts, indices // (cfg.num_experts // n), n)
    visits = np.zeros((n, n + 1), np.int64)  # [source, destination]
    for t in range(T):
        visits[t // T_l, np.unique(owner[t])] += 1
    rows, _ = dispatch.all_to_all_capacity(cfg, T, n, dispatch.CAPACITY_FACTOR)
    return int(-(-visits[:, :n].max() // rows))


def run(args: argparse.Namespace) -> list[dict]:
    cfg = moejax.MoEConfig.preset(
        "deepseek_v3",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_experts=args.experts,
        top_k=args.top_k,
        shared_intermediate_size=args.intermediate,
    )
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("expert",))
    dtype = jnp.dtype(args.dtype)
    params = moejax.init_params(cfg, jax.random.key(0), dtype)
    sharded = sharding.shard_params(params, cfg, mesh)
    single = jax.jit(functools.partial(moejax.moe_forward, cfg=cfg))
    row_bytes = cfg.hidden_size * dtype.itemsize + 2 * cfg.top_k * 4 + cfg.hidden_size * 4  # out + meta + back
    rows = []
    for T in TOKENS:
        x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size), jnp.float32).astype(dtype)
        single_ms = _time(single, params, x, repeats=args.repeats)
        for mode in dispatch.EP_MODES:
            spec = P() if mode == "replicated" else (P("expert") if T % n == 0 else P())
            x_placed = jax.device_put(x, NamedSharding(mesh, spec))
            ep = functools.partial(parallel.moe_forward_ep, cfg=cfg, mesh=mesh, mode=mode)
            ms = _time(jax.jit(ep), sharded, x_placed, repeats=args.repeats)
            stats = jax.jit(functools.partial(ep, return_stats=True))(sharded, x_placed).stats
            sizes = parallel.communication_bytes(cfg, T, mode=mode, expert_size=n, dtype=dtype)
            ragged = None if mode == "replicated" else round(float(np.mean(stats.remote_rows)) * row_bytes)
            rounds = None if mode == "replicated" else all_to_all_rounds(params, x, cfg, n)
            rows.append(
                {
                    "tokens": T,
                    "mode": mode,
                    **{f"{k}_bytes": v for k, v in sizes.items()},
                    "ragged_bytes": ragged,
                    "rounds": rounds,
                    "remote_pairs": int(np.sum(stats.remote_pairs)),
                    "ep_ms": round(ms, 3),
                    "single_device_ms": round(single_ms, 3),
                }
            )
    return rows


def _table(rows: list[dict], cfg_line: str) -> str:
    head = (
        f"{'T':>5} {'mode':<11} {'dispatch B':>11} {'combine B':>10} {'reduce B':>10} {'total B':>10} "
        f"{'ragged B':>10} {'rounds':>6} {'EP ms':>9} {'1-dev ms':>9}"
    )
    lines = [cfg_line, head, "-" * len(head)]
    for r in rows:
        ragged = "-" if r["ragged_bytes"] is None else f"{r['ragged_bytes']:,}"
        rounds = "-" if r["rounds"] is None else str(r["rounds"])
        lines.append(
            f"{r['tokens']:>5} {r['mode']:<11} {r['dispatch_bytes']:>11,} {r['combine_bytes']:>10,} "
            f"{r['reduce_bytes']:>10,} {r['total_bytes']:>10,} {ragged:>10} {rounds:>6} {r['ep_ms']:>9.2f} "
            f"{r['single_device_ms']:>9.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", nargs="?", const="", metavar="PATH", help="results file (default: results/)")
    args = parser.parse_args()
    rows = run(args)
    cfg_line = (
        f"deepseek_v3 semantics, H={args.hidden} I={args.intermediate} E={args.experts} K={args.top_k} "
        f"{args.dtype}, {jax.device_count()} CPU devices (expert axis), bytes sent per device per step"
    )
    print(_table(rows, cfg_line))
    if args.json is not None:
        from report import write  # benchmarks/report.py: the results files' one schema

        write("ep_bench", rows, args.json or None, notes=f"{cfg_line}; jax {jax.__version__}")


if __name__ == "__main__":
    main()
