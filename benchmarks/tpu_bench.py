"""TPU benchmark of the Mosaic TPU MoE kernels: check each against its reference, then time them beside the XLA
plans and `jax.lax.ragged_dot`, against the chip's HBM bandwidth and MXU peak (and a copy and a large bf16 matmul
measured in the same run).

    python benchmarks/tpu_bench.py                        # on a TPU: checks + full table
    python benchmarks/tpu_bench.py --append-validated     # ... and record passing kernels in validated.json
    python benchmarks/tpu_bench.py --smoke                # tiny shapes; on CPU the kernels run interpreted
    python benchmarks/tpu_bench.py --formats int8 int4 fp8_block mxfp4 nvfp4   # ... and the quantized kernels

The measurement is gpu_bench.py's (kernel_bench.py: same layers, same `repeated` programs, same table): "pallas" is
`moejax.backends.pallas`, whose kernels lower to the Mosaic TPU ones on a TPU (`pallas_kernels/tpu_decode.py`,
`tpu_grouped.py`); GB/s counts the union experts' bf16 weights, TFLOP/s the useful 2·3·H·I per (token, slot) pair.
Targets: decode >= 85% of HBM bandwidth over the union's bytes, prefill >= 70% of the MXU peak at
T=2048. Validated rows name the chip as JAX does ("TPU v6 lite"), which `impl="auto"` matches while lowering.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):  # this checkout and kernel_bench, also when run from anywhere
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import datetime  # noqa: E402
import json  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import kernel_bench  # noqa: E402
import numpy as np  # noqa: E402
from kernel_bench import ceilings, check_kernels, print_table, routed_inputs, run_layers, timed  # noqa: E402

import pallas_kernels  # noqa: E402
from moejax.backends import pallas as kernel_plans  # noqa: E402
from moejax.quantized import format_by_name  # noqa: E402
from moejax.slots import expert_activation  # noqa: E402

QUANTIZED = ("int8", "int4", "fp8_block", "mxfp4", "nvfp4")

# Per chip (JAX's device_kind): HBM GB/s and bf16 MXU TFLOP/s from Google's published specifications.
PEAKS = {
    "TPU v4": (1200, 275),
    "TPU v5 lite": (819, 197),
    "TPU v5": (2765, 459),
    "TPU v5p": (2765, 459),
    "TPU v6 lite": (1640, 918),
    "TPU7x": (7370, 2307),
}


def check_tpu_kernels(params, cfg, smoke: bool) -> list[dict]:
    """Each Mosaic TPU kernel against its reference on the layer's real shapes, bf16 (interpreted off a TPU)."""
    pairs = (
        (pallas_kernels.moe_tpu_decode, pallas_kernels.moe_tpu_decode_reference),
        (pallas_kernels.moe_tpu_grouped, pallas_kernels.moe_tpu_grouped_reference),
    )
    options = {"device_kind": jax.devices()[0].device_kind, "interpret": jax.default_backend() != "tpu"}
    return check_kernels(params, cfg, smoke, pairs, options, compare_xla=False)


def _tpu_pairs():
    return (
        (pallas_kernels.moe_tpu_decode, pallas_kernels.moe_tpu_decode_reference),
        (pallas_kernels.moe_tpu_grouped, pallas_kernels.moe_tpu_grouped_reference),
    )


def _check_format(params, cfg, weights, scheme: str, smoke: bool, options: dict) -> list[dict]:
    """Both TPU kernels on `weights` (`QuantizedWeight`s) against their reference: decode T=8, grouped T=512."""
    act, out = expert_activation(cfg), []
    for kernel_name, (kernel, reference), T in zip(
        pallas_kernels.KERNELS, _tpu_pairs(), (3, 40) if smoke else (8, 512), strict=True
    ):
        x, slots = routed_inputs(params, cfg, T, seed=1)
        call = (x, *weights, slots.indices, slots.out_weight, slots.in_scale)
        got = jax.jit(lambda *a, k=kernel: k(*a, activation=act, **options))(*call)
        want = jax.jit(lambda *a, r=reference: r(*a, activation=act))(*call)
        scale, err = float(jnp.max(jnp.abs(want))), float(jnp.max(jnp.abs(got - want)))
        passed = bool(jnp.all(jnp.isfinite(got))) and err <= kernel_bench.REL_TOL * scale
        out.append({"kernel": kernel_name, "weights": scheme, "T": T, "max_abs_error": err} | {"passed": passed})
        out[-1]["max_rel_error"] = err / scale
    return out


def _time_decode(params, cfg, weights, T: int, smoke: bool, options: dict) -> tuple[int, float]:
    """(union size, seconds per call) of the TPU decode kernel at T rows."""
    x, slots = routed_inputs(params, cfg, T, seed=T)
    ids = np.asarray(slots.indices)
    act = expert_activation(cfg)
    fn = jax.jit(
        lambda x, *w: pallas_kernels.moe_tpu_decode(
            x, *w, slots.indices, slots.out_weight, slots.in_scale, activation=act, **options
        )
    )
    return len(np.unique(ids[ids < cfg.num_experts])), timed(fn, x, *weights, reps=2 if smoke else 50)


