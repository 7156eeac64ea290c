"""int8 activations for int8 and 4-bit weights (`Scheme.activations="int8"`) in the native kernels: error and speed.

    JAX_PLATFORMS=cpu python benchmarks/act8_bench.py [--experts 16] [--rows 64]          # the error
    JAX_PLATFORMS=cpu python benchmarks/act8_bench.py --speed [--threads 2] [--rounds 20] [--formats mxfp4 ...]

Error: a
Qwen3-30B-A3B-sized expert (H=2048, I=768, top-8 of `--experts`), random normal weights (std 1/sqrt(fan_in)) and
inputs; "outliers": each row also has 8 channels (the same for every row) at 30x the others' scale, as in LLM
activations. Printed per format: the relative Frobenius error of the routed output with int8 activations against
the same quantized weights with float32 activations ("a8 vs a32"), and for scale the weights' own quantization
error (float32 activations, quantized vs dense weights: "weights vs dense").

Speed: the routed experts' FFI call alone (no router, no shared expert), decode T=1, top-8 of the layer's 128
experts in the per-expert layout, a new token and new experts each round, each format with float32 and with
int8 activations, rounds interleaved; min and median ms of wall and of process CPU time (all threads), and the
float32-activation time over the int8 one.
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
from moejax.quantized import format_by_name, quantize_experts
from moejax.slots import Slots
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation

FORMATS = {
    "int8 g128": ("int8", {}),
    "int8 g32": ("int8", {"group_size": 32}),
    "int4 g128": ("int4", {}),
    "int4 g128 asym": ("int4", {"symmetric": False}),
    "mxfp4": ("mxfp4", {}),
    "nvfp4": ("nvfp4", {}),
}


def speed(threads: int, rounds: int, labels: list[str]) -> None:
    cfg = MODEL_LAYERS["qwen3-30b-a3b"]
    H, E, K = cfg.hidden_size, cfg.num_experts, cfg.top_k
    act = GatedActivation("silu")
    experts, fns = {}, {}
    for label in labels:
        name, options = FORMATS[label]
        for a in ("float32", "int8"):
            fmt = format_by_name(name, activations=a, **options)
            experts[label, a] = moejax.init_params(cfg, jax.random.key(0), fmt=fmt, layout="per_expert").experts
            fns[label, a] = jax.jit(lambda e, x, s: native.routed_experts(e, x, s, act, max_threads=threads))
    rng = np.random.default_rng(0)
    times = {key: [] for key in experts}
    cpu = {key: [] for key in experts}  # process CPU time: what a loaded machine inflates least
    for _ in range(rounds + 1):
        x = jnp.asarray(rng.standard_normal((1, H)).astype(np.float32))
        slots = Slots(jnp.asarray(rng.choice(E, (1, K), replace=False).astype(np.int32)), jnp.full((1, K), 1 / K))
        for key, fn in fns.items():
            fn(experts[key], x, slots).block_until_ready()  # compiled, and the call before the timed one
            t0, c0 = time.perf_counter(), time.process_time()
            fn(experts[key], x, slots).block_until_ready()
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    print(f"decode T=1, top-{K} of {E} experts, H={H} I={cfg.intermediate_size}, {threads} threads, {rounds} rounds")
    for label in labels:
        for what, data in (("wall", times), ("cpu", cpu)):
            ms = {a: 1e3 * np.asarray(data[label, a][1:]) for a in ("float32", "int8")}
            row = "  ".join(f"{a} min {v.min():6.2f} median {np.median(v):6.2f}" for a, v in ms.items())
            ratio = ms["float32"].min() / ms["int8"].min(), np.median(ms["float32"]) / np.median(ms["int8"])
            print(f"{label:15s} {what:4s} ms {row}   a32/a8 min {ratio[0]:.2f} median {ratio[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--speed", action="store_true", help="time the decode kernels instead")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    args = parser.parse_args()
    if args.speed:
        speed(args.threads, args.rounds, args.formats)
        return
    H, I, E, K, T = 2048, 768, args.experts, 8, args.rows
    rng = np.random.default_rng(0)
    n = lambda shape: jnp.asarray((rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32))
    dense = ExpertWeights(n((E, H, I)), n((E, H, I)), n((E, I, H)))
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.dirichlet(np.ones(K), T).astype(np.float32)
    slots = Slots(jnp.asarray(idx), jnp.asarray(w))
    x = rng.standard_normal((T, H)).astype(np.float32)
    outliers = x.copy()
    outliers[:, rng.choice(H, 8, replace=False)] *= 30
    act = GatedActivation("silu")
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
    print(f"H={H} I={I} E={E} K={K} T={T}, silu; relative Frobenius error of the routed output")
    for label in args.formats:
        name, options = FORMATS[label]
        q32 = quantize_experts(dense, format_by_name(name, **options))
        q8 = format_by_name(name, activations="int8", **options)(**q32.fields())
        for inputs, xs in (("normal", x), ("outliers", outliers)):
            xs = jnp.asarray(xs)
            y_dense = native.routed_experts(dense, xs, slots, act)
            y32 = native.routed_experts(q32, xs, slots, act)
            y8 = native.routed_experts(q8, xs, slots, act)
            print(f"{label:15s} {inputs:9s} a8 vs a32 {rel(y8, y32):.2e}   weights vs dense {rel(y32, y_dense):.2e}")


if __name__ == "__main__":
    main()
