"""The error of int8 activations for 4-bit weights (`Scheme.activations="int8"`), as the native kernels compute it.

    JAX_PLATFORMS=cpu python benchmarks/act8_error.py [--experts 16] [--rows 64]

A Qwen3-30B-A3B-sized expert (H=2048, I=768, top-8 of `--experts`), random normal weights (std 1/sqrt(fan_in)) and
inputs; "outliers": each row also has 8 channels (the same for every row) at 30x the others' scale, as in LLM
activations. Printed per format: the relative Frobenius error of the routed output with int8 activations against
the same quantized weights with float32 activations ("a8 vs a32"), and for scale the weights' own quantization
error (float32 activations, quantized vs dense weights: "w4 vs dense").
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from moejax.backends import native
from moejax.experts import Slots
from moejax.quantized import format_by_name, quantize_experts
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation

FORMATS = {
    "int4 g128": ("int4", {}),
    "int4 g128 asym": ("int4", {"symmetric": False}),
    "mxfp4": ("mxfp4", {}),
    "nvfp4": ("nvfp4", {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
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
    for label, (name, options) in FORMATS.items():
        q32 = quantize_experts(dense, format_by_name(name, **options))
        q8 = format_by_name(name, activations="int8", **options)(**q32.fields())
        for inputs, xs in (("normal", x), ("outliers", outliers)):
            xs = jnp.asarray(xs)
            y_dense = native.routed_experts(dense, xs, slots, act)
            y32 = native.routed_experts(q32, xs, slots, act)
            y8 = native.routed_experts(q8, xs, slots, act)
            print(f"{label:15s} {inputs:9s} a8 vs a32 {rel(y8, y32):.2e}   w4 vs dense {rel(y32, y_dense):.2e}")


if __name__ == "__main__":
    main()
