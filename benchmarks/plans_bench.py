"""`python benchmarks/plans_bench.py [--quick] [--json out.json]`: the XLA plans on real layer shapes, next to
ceilings measured in the same run.

For each case it prints the step time, the union size (distinct experts read), the achieved GB/s over the
bytes of the union experts' weights, and the achieved GFLOP/s over the useful routed flops (2·3·H·I per
(token, slot) pair), next to two ceilings measured in the same process: the read bandwidth of a large jitted
matrix-vector product and the rate of a large matmul. Decode cases route random tokens, one token repeated on
every row, and correlated tokens (neighbouring rows share most of their experts, like a real trace).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import time
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from model_layers import MODEL_LAYERS, Layer  # this script's directory is on sys.path

from moejax import chosen_impl, init_params, moe_forward, route
from moejax.__main__ import positive_int  # the CLI's argparse type: an int >= 1
from moejax.analysis import union_size
from moejax.config import MoEConfig


def layers(quick: bool) -> list[Layer]:
    if quick:
        tiny = MoEConfig.preset("qwen3_moe", hidden_size=128, num_experts=16, top_k=4, intermediate_size=64)
        return [Layer("tiny-qwen3", tiny)]
    # DeepSeek-V3 with E scaled from 256 to 32 (groups of 4, 4 of 8 kept) and the routed experts alone, to fit 24 GiB.
    deepseek_e32 = MODEL_LAYERS["deepseek-v3"].replace(num_experts=32, shared_expert="none", shared_intermediate_size=0)
    return [Layer("qwen3-30b-a3b", MODEL_LAYERS["qwen3-30b-a3b"]), Layer("deepseek-v3/E32", deepseek_e32)]


class ProgressBar:
    """A one-line progress bar, `[#####.......] 3/12  0:42 elapsed, ~1:10 left  label`, redrawn in place on `stream`
    (default stderr) when it is a terminal; silent otherwise (a pipe, a file, a CI log), so output stays clean.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24):
        self.total, self.width = total, width
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty())
        self.start = time.perf_counter()
        self._shown = 0  # length of the line on screen, to blank it out

    def update(self, done: int, label: str = "") -> None:
        """Show `done` of `total` steps finished, `label` naming the step now running."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        filled = round(self.width * done / max(self.total, 1))
        left = f", ~{_clock(elapsed / done * (self.total - done))} left" if done else ""
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{self.total}  {_clock(elapsed)} elapsed{left}  {label}"
        line = line[: shutil.get_terminal_size().columns - 1]  # a wrapped line could not be redrawn in place
        self.stream.write("\r" + line.ljust(self._shown))
        self.stream.flush()
        self._shown = len(line)

    def close(self) -> None:
        """Erase the bar (the results are printed after it)."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def _time(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)` after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def measure_ceilings(dtype, quick: bool, repeats: int) -> dict[str, float]:
    """Read bandwidth of a large mat-vec (GB/s) and the rate of a large matmul (GFLOP/s) in `dtype`."""
    n = 1024 if quick else 8192
    key = jax.random.key(0)
    w = jax.random.normal(key, (n, n), jnp.float32).astype(dtype)
    v = jnp.ones((1, n), dtype)
    matvec = jax.jit(lambda v, w: v @ w)
    seconds = _time(matvec, v, w, repeats=repeats)
    bandwidth = w.size * w.dtype.itemsize / seconds / 1e9
    m = 512 if quick else 2048
    a = jax.random.normal(key, (m, m), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    seconds = _time(matmul, a, a, repeats=repeats)
    return {"read_GBps": bandwidth, "matmul_GFLOPs": 2 * m**3 / seconds / 1e9}


def decode_inputs(kind: str, T: int, H: int, key) -> jax.Array:
    k1, k2 = jax.random.split(key)
    if kind == "random":
        return jax.random.normal(k1, (T, H))
    if kind == "repeated":
        return jnp.broadcast_to(jax.random.normal(k1, (1, H)), (T, H))
    # correlated: each row is the previous one plus a little noise, so neighbours share most experts
    steps = 0.35 * jax.random.normal(k2, (T, H))
    return jax.random.normal(k1, (1, H)) + jnp.cumsum(steps, axis=0) / jnp.sqrt(jnp.arange(1, T + 1))[:, None]


def run_cases(args) -> list[dict]:
    rows: list[dict] = []
    cases = []
    for layer in layers(args.quick):
        for dtype in args.dtypes:
            for T in args.decode:
                for kind in ("random", "repeated", "correlated"):
                    if T == 1 and kind != "random":
                        continue
                    cases.append((layer, dtype, "decode", T, kind))
            for T in args.prefill:
                cases.append((layer, dtype, "prefill", T, "random"))
    ceilings: dict[str, dict[str, float]] = {}
    params_cache: dict[tuple[str, str], object] = {}
    progress = ProgressBar(len(cases))
    for i, (layer, dtype, phase, T, kind) in enumerate(cases):
        cfg = layer.cfg
        progress.update(i, f"{layer.name} {dtype} {phase} T={T} {kind}")
        if dtype not in ceilings:
            ceilings[dtype] = measure_ceilings(jnp.dtype(dtype), args.quick, args.repeats)
        if (layer.name, dtype) not in params_cache:
            params_cache.clear()  # one layer's weights in memory at a time
            params = init_params(cfg, jax.random.key(1), jnp.dtype(dtype))
            params_cache[(layer.name, dtype)] = jax.block_until_ready(params)
        params = params_cache[(layer.name, dtype)]
        x = decode_inputs(kind, T, cfg.hidden_size, jax.random.key(T)).astype(dtype)
        start = time.perf_counter()
        forward = jax.jit(lambda p, x, cfg=cfg: moe_forward(p, x, cfg)).lower(params, x).compile()
        compile_s = time.perf_counter() - start
        seconds = _time(forward, params, x, repeats=args.repeats)
        routing_indices = jax.jit(lambda p, x, cfg=cfg: route(p, x, cfg).indices)(params, x)
        n_union = int(union_size(routing_indices, cfg))
        expert_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * jnp.dtype(dtype).itemsize
        flops = 2 * 3 * cfg.hidden_size * cfg.intermediate_size * T * cfg.top_k
        ceiling = ceilings[dtype]
        gbps = n_union * expert_bytes / seconds / 1e9
        gflops = flops / seconds / 1e9
        rows.append(
            {
                "layer": layer.name,
                "dtype": dtype,
                "phase": phase,
                "T": T,
                "tokens": kind,
                "plan": chosen_impl(params, x, cfg),
                "ms": seconds * 1e3,
                "union": n_union,
                "GBps": gbps,
                "GFLOPs": gflops,
                "pct_read_bw": 100 * gbps / ceiling["read_GBps"],
                "pct_matmul": 100 * gflops / ceiling["matmul_GFLOPs"],
                "compile_s": compile_s,
                "ceiling_read_GBps": ceiling["read_GBps"],
                "ceiling_matmul_GFLOPs": ceiling["matmul_GFLOPs"],
            }
        )
    progress.close()
    return rows


def format_table(rows: list[dict], ceilings_note: str) -> str:
    header = (
        f"{'layer':<16} {'dtype':<8} {'phase':<7} {'T':>5} {'tokens':<10} {'plan':<11} {'ms':>9} "
        f"{'union':>5} {'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8} {'%mm':>5} {'compile s':>9}"
    )
    lines = [ceilings_note, header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['layer']:<16} {r['dtype']:<8} {r['phase']:<7} {r['T']:>5} {r['tokens']:<10} {r['plan']:<11} "
            f"{r['ms']:>9.3f} {r['union']:>5} {r['GBps']:>7.1f} {r['pct_read_bw']:>5.0f} {r['GFLOPs']:>8.1f} "
            f"{r['pct_matmul']:>5.0f} {r['compile_s']:>9.2f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--decode", nargs="+", type=positive_int, default=[1, 2, 4, 8], metavar="T")
    parser.add_argument("--prefill", nargs="+", type=positive_int, default=[512, 2048], metavar="T")
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")


def run(args: argparse.Namespace) -> list[dict]:
    rows = run_cases(args)
    ceilings = sorted({(r["dtype"], r["ceiling_read_GBps"], r["ceiling_matmul_GFLOPs"]) for r in rows})
    note = "\n".join(f"ceilings {d}: mat-vec read {bw:.1f} GB/s, matmul {mm:.1f} GFLOP/s" for d, bw, mm in ceilings)
    machine = f"{platform.machine()} {platform.processor() or ''} {jax.device_count()}x{jax.default_backend()}"
    header = f"moejax bench {datetime.date.today()} jax {jax.__version__} on {machine.strip()}"
    print(header)
    print(format_table(rows, note))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the XLA plans on real layer shapes against measured ceilings")
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
