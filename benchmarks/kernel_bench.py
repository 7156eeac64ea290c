"""What benchmarks/gpu_bench.py and tpu_bench.py share: the layers, the routed implementations timed side by side
(the Pallas kernels through `moejax.backends.pallas`, the XLA plans, a `jax.lax.ragged_dot` baseline), the timing
loop, the kernel checks against their references, the table, and the run's JSON and validated.json rows.

Only the routed experts are timed (routing computed once, shared by every implementation; `reps` dependent calls
in one program, so launch overhead is not counted). GB/s counts the bytes of the union experts' bf16 weights
(each distinct selected expert read once); TFLOP/s the useful flops, 2·3·H·I per (token, slot) pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from model_layers import MODEL_LAYERS, Layer  # this script's directory is on sys.path

import pallas_kernels
from moejax.backends import pallas as kernel_plans
from moejax.backends import xla as plans
from moejax.config import MoEConfig
from moejax.params import init_params
from moejax.routing import route
from moejax.slots import Slots, combine_slots, expert_activation, slots_from_routing
from pallas_kernels import GatedActivation

Array = jax.Array
ROOT = Path(__file__).resolve().parents[1]

REL_TOL = 2e-2  # bf16 weights: h is rounded to bf16 before the down projection, an ulp may differ


def layers(smoke: bool) -> list[Layer]:
    if smoke:
        tiny = MoEConfig.preset("qwen3_moe", hidden_size=72, num_experts=8, top_k=2, intermediate_size=40)
        return [Layer("tiny-qwen3", tiny)]
    return [Layer(name, cfg) for name, cfg in MODEL_LAYERS.items()]


# -- implementations of the routed experts (same contract: float32 [T, H]) ----------------------------------------
def ragged_dot_routed(experts, x, slots: Slots, act: GatedActivation) -> Array:
    """Sort pairs by expert, `jax.lax.ragged_dot` for gate, up and down, unsort, weight (the baseline)."""
    T, K = slots.indices.shape
    E = experts.gate.shape[0]
    dtype = experts.gate.dtype
    ids = jnp.minimum(slots.indices.reshape(-1), E)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=E + 1)[:E].astype(jnp.int32)
    xs = x[order // K].astype(dtype)
    if slots.in_scale is not None:
        xs = (xs.astype(jnp.float32) * slots.in_scale.reshape(-1)[order][:, None]).astype(dtype)
    g = jax.lax.ragged_dot(xs, experts.gate, group_sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, experts.up, group_sizes, preferred_element_type=jnp.float32)
    h = act(g, u).astype(dtype)
    y = jax.lax.ragged_dot(h, experts.down, group_sizes, preferred_element_type=jnp.float32)
    per_pair = jnp.zeros_like(y).at[order].set(y).reshape(T, K, -1)
    return combine_slots(per_pair, slots.out_weight)


def implementations(T: int, cfg: MoEConfig) -> dict:
    decode = plans.decode_fits(T, cfg.top_k)
    return {
        "pallas": kernel_plans.pallas_decode if decode else kernel_plans.pallas_grouped,
        "xla": plans.decode_plan if decode else plans.grouped_plan,
        "ragged_dot": ragged_dot_routed,
    }


# -- measurement -----------------------------------------------------------------------------------------------------
def timed(fn, *args, reps: int, batches: int = 3) -> float:
    """Median seconds per call of a jitted `fn` (after a compile call), over `batches` batches of `reps` async
    calls each (queued back to back, so launch overhead hides behind device time)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def repeated(fn, cfg: MoEConfig, reps: int):
    """`reps` dependent calls of the routed implementation `fn` in one jitted program: each call's input is the
    previous input plus 0·output, so nothing is hoisted and Python dispatch is paid once, not per call."""
    act = expert_activation(cfg)

    def run(experts, x, slots):
        def body(_, x):
            y = fn(experts, x, slots, act)
            return x + (y * 0).astype(x.dtype)  # float x·0 is not folded (NaN·0 is NaN)

        return jax.lax.fori_loop(0, reps, body, x)

    return jax.jit(run)


