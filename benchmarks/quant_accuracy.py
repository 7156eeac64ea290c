"""Accuracy of each quantized format against the bfloat16 layer: cosine and max relative error of the MoE output.

    JAX_PLATFORMS=cpu python benchmarks/quant_accuracy.py [--hidden 1024 --experts 32 --top-k 8 --intermediate 512]
        [--tokens 64] [--seed 0]

A Qwen3-MoE layer (no shared expert) whose routed experts are drawn three ways (`WEIGHTS`): normal, Student-t
with 3 degrees of freedom (heavy tails: a few weights many standard deviations out), and normal with 1% of the
input channels scaled by 20 (outlier features, the pattern of trained LLM weights). Each weight matrix has
standard deviation 1/sqrt(fan_in) (the outlier channels aside). The experts are rounded to bfloat16; that is the
reference layer (all parameters and x in bfloat16). Each format quantizes those bfloat16 weights with
`moejax.quantize(params, cfg, name, **options)` (min-max scales, round-to-nearest-even) and runs the same x in
bfloat16: the router sees the same input and weights, so every layer picks the same experts and the error is
the experts' alone. The row "float32 experts" runs the same bfloat16 weights in float32: the floor of the
comparison (the reference's own bfloat16 rounding, and the output rounded to bfloat16 in both).

Metrics of an output y `[T, H]` (float64) against the reference r:
  * cosine: `<y, r> / (|y| |r|)` over the whole flattened output;
  * row rel. err: `max_t ||y_t - r_t|| / ||r_t||`, the worst token's relative L2 error;
  * elem rel. err: `max |y - r| / max |r|`, the worst element relative to the output's range.
Memory: bytes of the routed experts (codes, scales, zero points) relative to bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.weights import ExpertWeights, expert_fields

# (label, format name, options) for moejax.quantize
FORMATS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("int8 sym g128", "int8", {}),
    ("int8 asym g128", "int8", {"symmetric": False}),
    ("int4 sym g128", "int4", {}),
    ("int4 asym g128", "int4", {"symmetric": False}),
    ("int4 sym g32", "int4", {"group_size": 32}),
    ("int4 asym g32", "int4", {"group_size": 32, "symmetric": False}),
    ("fp8_block", "fp8_block", {}),
    ("mxfp4", "mxfp4", {}),
    ("nvfp4", "nvfp4", {}),
)
WEIGHTS = ("normal", "student-t3", "outlier-ch")
FLOOR = "float32 experts"  # the same bfloat16 weights run in float32: the floor of the comparison


def qwen3_like(hidden: int = 1024, experts: int = 32, top_k: int = 8, intermediate: int = 512) -> moejax.MoEConfig:
    """A Qwen3-MoE layer config (softmax top-k, no shared expert) of the given size."""
    return moejax.MoEConfig.preset(
        "qwen3_moe", hidden_size=hidden, num_experts=experts, top_k=top_k, intermediate_size=intermediate
    )


def draw_matrix(rng: np.random.Generator, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """Weights `[E, in, out]` with standard deviation 1/sqrt(in) drawn from `kind` (one of `WEIGHTS`)."""
    n_in = shape[1]
    if kind == "normal":
        w = rng.standard_normal(shape)
    elif kind == "student-t3":
        w = rng.standard_t(3, shape) / np.sqrt(3.0)  # variance of t(3) is 3
    elif kind == "outlier-ch":
        w = rng.standard_normal(shape)
        channels = rng.choice(n_in, max(1, n_in // 100), replace=False)  # 1% of the input channels x20
        w[:, channels, :] *= 20
    else:
        raise ValueError(f"weights {kind!r} is not one of {WEIGHTS}")
    return (w / np.sqrt(n_in)).astype(np.float32)


def bf16_layer(cfg: moejax.MoEConfig, kind: str, seed: int = 0) -> moejax.MoEParams:
    """The reference layer: every parameter in bfloat16, routed experts drawn from `kind`, stacked layout."""
    params = moejax.init_params(cfg, jax.random.key(seed), jnp.bfloat16, layout="stacked")
    rng = np.random.default_rng(seed)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    shapes = {"gate": (E, H, I), "up": (E, H, I), "down": (E, I, H)}
    experts = ExpertWeights(**{p: jnp.asarray(draw_matrix(rng, kind, s), jnp.bfloat16) for p, s in shapes.items()})
    return dataclasses.replace(params, experts=experts)


@functools.cache
def layer_step(cfg: moejax.MoEConfig):
    """`moe_forward` of `cfg`, jitted once per config (each format compiles once; callers share the cache)."""
    return jax.jit(lambda params, x: moejax.moe_forward(params, x, cfg))


def compare(y: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """cosine, row rel. err, elem rel. err of `y` against `ref` (see the module docstring)."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    d = y - ref
    return {
        "cosine": float(np.sum(y * ref) / (np.linalg.norm(y) * np.linalg.norm(ref))),
        "row_rel": float(np.max(np.linalg.norm(d, axis=-1) / np.linalg.norm(ref, axis=-1))),
        "elem_rel": float(np.max(np.abs(d)) / np.max(np.abs(ref))),
    }


def routed_bytes(params: moejax.MoEParams) -> int:
    return sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in expert_fields(params.experts).values())


def accuracy_table(
    cfg: moejax.MoEConfig,
    *,
    tokens: int = 64,
    seed: int = 0,
    formats: tuple[tuple[str, str, dict[str, Any]], ...] = FORMATS,
    weights: tuple[str, ...] = WEIGHTS,
) -> list[dict[str, Any]]:
    """One row per format (and the float32 floor first) and weight distribution.

    Returns:
      dicts `{"format", "weights", "memory", "cosine", "row_rel", "elem_rel"}`; `memory` is the routed experts'
      bytes relative to bfloat16.
    """
    step = layer_step(cfg)
    x = jax.random.normal(jax.random.key(seed + 1), (tokens, cfg.hidden_size), jnp.bfloat16)
    rows = []
    for kind in weights:
        params = bf16_layer(cfg, kind, seed)
        ref = np.asarray(step(params, x), np.float32)
        bf16_bytes = routed_bytes(params)
        f32 = dataclasses.replace(params, experts=jax.tree.map(lambda w: w.astype(jnp.float32), params.experts))
        cases = [(FLOOR, f32)] + [(label, moejax.quantize(params, cfg, n, **o)) for label, n, o in formats]
        for label, p in cases:
            y = np.asarray(step(p, x), np.float32)
            rows.append({"format": label, "weights": kind, "memory": routed_bytes(p) / bf16_bytes, **compare(y, ref)})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as one markdown table: a line per format, (cosine, row rel. err, elem rel. err) per distribution."""
    kinds = list(dict.fromkeys(r["weights"] for r in rows))
    by = {(r["format"], r["weights"]): r for r in rows}
    head = "| format | memory / bf16 | " + " | ".join(f"{k}: cosine | row rel. | elem rel." for k in kinds) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(kinds))]
    for label in dict.fromkeys(r["format"] for r in rows):
        cells = [label, f"{by[label, kinds[0]]['memory']:.3f}"]
        for k in kinds:
            r = by[label, k]
            cells += [f"{r['cosine']:.6f}", f"{r['row_rel']:.2e}", f"{r['elem_rel']:.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = qwen3_like(args.hidden, args.experts, args.top_k, args.intermediate)
    print(f"qwen3_moe H={args.hidden} E={args.experts} K={args.top_k} I={args.intermediate}, T={args.tokens}")
    print(markdown(accuracy_table(cfg, tokens=args.tokens, seed=args.seed)))


if __name__ == "__main__":
    main()
