"""moejax's routed experts next to ggml's MUL_MAT_ID (llama.cpp's CPU MoE matmul), formats paired by bits.

    python benchmarks/ggml_decode.py --ggml /work/ggml [--build] [--n 1 4 8 32 512] [--formats int8 int4_a8 ...]
        [--working-set equal|layer] [--steps 64] [--rounds 5] [--json [PATH]]

ggml side: `test-backend-ops perf -o MUL_MAT_ID -b CPU` (built from the checkout at --ggml with `--build`: cmake
-DGGML_NATIVE=ON -DGGML_BUILD_TESTS=ON, target test-backend-ops; or an existing build/bin/test-backend-ops there, or
--ggml-bin). One ggml case is one projection (m outputs, k inputs) of n_used of n_mats experts for n tokens; its
ids and weights are the same on every run, so the experts it reads stay in the last-level cache. The perf list
holds Qwen3-30B-A3B (n_mats=128, n_used=8, m=768, k=2048) for F32, F16, Q4_0, Q8_0 and gpt-oss-20b (MXFP4,
n_mats=32, n_used=4, m=2880, k=2880); `--build` first adds BF16 to the first and n=32 to the second (two
edits of tests/test-backend-ops.cpp's perf list, printed), so every pair below has its ggml number.

moejax side: the whole routed layer (gate, up, down) of n tokens inside a jitted `lax.scan` of --steps decode
steps with the native kernels (`impl="native"`), the same tokens every step (so the same experts, as ggml's fixed
ids). ggml's perf mode times the graph's compute alone; a jitted call's Python dispatch (about 0.4 ms for a quantized
layer's 769 arrays) is spread over the call's steps, so they are many (64: under 7 us a step). Both on this
machine's threads (ggml's test-backend-ops uses hardware_concurrency; XLA's pool the same cores).
What one moejax time covers (--working-set):
  * equal (default): the layer at intermediate size m/3, time per step. Its 3 projections hold the bytes and the
    multiply-adds of ggml's one projection, so both timed units read the same working set from the same level of
    the memory hierarchy: at the Qwen3 shape and n=1, 8 experts' Q8_0 projection (13.4 MB) sits in a 32 MiB L3, and
    so does moejax's int8 g32 step (14 MB).
  * layer: the layer at ggml's m, time per step / 3. Its step reads three times ggml's bytes (int8 g32: 42 MB), from
    memory where ggml's one projection came from the cache: the comparison favours ggml wherever that projection
    fits the last-level cache and the layer does not.

Pairs (bits per weight): float32 / F32, bfloat16 / F16 and BF16, int8 g32 / Q8_0, int4 g32 / Q4_0, int4 g32 with
int8 activations / Q4_0, int8 g32 with int8 activations / Q8_0, MXFP4 (with and without int8 activations) / MXFP4
at gpt-oss-20b's shape. ggml always multiplies quantized weights with int8-quantized activations (Q8_0 / Q8_K) and
F16 weights with F16-rounded activations; moejax's weight-only formats keep float32 activations (exact to the
dequantized weights). Printed: per projection us of both and ggml's / moejax's (above 1: moejax faster).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import moejax
from moejax.quantized import format_by_name
from moejax.weights import ExpertWeights

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import report  # noqa: E402

QWEN = dict(n_mats=128, n_used=8, m=768, k=2048)
GPT_OSS = dict(n_mats=32, n_used=4, m=2880, k=2880)
# moejax format -> (weight format, x dtype, ggml types, shape); the targets first (RESULTS.md shows the first rows)
PAIRS = {
    "int8": (("int8", {"group_size": 32}), jnp.float32, ("q8_0",), QWEN),
    "int8_a8": (("int8", {"group_size": 32, "activations": "int8"}), jnp.float32, ("q8_0",), QWEN),
    "int4": (("int4", {"group_size": 32}), jnp.float32, ("q4_0",), QWEN),
    "int4_a8": (("int4", {"group_size": 32, "activations": "int8"}), jnp.float32, ("q4_0",), QWEN),
    "mxfp4": (("mxfp4", {}), jnp.float32, ("mxfp4",), GPT_OSS),
    "mxfp4_a8": (("mxfp4", {"activations": "int8"}), jnp.float32, ("mxfp4",), GPT_OSS),
    "bfloat16": (ExpertWeights, jnp.bfloat16, ("f16", "bf16"), QWEN),
    "float32": (ExpertWeights, jnp.float32, ("f32",), QWEN),
}
# Edits of ggml's perf list (tests/test-backend-ops.cpp) so that every pair has a ggml case.
GGML_EDITS = (
    (
        "for (ggml_type type_a : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K,",
        "for (ggml_type type_a : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, "
        "GGML_TYPE_Q4_K,",
    ),
    (
        "    // gpt-oss-20b\n    for (int bs : {1, 4, 8, 512}) {",
        "    // gpt-oss-20b\n    for (int bs : {1, 4, 8, 32, 512}) {",
    ),
)
LINE = re.compile(
    r"MUL_MAT_ID\(type_a=(\w+),type_b=f32,n_mats=(\d+),n_used=(\d+),b=0,m=(\d+),n=(\d+),k=(\d+)\):"
    r"\s+\d+ runs -\s+([\d.]+) us/run"
)


def build_ggml(src: pathlib.Path) -> pathlib.Path:
    """test-backend-ops built from the ggml checkout `src`, its perf list edited by GGML_EDITS (once)."""
    path = src / "tests" / "test-backend-ops.cpp"
    text = path.read_text()
    for old, new in GGML_EDITS:
        if new not in text:
            if old not in text:
                raise ValueError(f"{path}: perf list line not found (another ggml version?): {old!r}")
            text = text.replace(old, new, 1)
            print(f"ggml edit: {old.strip()!r} -> {new.strip()!r}")
    path.write_text(text)
    flags = ["-DGGML_NATIVE=ON", "-DGGML_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(src / "build"), "-j", jobs, "--target", "test-backend-ops"], check=True)
    return src / "build" / "bin" / "test-backend-ops"


def ggml_times(binary: pathlib.Path, types: set[str], ns: set[int]) -> dict[tuple, float]:
    """(type, n_mats, n) -> us per run of ggml's MUL_MAT_ID perf cases (the plain op, not the fused one)."""
    names = "|".join(sorted(types))
    sizes = "|".join(str(n) for n in sorted(ns))
    shapes = "|".join(f"n_mats={s['n_mats']},n_used={s['n_used']},b=0,m={s['m']}" for s in (QWEN, GPT_OSS))
    pattern = rf"^type_a=({names}),type_b=f32,({shapes}),n=({sizes}),k="
    cmd = [str(binary), "perf", "-o", "MUL_MAT_ID", "-b", "CPU", "-p", pattern]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    times = {}
    for m in LINE.finditer(out):
        type_a, n_mats, n_used, mm, n, k = m.group(1), *map(int, m.groups()[1:6])
        shape = dict(n_mats=n_mats, n_used=n_used, m=mm, k=k)
        if n in ns and shape in (QWEN, GPT_OSS):
            times[type_a, n_mats, n] = float(m.group(7))
    return times