def ceilings(smoke: bool) -> dict:
    """Device-to-device copy bandwidth (read + write of a large bf16 array), read bandwidth (a sum over it: what a
    decode that streams weights can reach) and a large bf16 matmul rate."""
    n_copy = 1 << 16 if smoke else 1 << 30  # elements: 2 GiB of bf16 on a GPU
    n_mm = 256 if smoke else 8192
    reps = 1 if smoke else 10
    a = jax.random.normal(jax.random.key(1), (n_copy,), jnp.bfloat16)  # not zeros: they can run faster
    copy = jax.jit(lambda a: a * 2)  # one read, one write: XLA cannot elide it
    t_copy = timed(copy, a, reps=reps)
    t_read = timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), a, reps=reps)
    m = jax.random.normal(jax.random.key(0), (n_mm, n_mm), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t_mm = timed(matmul, m, m, reps=reps)
    del a, m
    return {
        "copy_gb_s": 2 * n_copy * 2 / t_copy / 1e9,
        "read_gb_s": n_copy * 2 / t_read / 1e9,
        "matmul_tflop_s": 2 * n_mm**3 / t_mm / 1e12,
    }


def make_layer(layer: Layer, key: Array):
    # The stacked layout: what the kernels, the XLA plans and ragged_dot read.
    return jax.jit(lambda k: init_params(layer.cfg, k, dtype=jnp.bfloat16, layout="stacked"))(key)


def routed_inputs(params, cfg: MoEConfig, T: int, seed: int) -> tuple[Array, Slots]:
    x = jax.random.normal(jax.random.key(seed), (T, cfg.hidden_size), jnp.bfloat16)
    slots = jax.jit(lambda p, x: slots_from_routing(route(p, x, cfg), cfg))(params, x)
    return x, slots


def kernel_args(params, x, slots: Slots):
    e = params.experts
    return (x, e.gate, e.up, e.down, slots.indices, slots.out_weight, slots.in_scale)


def failed_row(layer: str, T: int, impl: str, err: Exception) -> dict:
    """A table row for an implementation that failed: the table goes on and shows why."""
    return {"layer": layer, "T": T, "impl": impl, "error": f"{type(err).__name__}: {err}"[:500]}


def bench_layer(layer: Layer, params, decode_T, prefill_T, smoke: bool) -> list[dict]:
    cfg = layer.cfg
    H, I, K = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    expert_bytes = 3 * H * I * 2  # bf16
    rows = []
    for T in (*decode_T, *prefill_T):
        x, slots = routed_inputs(params, cfg, T, seed=T)
        ids = np.asarray(slots.indices)
        union = len(np.unique(ids[ids < cfg.num_experts]))
        flops = 2 * 3 * H * I * T * K
        for name, fn in implementations(T, cfg).items():
            if name == "ragged_dot" and jax.default_backend() == "cpu" and not smoke:
                continue  # ragged_dot densifies on CPU
            reps = 1 if smoke else (20 if T <= 64 else 5)
            try:
                run = repeated(fn, cfg, reps)
                t = timed(run, params.experts, x, slots, reps=1, batches=1 if smoke else 3) / reps
            except Exception as err:  # report a failing implementation and go on with the table
                rows.append(failed_row(layer.name, T, name, err))
                continue
            rows.append(
                {
                    "layer": layer.name,
                    "T": T,
                    "impl": name,
                    "us": t * 1e6,
                    "union": union,
                    "gb_s": union * expert_bytes / t / 1e9,
                    "tflop_s": flops / t / 1e12,
                }
            )
    return rows


def print_table(ceil: dict, checks: list[dict], rows: list[dict]) -> None:
    print(
        f"ceilings: copy {ceil['copy_gb_s']:.0f} GB/s (read + write), read {ceil['read_gb_s']:.0f} GB/s, "
        f"bf16 matmul {ceil['matmul_tflop_s']:.1f} TFLOP/s"
    )
    for c in checks:
        status = "ok" if c["passed"] else "FAILED"
        print(f"check {c['layer']:>14} {c['kernel']:>12} T={c['T']:<5} rel err {c['max_rel_error']:.2e} {status}")
    header = ("layer", 14), ("T", 6), ("impl", 11), ("us", 10), ("union", 6), ("GB/s", 8), ("%read", 6)
    print(" ".join(f"{name:>{width}}" for name, width in (*header, ("TFLOP/s", 8), ("%mm", 5))))
    for r in rows:
        if "error" in r:
            print(f"{r['layer']:>14} {r['T']:>6} {r['impl']:>11}  {r['error'][:80]}")
            continue
        print(
            f"{r['layer']:>14} {r['T']:>6} {r['impl']:>11} {r['us']:>10.1f} {r['union']:>6} {r['gb_s']:>8.0f} "
            f"{100 * r['gb_s'] / ceil['read_gb_s']:>5.0f}% {r['tflop_s']:>8.1f} "
            f"{100 * r['tflop_s'] / ceil['matmul_tflop_s']:>4.0f}%"
        )


def validation_rows(checks: list[dict], device_kind: str) -> list[dict]:
    """One row per kernel whose every check passed: what `pallas_kernels.is_validated` reads."""
    out = []
    for kernel in pallas_kernels.KERNELS + pallas_kernels.BACKWARD_KERNELS:
        mine = [c for c in checks if c["kernel"] == kernel]
        if mine and all(c["passed"] for c in mine):
            out.append(
                {
                    "kernel": kernel,
                    "device_kind": device_kind,
                    "jax_version": jax.__version__,
                    "date": datetime.date.today().isoformat(),
                    "max_abs_error": max(c["max_abs_error"] for c in mine),
                    "max_rel_error": max(c["max_rel_error"] for c in mine),
                    "checked": ", ".join(f"{c['layer']} T={c['T']}" for c in mine),
                }
            )
    return out


def check_kernels(params, cfg: MoEConfig, smoke: bool, pairs, options: dict, compare_xla: bool) -> list[dict]:
    """Each `(kernel, reference)` of `pairs` (decode, then grouped: `pallas_kernels.KERNELS`) on the layer's real
    shapes, bf16, the kernel called with `options`; with `compare_xla`, also against the XLA plan."""
    act = expert_activation(cfg)
    rows = []
    for name, (kernel, reference), T in zip(pallas_kernels.KERNELS, pairs, (3, 40) if smoke else (8, 512), strict=True):
        x, slots = routed_inputs(params, cfg, T, seed=1)
        args = kernel_args(params, x, slots)
        got = jax.jit(lambda *a, k=kernel: k(*a, activation=act, **options))(*args)
        want = jax.jit(lambda *a, r=reference: r(*a, activation=act))(*args)
        scale = float(jnp.max(jnp.abs(want)))
        err = float(jnp.max(jnp.abs(got - want)))
        finite = bool(jnp.all(jnp.isfinite(got)))
        row = {"kernel": name, "T": T, "max_abs_error": err, "max_rel_error": err / scale}
        if compare_xla:
            xla = jax.jit(lambda e, x, s, T=T: implementations(T, cfg)["xla"](e, x, s, act))(params.experts, x, slots)
            row["max_rel_error_vs_xla"] = float(jnp.max(jnp.abs(got - xla))) / scale
        rows.append({**row, "finite": finite, "passed": finite and err <= REL_TOL * scale})
    return rows


def parser(doc: str, out_name: str, device: str) -> argparse.ArgumentParser:
    """The options both benchmarks take (`--smoke`, `--layers`, `--decode-T`, `--prefill-T`, `--out`,
    `--append-validated`)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: kernels interpreted)")
    p.add_argument("--layers", nargs="*", help="layer names to run (default: all)")
    p.add_argument("--decode-T", type=int, nargs="*", default=None)
    p.add_argument("--prefill-T", type=int, nargs="*", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / out_name)
    p.add_argument("--append-validated", action="store_true", help=f"record passing kernels ({device} only)")
    p.add_argument(
        "--json",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write a results file for RESULTS.md "
        "(to PATH; without one, into benchmarks/results); not in --smoke runs",
    )
    return p


def todo_layers(args) -> list[Layer]:
    return [layer for layer in layers(args.smoke) if not args.layers or layer.name in args.layers]


def run_layers(args, decode_T, prefill_T, check: Callable, *, time_failed: bool) -> tuple[list[dict], list[dict]]:
    """`(checks, rows)`: each layer's kernels checked (`check(params, cfg, smoke)`), then timed (unless a check
    failed and not `time_failed`)."""
    checks, rows = [], []
    for i, layer in enumerate(todo_layers(args)):
        params = make_layer(layer, jax.random.key(i))
        checks += [{"layer": layer.name, **c} for c in check(params, layer.cfg, args.smoke)]
        if time_failed or all(c["passed"] for c in checks):
            rows += bench_layer(layer, params, decode_T, prefill_T, args.smoke)
        del params
    return checks, rows


def write_results(result: dict, benchmark: str, path: str | None) -> None:
    """The run (`finish`'s record) as results files in benchmarks/report.py's schema: `benchmark` holds the forward's
    rows with their shares of the ceilings, `<benchmark>_training` the training rows (when the run has them); the
    checks' worst errors go in the notes. `path`: the forward's file (the training file beside it)."""
    import report  # benchmarks/ is on sys.path

    ceil = result["ceilings"]
    on = {"cpu": f"{result['device_kind']} (host: {report.machine()['cpu']})", "isa": result["device_kind"]}
    on["cores"] = os.cpu_count()  # the host's, as for every results file
    worst = {}
    for c in result["checks"]:
        worst[c["kernel"]] = max(worst.get(c["kernel"], 0.0), c["max_rel_error"])
    checked = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    notes = (
        f"jax {result['jax_version']}; ceilings measured in the same run: copy {ceil['copy_gb_s']:.0f} GB/s (read + "
        f"write), read {ceil['read_gb_s']:.0f} GB/s, bf16 matmul {ceil['matmul_tflop_s']:.0f} TFLOP/s. Each kernel "
        f"checked against its reference first (bf16; largest error relative to the largest element: {checked}). "
    )
    shares = {"pct_read": ("gb_s", "read_gb_s"), "pct_matmul": ("tflop_s", "matmul_tflop_s")}
    forward = [
        {**r, **{k: 100 * r[a] / ceil[b] for k, (a, b) in shares.items()}} for r in result["rows"] if "error" not in r
    ]
    if forward:
        about = "pct_read: the union of the selected experts' bytes over a row's time, against the read ceiling; "
        about += "pct_matmul: its products' rate against the matmul ceiling."
        report.write(benchmark, forward, path, notes=notes + about, on=on)
    training = [r for r in result.get("training", []) if "error" not in r]
    if training:
        about = "jax.value_and_grad of <y, probe> w.r.t. the routed experts and x through moejax.moe_forward per impl, "
        about += "next to the same impl's forward; train_tflop_s counts 3x the forward's products."
        there = None if path is None else Path(path).with_name(Path(path).stem + "_training.json")
        report.write(f"{benchmark}_training", training, there, notes=notes + about, on=on)


def finish(args, started: float, ceil: dict, checks: list[dict], rows: list[dict], backend: str, **extra) -> int:
    """Write the run's JSON to `args.out`; with `--append-validated`, append the passing kernels to validated.json
    (full runs on `backend` only). Exit status: 0 when every check passed, 1 when one failed, 2 when refused."""
    device = jax.devices()[0]
    result = {
        "jax_version": jax.__version__,
        "device_kind": device.device_kind,
        "backend": jax.default_backend(),
        "smoke": args.smoke,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": time.time() - started,
        "ceilings": ceil,
        **extra,
        "checks": checks,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    if args.json is not None and not args.smoke:
        write_results(result, f"{backend}_bench", args.json or None)
    if args.append_validated:
        if jax.default_backend() != backend or args.smoke:
            print(f"--append-validated records only full runs on a {backend.upper()}", file=sys.stderr)
            return 2
        new = validation_rows(checks, device.device_kind)
        path = pallas_kernels.VALIDATED_PATH
        path.write_text(json.dumps([*json.loads(path.read_text()), *new], indent=1) + "\n")
        print(f"appended {[r['kernel'] for r in new]} to {path}")
    return 0 if all(c["passed"] for c in checks) else 1
