"""Decode (T=1) of one MoE layer per quantized format vs dense bfloat16 / float32 on CPU, and routed-expert memory.

    JAX_PLATFORMS=cpu python benchmarks/quant_bench.py [--layer qwen3-30b-a3b] [--formats int8 int4 ...] [--rounds 20]
    JAX_PLATFORMS=cpu python benchmarks/quant_bench.py --impls native cpu   # the native kernels next to the CPU plans
    JAX_PLATFORMS=cpu python benchmarks/quant_bench.py --products [--rounds 15]
    JAX_PLATFORMS=cpu python benchmarks/quant_bench.py --torch-peer [--rounds 15]   # torch's weight-only kernels
    JAX_PLATFORMS=cpu python benchmarks/quant_bench.py --impls native --steps 16   # 16 decode steps per jit call

Each format is timed on the per-expert layout (`--layout stacked`: one [E, ...] array per field) with each backend
of --impls (default `auto`: the native kernels when built, else the CPU plans; the backend that ran is printed):
dense bfloat16 with bfloat16 x, the others with float32 x; a new random token each round. Rounds interleave the
formats and backends, so the load of a shared CPU falls on all of them alike. Prints the minimum and median step
time, the median relative to dense bfloat16 on the same backend, the minimum relative to float32's on the same
backend (the issue's decode targets), and the bytes of the routed experts relative to bfloat16.

`--steps N` (default 1): each timed call runs N decode steps, a new random token each, inside one jitted
`lax.scan` (as a model compiled as one program runs its layers), and the time per step is printed: jax's Python
dispatch of the call (which grows with the number of arrays in the params: 769 for a quantized per-expert layer of
128 experts, 257 for float32's) is then paid once per N steps, not once per step.

`--copies N` (default `auto`): each case holds N copies of the layer's weights and the timed calls take them in
turn, so that a step reads its experts from memory as in a model of many layers, not from a large last-level cache
that holds one layer of a quantized format (`auto`: enough copies for twice the L3 this CPU reports, at least 1).

`--products`: the one-row product forms tried for the quantized decode, at the layer's gate|up shape `[H] x [H, 2I]`
(16 different experts' weights per call, so reads do not come from L1/L2), against the dense bfloat16 dot the plan
runs (2 rows) and float32's GEMV; rounds interleave the variants. "moejax" rows call the format's `reduce_project`.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from model_layers import MODEL_LAYERS  # this script's directory is on sys.path

import moejax
from moejax.quantized import e2m1_to_f32, e8m0_to_f32, format_by_name, quantize_projection
from moejax.weights import ExpertWeights, expert_fields

FORMATS = {
    "float32": (ExpertWeights, jnp.float32),
    "bfloat16": (ExpertWeights, jnp.bfloat16),
    "int8": (format_by_name("int8"), jnp.bfloat16),
    "fp8_block": (format_by_name("fp8_block"), jnp.bfloat16),
    "int4": (format_by_name("int4"), jnp.bfloat16),
    "int4_asym": (format_by_name("int4", symmetric=False), jnp.bfloat16),
    "int4_a8": (format_by_name("int4", activations="int8"), jnp.bfloat16),  # int8 activations (explicit option)
    "mxfp4": (format_by_name("mxfp4"), jnp.bfloat16),
    "nvfp4": (format_by_name("nvfp4"), jnp.bfloat16),
}


def l3_bytes() -> int:
    """The last-level cache this CPU reports (Linux sysfs), 0 when unknown."""
    size = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if not size.exists():
        return 0
    text = size.read_text().strip()
    return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)


def routed_bytes(params: moejax.MoEParams) -> int:
    return sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in expert_fields(params.experts).values())


def product_variants(H: int, O: int) -> dict[str, tuple[str, Any]]:
    """`{name: (format to quantize with | "bf16" | "f32", fn(q, scale, x [1, H]) -> [1, O])}` (see the docstring)."""
    G = H // 128

    def one_reduce_int(bits):  # the earlier form: one reduce over (group, element), the scale inside
        def f(q, s, x):
            xg = x.reshape(1, G, -1)
            u = q.reshape(G, -1, O).astype(jnp.float32)
            if bits == 4:
                hi = jnp.floor(u * (1 / 16))
                xe, xo = xg[:, :, 0::2, None], xg[:, :, 1::2, None]
                y = jnp.sum((u[None] * xe + hi[None] * (xo - 16 * xe)) * s[None, :, None, :], axis=(1, 2))
            else:
                y = jnp.sum((u * s[:, None, :])[None] * xg[..., None], axis=(1, 2))
            return y - float(1 << (bits - 1)) * (xg.sum(-1) @ s)

        return f

    def slices8(q, s, x):  # a rank-2 reduce per group (static slices), then the scale
        y = 0
        for g in range(G):
            xs = x[0, g * 128 : (g + 1) * 128]
            y = y + (jnp.sum(q[g * 128 : (g + 1) * 128].astype(jnp.float32) * xs[:, None], 0) - 128 * xs.sum()) * s[g]
        return y[None]

    def deq_gemv8(q, s, x):  # codes stored [out, in], dequantized to float32 (a copy), then XLA's row GEMV
        w = (q.reshape(O, G, -1).astype(jnp.float32) - 128) * s[:, :, None]
        return jax.lax.dot_general(x, w.reshape(O, H), (((1,), (1,)), ((), ())))

    def int_pieces8(q, s, x):  # x split exactly into 4 int8 pieces per group, an int8 x uint8 -> int32 dot
        xg = x.reshape(G, -1)
        e = jnp.ceil(jnp.log2(jnp.maximum(jnp.max(jnp.abs(xg), axis=1, keepdims=True), 1e-30)))
        r, pieces = xg * jnp.exp2(7 - e), []
        for _ in range(4):
            pieces.append(jnp.round(r))
            r = (r - pieces[-1]) * 128
        c = jnp.stack(pieces, 1).astype(jnp.int8)  # [G, 4, g]
        dims = (((2,), (1,)), ((0,), (0,)))
        p = jax.lax.dot_general(c, q.reshape(G, -1, O), dims, preferred_element_type=jnp.int32)  # [G, 4, O]
        y = jnp.einsum("gno,gn,go->o", p.astype(jnp.float32), jnp.exp2(e - 7 - 7 * jnp.arange(4.0)), s)[None]
        return y - 128.0 * (xg.sum(-1)[None] @ s)

    def no_scale8(q, s, x):  # not the format's math: the speed of a column reduce with no group scale inside
        return (jnp.sum(q.astype(jnp.float32) * x[0][:, None], 0) * s[0])[None]

    def one_reduce_mx(q, s, x):
        g = H // 32
        u, xg = q.reshape(g, -1, O), x.reshape(1, g, -1)
        v = e2m1_to_f32(u & 15)[None] * xg[:, :, 0::2, None] + e2m1_to_f32(u >> 4)[None] * xg[:, :, 1::2, None]
        return jnp.sum(v * e8m0_to_f32(s)[None, :, None, :], axis=(1, 2))

    def two_stage_mx(q, s, x):
        g = H // 32
        u, xg = q.reshape(g, -1, O), x.reshape(g, -1)
        p = jnp.sum(e2m1_to_f32(u & 15) * xg[:, 0::2, None] + e2m1_to_f32(u >> 4) * xg[:, 1::2, None], axis=1)
        return jnp.sum(p * e8m0_to_f32(s), 0)[None]

    def moejax_fn(name):
        fmt = format_by_name(name)
        return lambda q, s, x: fmt(gate_q=q, gate_scale=s).reduce_project("gate", x)

    def moejax_apart(name):  # gate and up as two products of [H, O/2], as the layer runs them
        fmt = format_by_name(name)
        half = lambda q, s, x, k: fmt(gate_q=q[:, k], gate_scale=s[:, k]).reduce_project("gate", x)
        lo, hi = slice(None, O // 2), slice(O // 2, None)
        return lambda q, s, x: jnp.concatenate([half(q, s, x, lo), half(q, s, x, hi)], 1)

    dense = lambda dt: (
        lambda w, x: jax.lax.dot_general(
            jnp.concatenate([x, x]).astype(dt) if dt == jnp.bfloat16 else x,
            w,
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
        )[:1]
    )
    return {
        "bfloat16 dot, 2 rows (dense)": ("bf16", dense(jnp.bfloat16)),
        "float32 GEMV (dense)": ("f32", dense(jnp.float32)),
        "int8 two-stage, per row (moejax)": ("int8", moejax_fn("int8")),
        "int8 two-stage, gate|up apart (moejax)": ("int8", moejax_apart("int8")),
        "int8 one reduce, scale inside": ("int8", one_reduce_int(8)),
        "int8 reduce per group slice": ("int8", slices8),
        "int8 dequantize + GEMV [out, in]": ("int8 [out, in]", deq_gemv8),
        "int8 int8-pieces integer dot": ("int8", int_pieces8),
        "int8 no group scale (bound)": ("int8", no_scale8),
        "int4 two-stage, per row (moejax)": ("int4", moejax_fn("int4")),
        "int4 one reduce, scale inside": ("int4", one_reduce_int(4)),
        "mxfp4 one reduce (moejax)": ("mxfp4", moejax_fn("mxfp4")),
        "mxfp4 two-stage": ("mxfp4", two_stage_mx),
    }


def time_products(cfg, rounds: int, experts: int = 16) -> None:
    """`--products`: one-row product variants, same run, interleaved rounds; ratios to the bfloat16 dot."""
    H, O = cfg.hidden_size, 2 * cfg.intermediate_size
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, H)), jnp.float32)
    ws = [rng.standard_normal((H, O)).astype(np.float32) / np.sqrt(H) for _ in range(experts)]
    arrays = {"bf16": [(jnp.asarray(w.T, jnp.bfloat16),) for w in ws], "f32": [(jnp.asarray(w.T),) for w in ws]}
    cases = {}
    for name, (fmt_name, fn) in product_variants(H, O).items():
        if fmt_name not in arrays:
            transposed = fmt_name.endswith(" [out, in]")  # the checkpoints' orientation
            quantized = [quantize_projection(w, format_by_name(fmt_name.split()[0]).scheme) for w in ws]
            t = (lambda a: jnp.asarray(np.ascontiguousarray(a.T))) if transposed else jnp.asarray
            arrays[fmt_name] = [(t(d["q"]), t(d["scale"])) for d in quantized]
        args = arrays[fmt_name]

        def run(x, args, fn=fn):
            return sum(fn(*a, x) for a in args)

        step = jax.jit(run)
        step(x, args).block_until_ready()
        cases[name] = (step, args, [])
    for _ in range(rounds):
        for step, args, times in cases.values():
            t0 = time.perf_counter()
            step(x, args).block_until_ready()
            times.append((time.perf_counter() - t0) / experts)
    base = cases["bfloat16 dot, 2 rows (dense)"][2]
    print(f"one-row products [{H}] x [{H}, {O}], {experts} experts per call, {rounds} rounds")
    print("| variant | median ms | min ms | median / bf16 | min / bf16 |\n|---|---|---|---|---|")
    for name, (_, _, t) in cases.items():
        row = f"| {name} | {np.median(t) * 1e3:.3f} | {min(t) * 1e3:.3f} | {np.median(t) / np.median(base):.2f}"
        print(f"{row} | {min(t) / min(base):.2f} |", flush=True)


def time_torch_peer(cfg, rounds: int, experts: int = 32) -> None:
    """`--torch-peer`: torch's weight-only CPU kernels (`_weight_int8pack_mm`: int8 per output channel;
    `_weight_int4pack_mm_for_cpu`: int4, groups of 128) on one decode step (T=1) of the layer's routed experts: top_k
    of `experts` random experts (more than the L3 holds), gate|up -> SiLU -> down -> weighted sum, float32 and
    bfloat16 activations, `torch.set_num_threads(2)`; min and median ms over `rounds` rounds."""
    import torch  # the `peers` extra

    torch.set_num_threads(2)
    H, I, K = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    gen = torch.Generator().manual_seed(0)

    def int8(n, k):
        return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen) / 256

    def int4(n, k, group=128):
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        scales = torch.rand(k // group, n, generator=gen) / 16
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2), torch.stack([scales, 8 * scales], -1)

    kinds = {
        "int8": (int8, lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1].to(x.dtype))),
        "int4": (int4, lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 128, w[1].to(x.dtype))),
    }
    print(f"torch {torch.__version__} weight-only kernels, decode T=1 of {K} of {experts} experts, {rounds} rounds")
    print("| format | x dtype | min ms | median ms |\n|---|---|---|---|")
    for name, (make, mm) in kinds.items():
        weights = [(make(2 * I, H), make(H, I)) for _ in range(experts)]
        for dtype in (torch.float32, torch.bfloat16):
            times = []
            with torch.inference_mode():
                for _ in range(rounds + 1):
                    x = torch.randn(1, H, generator=gen).to(dtype)
                    chosen = torch.randperm(experts, generator=gen)[:K].tolist()
                    t0 = time.perf_counter()
                    y = torch.zeros(1, H, dtype=dtype)
                    for e in chosen:
                        gu = mm(x, weights[e][0])
                        y += 0.125 * mm(torch.nn.functional.silu(gu[:, :I]) * gu[:, I:], weights[e][1])
                    times.append(time.perf_counter() - t0)
            t = times[1:]
            print(
                f"| {name} | {str(dtype).split('.')[1]} | {min(t) * 1e3:.2f} | {np.median(t) * 1e3:.2f} |", flush=True
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="qwen3-30b-a3b", choices=sorted(MODEL_LAYERS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--impls", nargs="+", default=["auto"], choices=moejax.backends.IMPLS, help="backends")
    parser.add_argument("--layout", default="per_expert", choices=["per_expert", "stacked"], help="expert layout")
    parser.add_argument("--steps", type=int, default=1, help="decode steps per jitted call (a lax.scan)")
    parser.add_argument("--copies", default="auto", help="copies of the weights taken in turn (auto: 2x the L3)")
    parser.add_argument("--products", action="store_true", help="time one-row product variants instead")
    parser.add_argument("--torch-peer", action="store_true", help="time torch's weight-only int8/int4 kernels instead")
    args = parser.parse_args()
    cfg = MODEL_LAYERS[args.layer]
    if args.products:
        time_products(cfg, args.rounds)
        return
    if args.torch_peer:
        time_torch_peer(cfg, args.rounds)
        return
    bf16_bytes = 3 * cfg.num_experts * cfg.hidden_size * cfg.intermediate_size * 2
    print(
        f"{args.layer}: H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size}, T=1, "
        f"{args.steps} step(s) per call, {args.layout} layout; L3 {l3_bytes() >> 20} MiB, copies {args.copies}"
    )

    def steps(p, xs, impl):  # xs [steps, 1, H]: one decode step per token, in order
        return jax.lax.scan(lambda c, x: (c, moejax.moe_forward(p, x, cfg, impl=impl)), None, xs)[1]

    step = jax.jit(steps, static_argnums=2)
    xs = [jax.random.normal(jax.random.key(i), (args.steps, 1, cfg.hidden_size)) for i in range(args.rounds + 1)]
    cases = {}
    for name in args.formats:  # build and compile every case first
        fmt, dtype = FORMATS[name]
        params = moejax.init_params(cfg, jax.random.key(0), dtype, fmt=fmt, layout=args.layout)
        nbytes = routed_bytes(params)
        copies = max(1, math.ceil(2 * l3_bytes() / nbytes)) if args.copies == "auto" else int(args.copies)
        held = [params] + [jax.tree.map(lambda a: a.copy(), params) for _ in range(copies - 1)]
        x_dtype = jnp.bfloat16 if name == "bfloat16" else jnp.float32  # quantized: float32 x, one-row products
        for impl in args.impls:
            step(params, xs[0].astype(x_dtype), impl).block_until_ready()
            ran = moejax.chosen_impl(params, xs[0][0].astype(x_dtype), cfg, impl=impl)
            cases[name, impl] = (held, x_dtype, nbytes / bf16_bytes, ran, [])
    for n, x in enumerate(xs[1:]):  # interleaved rounds: a shared CPU's load falls on every format alike
        for (_, impl), (held, x_dtype, _, _, times) in cases.items():
            xt, params = x.astype(x_dtype), held[n % len(held)]
            t0 = time.perf_counter()
            step(params, xt, impl).block_until_ready()
            times.append((time.perf_counter() - t0) / args.steps)
    print(f"{'format':10s} {'backend':>10s} {'memory/bf16':>11s} {'x dtype':>8s} {'min ms':>8s} {'median ms':>9s} "
          f"{'median/bf16':>11s} {'min/f32':>8s} {'copies':>6s}")  # fmt: skip
    for (name, impl), (held, x_dtype, mem, ran, times) in cases.items():
        base, f32 = cases.get(("bfloat16", impl)), cases.get(("float32", impl))
        ratio = f"{np.median(times) / np.median(base[4]):11.2f}" if base else f"{'':11s}"
        ratio += f" {min(times) / min(f32[4]):8.2f}" if f32 else ""
        row = f"{name:10s} {ran:>10s} {mem:11.3f} {jnp.dtype(x_dtype).name:>8s} {min(times) * 1e3:8.2f}"
        print(f"{row} {np.median(times) * 1e3:9.2f} {ratio} {len(held):6d}", flush=True)


if __name__ == "__main__":
    main()
