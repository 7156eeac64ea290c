"""Step time of one MoE layer with LoRA adapters in the batch vs the base layer, on CPU.

    JAX_PLATFORMS=cpu python benchmarks/lora_bench.py [--layer qwen3-30b-a3b] [--rank 16] [--adapters 4]
        [--decode 1 2 4 8] [--prefill 512] [--repeats 20] [--json out.json]
        [--targets router experts.gate ...] [--num-experts 16]

float32 weights in the default layout (per-expert on CPU), `impl="auto"`. The adapter stack holds `--adapters`
random adapters of rank `--rank` on the router, the routed experts' gate/up/down and, where the family has one, the
shared expert (gate/up/down and its sigmoid gate); row t of a batch uses adapter `t mod n + 1`, so a decode batch
of T >= n rows mixes all n adapters (T = 1 has one, T = 2 two). Both programs are compiled first; then rounds
interleave base and LoRA steps with a fresh x each round, so the load of a shared CPU falls on both alike. The
ratio is that of the minimum step times (a noisy machine inflates the median, not the minimum); the median is
printed beside it, and the ratio of the minimum CPU times of the process (all XLA threads; less sensitive to
other processes taking the cores, still sensitive to their memory traffic). Targets: decode <= 1.15x,
prefill <= 1.2x.

Where the time goes: `--targets` keeps only some adapter targets (e.g. `router`, or `experts.gate`), and
`--num-experts` shrinks E (same H, I, K: the union per step is the same, and the LoRA program compiles in seconds
instead of minutes).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from model_layers import MODEL_LAYERS  # this script's directory is on sys.path

import moejax
from moejax.config import SharedExpert
from moejax.lora import ExpertLoRA, LoRAPair, LoRAParams, SharedLoRA, from_pairs, stack

TARGETS = {"decode": 1.15, "prefill": 1.2}


def random_adapter(cfg: moejax.MoEConfig, rank: int, rng: np.random.Generator, alpha: float = 32.0) -> LoRAParams:
    """One adapter of rank `rank` on every target `cfg` has (A and B both random, so every delta is non-zero)."""
    H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    scale = np.float32(alpha / rank)

    def pair(lead: tuple[int, ...], n_in: int, n_out: int) -> LoRAPair:
        a = rng.standard_normal((*lead, rank, n_in), np.float32) / np.sqrt(n_in)
        b = rng.standard_normal((*lead, n_out, rank), np.float32) * (0.1 / np.sqrt(rank))
        return LoRAPair(jnp.asarray(a), jnp.asarray(b), jnp.asarray(scale))

    experts = ExpertLoRA(gate=pair((E,), H, I), up=pair((E,), H, I), down=pair((E,), I, H))
    shared = None
    if cfg.shared_expert is not SharedExpert.NONE:
        Is = cfg.shared_intermediate_size
        gated = cfg.shared_expert is SharedExpert.SIGMOID_GATED
        shared = SharedLoRA(
            gate=pair((), H, Is),
            up=pair((), H, Is),
            down=pair((), Is, H),
            gate_kernel=pair((), H, 1) if gated else None,
        )
    return LoRAParams(router=pair((), H, cfg.num_selectable), experts=experts, shared=shared)


def time_case(cfg, params, lora, T: int, repeats: int, key: int) -> dict:
    """Min and median seconds of the base step and of the LoRA step on `T` rows (interleaved rounds)."""
    num_adapters = lora.num_ids - 1
    ids = jnp.asarray(np.arange(T) % num_adapters + 1, jnp.int32)
    base = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg))
    adapted = jax.jit(lambda p, x, l, i: moejax.moe_forward(p, x, cfg, lora=l, adapter_ids=i))
    xs = [jax.random.normal(jax.random.key(key + i), (T, cfg.hidden_size)) for i in range(repeats + 1)]
    base(params, xs[0]).block_until_ready()  # compile both first
    adapted(params, xs[0], lora, ids).block_until_ready()
    times: dict[str, list[float]] = {"base": [], "lora": []}
    cpu: dict[str, list[float]] = {"base": [], "lora": []}
    for x in xs[1:]:
        for name, step, args in (("base", base, (params, x)), ("lora", adapted, (params, x, lora, ids))):
            t0, c0 = time.perf_counter(), time.process_time()
            step(*args).block_until_ready()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {"T": T, "distinct_adapters": min(T, num_adapters)}
    for name, ts in times.items():
        out[f"{name}_min_ms"] = 1e3 * min(ts)
        out[f"{name}_median_ms"] = 1e3 * float(np.median(ts))
        out[f"{name}_cpu_min_ms"] = 1e3 * min(cpu[name])
    out["ratio_min"] = out["lora_min_ms"] / out["base_min_ms"]
    out["ratio_median"] = out["lora_median_ms"] / out["base_median_ms"]
    out["ratio_cpu_min"] = out["lora_cpu_min_ms"] / out["base_cpu_min_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="qwen3-30b-a3b", choices=sorted(MODEL_LAYERS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--decode", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--prefill", type=int, nargs="*", default=[512])
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per case (decode)")
    parser.add_argument("--prefill-repeats", type=int, default=5, help="timed rounds per case (prefill)")
    parser.add_argument("--json", nargs="?", const="", metavar="PATH", help="results file (default: results/)")
    parser.add_argument("--targets", nargs="*", help="adapter targets to keep (LoRAParams.pairs names); default all")
    parser.add_argument("--num-experts", type=int, help="override E of the layer (profiling)")
    args = parser.parse_args()
    cfg = MODEL_LAYERS[args.layer]
    if args.num_experts:
        cfg = cfg.replace(num_experts=args.num_experts)
    rng = np.random.default_rng(0)
    params = moejax.init_params(cfg, jax.random.key(0), jnp.float32)
    lora = stack([random_adapter(cfg, args.rank, rng) for _ in range(args.adapters)])
    if args.targets:
        lora = from_pairs({name: pair for name, pair in lora.pairs().items() if name in args.targets})
    targets = ", ".join(lora.pairs())
    print(
        f"{args.layer}{' (E overridden)' if args.num_experts else ''}: "
        f"H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size} float32, "
        f"{args.adapters} adapters of rank {args.rank} on {targets}; {jax.devices()[0].platform}"
    )
    cases = [("decode", T, args.repeats) for T in args.decode] + [
        ("prefill", T, args.prefill_repeats) for T in args.prefill
    ]
    rows = []
    header = f"{'phase':8s} {'T':>4s} {'adapters':>8s} {'base min ms':>11s} {'lora min ms':>11s} {'ratio':>6s}"
    print(f"{header} {'base med ms':>11s} {'lora med ms':>11s} {'med ratio':>9s} {'cpu ratio':>9s} {'target':>6s}")
    for phase, T, repeats in cases:
        r = {"phase": phase, **time_case(cfg, params, lora, T, repeats, key=1000 * T)}
        r["target"] = TARGETS[phase]
        r["met"] = r["ratio_min"] <= r["target"]
        rows.append(r)
        print(
            f"{phase:8s} {T:4d} {r['distinct_adapters']:8d} {r['base_min_ms']:11.2f} {r['lora_min_ms']:11.2f} "
            f"{r['ratio_min']:6.3f} {r['base_median_ms']:11.2f} {r['lora_median_ms']:11.2f} {r['ratio_median']:9.3f} "
            f"{r['ratio_cpu_min']:9.3f} {'ok' if r['met'] else 'MISS':>6s}",
            flush=True,
        )
    if args.json is not None:
        from report import write  # benchmarks/report.py: the results files' one schema

        notes = (
            f"{args.layer} layer (E={cfg.num_experts}), {args.adapters} adapters of rank {args.rank} on "
            f"{', '.join(lora.pairs())}; ratios LoRA / base step; jax {jax.__version__}"
        )
        write("lora_bench", rows, args.json or None, notes=notes)


if __name__ == "__main__":
    main()