def quantized_rows(args, decode_T, hbm) -> tuple[list[dict], list[dict]]:
    """Per layer and quantized format (`--formats`): both TPU kernels checked against their reference, then decode
    timed (only where every check so far passed): GB/s over the union experts' codes and scales."""
    checks, rows = [], []
    options = {"device_kind": jax.devices()[0].device_kind, "interpret": jax.default_backend() != "tpu"}
    for i, layer in enumerate(kernel_bench.todo_layers(args)):
        params, cfg = kernel_bench.make_layer(layer, jax.random.key(i)), layer.cfg
        for name in args.formats:
            try:
                fmt = format_by_name(name)
                experts = jax.jit(fmt.init, static_argnums=0)(cfg, jax.random.key(100 + i))
                weights = kernel_plans.quantized_weights("tpu_bench", experts)
            except (ValueError, NotImplementedError) as err:  # e.g. groups of 128 over gpt-oss's 2880
                print(f"skip {layer.name} {name}: {err}")
                continue
            scheme = experts.scheme.name
            checks += [
                {"layer": layer.name, **c} for c in _check_format(params, cfg, weights, scheme, args.smoke, options)
            ]
            if not all(c["passed"] for c in checks):
                continue
            nbytes = sum(a.nbytes for w in weights for a in (w.codes, w.scale, w.zero, w.scale2) if a is not None)
            for T in decode_T:
                union, seconds = _time_decode(params, cfg, weights, T, args.smoke, options)
                gb_s = nbytes / cfg.num_experts * union / seconds / 1e9
                rows.append(
                    {"layer": layer.name, "weights": scheme, "T": T, "union": union, "us": seconds * 1e6, "gb_s": gb_s}
                    | {"hbm_fraction": gb_s / hbm if hbm else None}
                )
                print(f"{layer.name:>14} {scheme:>16} T={T:<2} {seconds * 1e6:9.1f} us {gb_s:8.0f} GB/s")
        del params
    return checks, rows


def quantized_validated(checks: list[dict], device_kind: str) -> list[dict]:
    """validated.json rows (with their `weights` field) for the quantized kernels that passed on every layer."""
    out = []
    for kernel, weights in sorted({(c["kernel"], c["weights"]) for c in checks if "weights" in c}):
        mine = [c for c in checks if c.get("weights") == weights and c["kernel"] == kernel]
        if all(c["passed"] for c in mine):
            out.append(
                {"kernel": kernel, "device_kind": device_kind, "jax_version": jax.__version__, "weights": weights}
                | {"date": datetime.date.today().isoformat(), "max_rel_error": max(c["max_rel_error"] for c in mine)}
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = kernel_bench.parser(__doc__, "tpu_bench.json", "TPU")
    parser.add_argument("--formats", nargs="*", default=[], help=f"quantized formats to check and time: {QUANTIZED}")
    args = parser.parse_args(argv)
    decode_T = args.decode_T if args.decode_T is not None else ([2] if args.smoke else [1, 2, 4, 8])
    prefill_T = args.prefill_T if args.prefill_T is not None else ([40] if args.smoke else [512, 2048, 8192])
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
    if not args.smoke and jax.default_backend() != "tpu":
        print("no TPU: run with --smoke (tiny shapes, interpreted kernels)", file=sys.stderr)
        return 2

    started = time.time()
    ceil = ceilings(args.smoke)
    hbm, mxu = PEAKS.get(device.device_kind, (None, None))
    if hbm:
        print(f"{device.device_kind} peaks: HBM {hbm} GB/s, bf16 MXU {mxu} TFLOP/s")
    # Time only what computes the right thing.
    checks, rows = run_layers(args, decode_T, prefill_T, check_tpu_kernels, time_failed=False)
    for r in rows:
        if hbm and "gb_s" in r:
            r["hbm_fraction"], r["mxu_fraction"] = r["gb_s"] / hbm, r["tflop_s"] / mxu
    print_table(ceil, checks, rows)
    q_checks, q_rows = quantized_rows(args, decode_T, hbm)
    for c in q_checks:
        print(f"check {c['layer']:>14} {c['kernel']:>12} {c['weights']:>16} T={c['T']:<4} passed={c['passed']}")
    peaks = {"hbm_gb_s": hbm, "mxu_tflop_s": mxu}
    extra = {"peaks": peaks, "quantized_checks": q_checks, "quantized": q_rows}
    status = kernel_bench.finish(args, started, ceil, checks, rows, "tpu", **extra)
    if not all(c["passed"] for c in q_checks):
        return 1
    if status == 0 and args.append_validated and q_checks:
        path = pallas_kernels.VALIDATED_PATH
        new = quantized_validated(q_checks, jax.devices()[0].device_kind)
        path.write_text(json.dumps([*json.loads(path.read_text()), *new], indent=1) + "\n")
        print(f"appended {len(new)} quantized rows to {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
