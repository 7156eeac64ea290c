"""The native layer's extra matmuls against XLA's, on CPU: the router (`x @ W_router`) and a shared expert.

Times (min of --rounds, each the mean of --calls calls, interleaved native / XLA) of:
  router  [T, H] x [H, E]:   `native_ops.linear` vs `jnp.dot` (float32)
  shared  gated FFN H -> Is -> H: `native_ops.shared_ffn` (one routed-experts FFI call) vs `ExpertWeights.ffn`
Default sizes: Qwen3-30B-A3B's router (H=2048, E=128) and Qwen1.5-MoE-A2.7B's shared expert (Is=5632).

    python benchmarks/native_ops.py --rounds 5
"""

from __future__ import annotations

import argparse
import time

import jax

from moejax.backends import native, native_ops
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation


def seconds(fn, *, calls: int) -> float:
    fn().block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    out.block_until_ready()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--shared", type=int, default=5632)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native extension is not built")
    H, E, Is = args.hidden, args.experts, args.shared
    key = jax.random.split(jax.random.key(0), 4)
    router = jax.random.normal(key[0], (H, E)) * H**-0.5
    w = ExpertWeights(
        *(jax.random.normal(k, s) * s[0] ** -0.5 for k, s in zip(key[1:], [(H, Is), (H, Is), (Is, H)], strict=True))
    )
    act = GatedActivation("silu")
    shared_native = jax.jit(lambda w, x: native_ops.shared_ffn(w, x, act))
    shared_xla = jax.jit(lambda w, x: w.ffn(x, act))
    router_native, router_xla = jax.jit(native_ops.linear), jax.jit(native_ops.xla_matmul)
    print(f"H={H} E={E} Is={Is}; min of {args.rounds} rounds, ms per call")
    for T in args.rows:
        x = jax.random.normal(jax.random.key(T), (T, H))
        calls = max(1, 64 // T)
        cases = {
            "router": (lambda x=x: router_native(x, router), lambda x=x: router_xla(x, router)),
            "shared": (lambda x=x: shared_native(w, x), lambda x=x: shared_xla(w, x)),
        }
        for name, (run_native, run_xla) in cases.items():
            best = {"native": float("inf"), "xla": float("inf")}
            for _ in range(args.rounds):
                best["native"] = min(best["native"], seconds(run_native, calls=calls))
                best["xla"] = min(best["xla"], seconds(run_xla, calls=calls))
            n, r = best["native"] * 1e3, best["xla"] * 1e3
            print(f"T={T:5d} {name:7s} native {n:9.3f}  xla {r:9.3f}  native/xla {n / r:5.2f}")


if __name__ == "__main__":
    main()