# --working-set -> (the layer's intermediate size as a divisor of ggml's m, projections per timed step)
WORKING_SETS = {"equal": 3, "layer": 1}


def layer_config(shape: dict, intermediate: int) -> moejax.MoEConfig:
    """The routed layer of the shape's model (gate/up [k -> intermediate], down [intermediate -> k]), no shared
    expert."""
    if shape is GPT_OSS:  # gpt-oss-20b: swiglu with its clamp, biases
        return moejax.MoEConfig.preset(
            "gpt_oss", hidden_size=shape["k"], num_experts=shape["n_mats"], top_k=shape["n_used"],
            intermediate_size=intermediate,
        )  # fmt: skip
    return moejax.MoEConfig.preset(
        "qwen3_moe", hidden_size=shape["k"], num_experts=shape["n_mats"], top_k=shape["n_used"],
        intermediate_size=intermediate,
    )  # fmt: skip


def moejax_times(name: str, ns: list[int], steps: int, rounds: int, working_set: str) -> dict[int, float]:
    """n -> us per ggml projection's worth of the native routed layer (min over rounds of a --steps scan / steps,
    / 3 for --working-set layer)."""
    fmt, x_dtype, _, shape = PAIRS[name]
    per_step = 3 // WORKING_SETS[working_set]  # ggml projections' worth of bytes in one step
    if isinstance(fmt, tuple):
        try:
            fmt = format_by_name(fmt[0], **fmt[1])
        except NotImplementedError as e:  # an option this version does not have: no number
            print(f"{name}: {e}")
            return dict.fromkeys(ns)
    cfg = layer_config(shape, shape["m"] // WORKING_SETS[working_set])
    params = moejax.init_params(cfg, jax.random.key(0), jnp.float32 if fmt is ExpertWeights and x_dtype ==
                                jnp.float32 else jnp.bfloat16, fmt=fmt)  # fmt: skip

    @jax.jit
    def run(p, x):  # the same n tokens every step: the same experts (in cache), as ggml's fixed ids
        def step(c, _):  # x tied to the carry: else XLA hoists the loop-invariant layer out of the scan
            xb, c = jax.lax.optimization_barrier((x, c))
            return c + moejax.moe_forward(p, xb, cfg, impl="native"), None

        return jax.lax.scan(step, x, None, steps)[0]

    out = {}
    for n in ns:
        x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size)).astype(x_dtype)
        run(params, x).block_until_ready()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            run(params, x).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        out[n] = best / steps / per_step * 1e6
    del params
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ggml", type=pathlib.Path, help="a ggml checkout (ggml-org/ggml)")
    parser.add_argument("--ggml-bin", type=pathlib.Path, help="test-backend-ops to run (default: <ggml>/build/bin)")
    parser.add_argument("--build", action="store_true", help="build test-backend-ops in --ggml first")
    parser.add_argument("--formats", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--n", nargs="+", type=int, default=[1, 4, 8, 32, 512], help="tokens per step")
    parser.add_argument(
        "--working-set", default="equal", choices=list(WORKING_SETS),
        help="equal: moejax's layer at intermediate m/3, per step (one ggml projection's bytes); layer: at m, per "
        "step / 3",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=64, help="decode steps per jitted call (n=512: 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", nargs="?", const="", default=None, help="write a results file")
    parser.add_argument("--note", default="", help="a sentence added to the results file's notes")
    args = parser.parse_args()
    if args.build:
        if args.ggml is None:
            parser.error("--build needs --ggml")
        binary = build_ggml(args.ggml)
    else:
        binary = args.ggml_bin or (args.ggml / "build" / "bin" / "test-backend-ops" if args.ggml else None)
    if binary is None or not binary.exists():
        parser.error(f"no test-backend-ops at {binary}: pass --ggml (with --build) or --ggml-bin")
    types = {t for name in args.formats for t in PAIRS[name][2]}
    ggml = ggml_times(binary, types, set(args.n))
    rows = []
    print(f"{'moejax':9s} {'ggml':6s} {'n':>4s} {'ggml us':>9s} {'moejax us':>9s} {'ggml/moejax':>11s}")
    for name in args.formats:
        small = [n for n in args.n if n < 512]
        mj = moejax_times(name, small, args.steps, args.rounds, args.working_set) if small else {}
        if 512 in args.n:
            mj |= moejax_times(name, [512], 1, max(2, args.rounds // 2), args.working_set)
        shape = PAIRS[name][3]
        for t in PAIRS[name][2]:
            row = {"moejax": name, "ggml": t}  # one row per pair: the ratio per n, then both times per n
            times = {}
            for n in args.n:
                g, ours = ggml.get((t, shape["n_mats"], n)), mj[n]
                ratio = None if g is None or ours is None else g / ours
                row[f"n={n}"] = None if ratio is None else round(ratio, 2)
                times[f"us n={n}"] = f"{'-' if g is None else round(g)} / {'-' if ours is None else round(ours)}"
                rs = "-" if ratio is None else f"{ratio:.2f}"
                gs, ms = times[f"us n={n}"].split(" / ")
                print(f"{name:9s} {t:6s} {n:4d} {gs:>9s} {ms:>9s} {rs:>11s}", flush=True)
            rows.append(row | times)
    if args.json is not None:
        moejax_unit = {
            "equal": "at intermediate size m/3, per step (one ggml projection's bytes and multiply-adds). ",
            "layer": "at m, per step / 3. ",
        }[args.working_set]
        notes = (
            "n=N: ggml's time / moejax's per projection's worth of N tokens, above 1: moejax faster; "
            "us n=N: ggml's / moejax's microseconds. ggml: "
            "test-backend-ops perf MUL_MAT_ID (Qwen3-30B-A3B n_mats=128,n_used=8,m=768,k=2048; MXFP4 at gpt-oss-20b's "
            "n_mats=32,n_used=4,m=2880,k=2880); moejax: the native routed layer in a jitted scan, "
            + moejax_unit
            + "Both on all cores of this machine. "
            + args.note
        ).strip()
        date = time.strftime("%Y-%m-%d")
        path = args.json or report.RESULTS / f"ggml_decode_{date}.json"
        report.write("ggml_decode", rows, path, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
