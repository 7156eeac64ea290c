"""Command line: `python -m moejax demo [--family NAME]` (benchmarks: benchmarks/plans_bench.py and its neighbours)."""

from __future__ import annotations

import argparse
import sys
import time

from moejax.config import FAMILIES

DEFAULT_FAMILY = "qwen3_moe"


def demo(family: str, decode_rows: int, prefill_rows: int, seed: int) -> None:
    """Build a small layer of `family` with random weights, run a decode step and a prefill, print routing."""
    import jax
    import jax.numpy as jnp

    import moejax
    from moejax.analysis import union_size

    cfg = moejax.MoEConfig.preset(family, hidden_size=256, intermediate_size=128)
    kp, kx, kt = jax.random.split(jax.random.key(seed), 3)
    params = moejax.init_params(cfg, kp, jnp.float32)
    forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))
    print(f"moejax {moejax.__version__} on {jax.default_backend()} (jax {jax.__version__})")
    print(
        f"family {family}: H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size}"
        f" zero experts={cfg.num_zero_experts} shared={cfg.shared_expert.value} scoring={cfg.scoring.value}"
    )
    for name, T in (("decode", decode_rows), ("prefill", prefill_rows)):
        x = jax.random.normal(kx, (T, cfg.hidden_size), jnp.float32)
        tid = jax.random.randint(kt, (T,), 0, cfg.vocab_size) if cfg.hash_routing else None
        start = time.perf_counter()
        y = forward(params, x, cfg, tid, "auto").block_until_ready()
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(5):
            y = forward(params, x, cfg, tid, "auto")
        y.block_until_ready()
        step = (time.perf_counter() - start) / 5
        routing = moejax.route(params, x, cfg, tid)
        plan = moejax.chosen_impl(params, x, cfg, tid)
        print(f"\n{name}: T={T} plan={plan} first call (compile+run) {compiled * 1e3:.0f} ms, step {step * 1e3:.2f} ms")
        for t in range(min(T, 4)):
            ids = ", ".join(
                f"{int(e)}:{float(w):.3f}" for e, w in zip(routing.indices[t], routing.weights[t], strict=True)
            )
            print(f"  token {t}: experts[id:weight] {ids}")
        print(
            f"  union of selected experts over the {T} rows: {int(union_size(routing.indices, cfg))}"
            f" of {cfg.num_experts} (T*K = {T * cfg.top_k});  |y| mean {float(jnp.abs(y).mean()):.4f}"
        )
        ref = forward(params, x, cfg, tid, "reference")
        print(f"  max |y - reference| = {float(jnp.max(jnp.abs(y - ref))):.2e}")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (row counts); anything else is a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moejax", description="moejax: Mixture-of-Experts in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser(
        "demo",
        help="run a small random layer: decode step and prefill",
        description=f"Run a small random MoE layer. Families: {', '.join(FAMILIES)}.",
    )
    p_demo.add_argument(
        "--family",
        default=DEFAULT_FAMILY,
        choices=FAMILIES,
        metavar="NAME",
        help=f"model family (default {DEFAULT_FAMILY}); one of: {', '.join(FAMILIES)}",
    )
    p_demo.add_argument("--decode-rows", type=positive_int, default=4)
    p_demo.add_argument("--prefill-rows", type=positive_int, default=256)
    p_demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    demo(args.family, args.decode_rows, args.prefill_rows, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
