"""Which per-expert storage XLA:CPU multiplies fastest: `[in, out]` (`ExpertWeights`) or `[out, in]`
(`FusedExpertWeights`, dot or padded multiply-reduce), per product and inside `moejax.backends.cpu.switch_decode`.

    python benchmarks/cpu_expert_layouts.py [--rows 1,2,4,8] [--experts 128] [--compile-only]

Qwen3-30B-A3B sizes (H=2048, I=768, K=8), float32. Products: 16 distinct `[R, 2048] x 2048x1536` weights chained
in one jitted program (warm), ms per product. Plan: E experts per storage, the median over 6 random routings,
storages interleaved per routing. Compile: `jit(moe_forward).lower(...).compile()` on abstract DeepSeek-V3-sized
params (E=256, H=7168, I=2048, K=8) in the per-expert layout. Results and the choice they led to:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.backends import cpu
from moejax.slots import Slots
from moejax.weights import ExpertWeights, FusedExpertWeights
from pallas_kernels.activations import GatedActivation

H, I, K = 2048, 768, 8


def in_dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def out_dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def out_reduce(x, w):
    return jnp.sum(w[:, None, :] * x[None], axis=2).T


def product_times(rows: list[int], rng: np.random.Generator) -> None:
    w_in = [jnp.asarray(rng.standard_normal((H, 2 * I), dtype=np.float32)) for _ in range(16)]
    w_out = [jnp.asarray(np.ascontiguousarray(np.asarray(w).T)) for w in w_in]
    cases = {"[in,out] dot": (in_dot, w_in), "[out,in] dot": (out_dot, w_out), "[out,in] reduce": (out_reduce, w_out)}
    for R in rows:
        x = jnp.asarray(rng.standard_normal((R, H)), jnp.float32)
        result = {}
        for name, (fn, ws) in cases.items():
            chained = jax.jit(lambda ws, x, fn=fn: sum(fn(x, w) for w in ws))
            chained(ws, x).block_until_ready()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                chained(ws, x).block_until_ready()
                times.append(time.perf_counter() - start)
            result[name] = f"{min(times) / len(ws) * 1e3:.3f}"
        print(f"product R={R}: ms per product {result}", flush=True)


class _FusedDot(FusedExpertWeights):
    """`FusedExpertWeights` with YNNPACK dots at every row count (no multiply-reduce)."""

    @property
    def padded_rows(self) -> int:
        return 1


jax.tree_util.register_dataclass(
    _FusedDot, data_fields=["gate_up_weight", "down_weight", "gate_up_bias", "down_bias"], meta_fields=[]
)


def plan_times(rows: list[int], num_experts: int, rng: np.random.Generator) -> None:
    act = GatedActivation("silu")
    storages = {"[in,out]": [], "[out,in] reduce": [], "[out,in] dot": []}
    for _ in range(num_experts):
        g, u = (rng.standard_normal((H, I), dtype=np.float32) * 0.02 for _ in range(2))
        d = rng.standard_normal((I, H), dtype=np.float32) * 0.02
        dense = ExpertWeights(jnp.asarray(g), jnp.asarray(u), jnp.asarray(d))
        fused = FusedExpertWeights.from_dense(dense)
        storages["[in,out]"].append(dense)
        storages["[out,in] reduce"].append(fused)
        storages["[out,in] dot"].append(_FusedDot(fused.gate_up_weight, fused.down_weight))

    @jax.jit
    def decode(parts, x, indices, weights):
        fns = [functools.partial(p.ffn, act=act) for p in parts]
        padded = parts[0].padded_rows
        return cpu.switch_decode(fns, x, Slots(indices, weights), padded_rows=padded)

    for T in rows:
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        weights = jnp.asarray(rng.random((T, K)), jnp.float32)
        routings = [
            jnp.asarray(np.stack([rng.choice(num_experts, K, replace=False) for _ in range(T)]), jnp.int32)
            for _ in range(6)
        ]
        times = {name: [] for name in storages}
        for parts in storages.values():  # compile
            decode(parts, x, routings[0], weights).block_until_ready()
        for indices in routings:
            for name, parts in storages.items():
                start = time.perf_counter()
                decode(parts, x, indices, weights).block_until_ready()
                times[name].append(time.perf_counter() - start)
        medians = {name: f"{np.median(t) * 1e3:.2f}" for name, t in times.items()}
        print(f"switch_decode T={T}, E={num_experts}: median ms {medians}", flush=True)


def compile_times() -> None:
    cfg = moejax.MoEConfig.preset("deepseek_v3", hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8)
    forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))
    for dtype in (jnp.bfloat16, jnp.float32):
        init = functools.partial(moejax.init_params, cfg, dtype=dtype, layout="per_expert")
        params = jax.eval_shape(init, jax.random.key(0))
        for T in (1, 8, 512):
            x = jax.ShapeDtypeStruct((T, cfg.hidden_size), dtype)
            start = time.perf_counter()
            forward.lower(params, x, cfg).compile()
            seconds = time.perf_counter() - start
            impl = moejax.chosen_impl(params, x, cfg)
            print(f"compile E=256 {jnp.dtype(dtype).name} T={T} ({impl}): {seconds:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8", help="row counts (comma-separated)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--compile-only", action="store_true", help="only the compile times at E=256")
    args = parser.parse_args()
    compile_times()
    if args.compile_only:
        return
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    product_times(rows, rng)
    plan_times(rows, args.experts, rng)


if __name__ == "__main__":
    main()
