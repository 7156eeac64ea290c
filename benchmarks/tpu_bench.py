"""TPU benchmark of the Mosaic TPU MoE kernels: check each against its reference, then time them beside the XLA
plans and `jax.lax.ragged_dot`, against the chip's HBM bandwidth and MXU peak (and a copy and a large bf16 matmul
measured in the same run).

    python benchmarks/tpu_bench.py                        # on a TPU: checks + full table
    python benchmarks/tpu_bench.py --append-validated     # ... and record passing kernels in validated.json
    python benchmarks/tpu_bench.py --smoke                # tiny shapes; on CPU the kernels run interpreted

The measurement is gpu_bench.py's (same layers, same `repeated` programs, same table): "pallas" is
`moejax.backends.pallas`, whose kernels lower to the Mosaic TPU ones on a TPU (`pallas_kernels/tpu_decode.py`,
`tpu_grouped.py`); GB/s counts the union experts' bf16 weights, TFLOP/s the useful 2·3·H·I per (token, slot) pair.
Targets (issue 21): decode >= 85% of HBM bandwidth over the union's bytes, prefill >= 70% of the MXU peak at
T=2048. Validated rows name the chip as JAX does ("TPU v6 lite"), which `impl="auto"` matches while lowering.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import pallas_kernels  # noqa: E402
from moejax.experts import expert_activation  # noqa: E402

_spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
gpu_bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_bench", gpu_bench)
_spec.loader.exec_module(gpu_bench)

# Per chip (JAX's device_kind): HBM GB/s and bf16 MXU TFLOP/s from Google's published specifications.
PEAKS = {
    "TPU v4": (1200, 275),
    "TPU v5 lite": (819, 197),
    "TPU v5": (2765, 459),
    "TPU v5p": (2765, 459),
    "TPU v6 lite": (1640, 918),
    "TPU7x": (7370, 2307),
}


def check_kernels(params, cfg, smoke: bool) -> list[dict]:
    """Each Mosaic TPU kernel against its reference on the layer's real shapes, bf16 (interpreted off a TPU)."""
    act = expert_activation(cfg)
    interpret = jax.default_backend() != "tpu"
    kind = jax.devices()[0].device_kind
    rows = []
    for name, kernel, reference, T in (
        ("moe_decode", pallas_kernels.moe_tpu_decode, pallas_kernels.moe_tpu_decode_reference, 3 if smoke else 8),
        ("moe_grouped", pallas_kernels.moe_tpu_grouped, pallas_kernels.moe_tpu_grouped_reference, 40 if smoke else 512),
    ):
        x, slots = gpu_bench.routed_inputs(params, cfg, T, seed=1)
        args = gpu_bench.kernel_args(params, x, slots)
        got = jax.jit(lambda *a, k=kernel: k(*a, activation=act, device_kind=kind, interpret=interpret))(*args)
        want = jax.jit(lambda *a, r=reference: r(*a, activation=act))(*args)
        scale = float(abs(want).max())
        err = float(abs(got - want).max())
        finite = bool(jax.numpy.isfinite(got).all())
        rows.append(
            {
                "kernel": name,
                "T": T,
                "max_abs_error": err,
                "max_rel_error": err / scale,
                "finite": finite,
                "passed": finite and err <= gpu_bench.REL_TOL * scale,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: kernels interpreted)")
    parser.add_argument("--layers", nargs="*", help="layer names to run (default: all)")
    parser.add_argument("--decode-T", type=int, nargs="*", default=None)
    parser.add_argument("--prefill-T", type=int, nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "tpu_bench.json")
    parser.add_argument("--append-validated", action="store_true", help="record passing kernels (TPU only)")
    args = parser.parse_args(argv)

    decode_T = args.decode_T if args.decode_T is not None else ([2] if args.smoke else [1, 2, 4, 8])
    prefill_T = args.prefill_T if args.prefill_T is not None else ([40] if args.smoke else [512, 2048, 8192])
    todo = [layer for layer in gpu_bench.layers(args.smoke) if not args.layers or layer.name in args.layers]
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
    if not args.smoke and jax.default_backend() != "tpu":
        print("no TPU: run with --smoke (tiny shapes, interpreted kernels)", file=sys.stderr)
        return 2

    started = time.time()
    ceil = gpu_bench.ceilings(args.smoke)
    hbm, mxu = PEAKS.get(device.device_kind, (None, None))
    if hbm:
        print(f"{device.device_kind} peaks: HBM {hbm} GB/s, bf16 MXU {mxu} TFLOP/s")
    checks, rows = [], []
    for i, layer in enumerate(todo):
        params = gpu_bench.make_layer(layer, jax.random.key(i))
        checks += [{"layer": layer.name, **c} for c in check_kernels(params, layer.cfg, args.smoke)]
        if all(c["passed"] for c in checks):  # time only what computes the right thing
            rows += gpu_bench.bench_layer(layer, params, decode_T, prefill_T, args.smoke)
        del params
    for r in rows:
        if hbm and "gb_s" in r:
            r["hbm_fraction"], r["mxu_fraction"] = r["gb_s"] / hbm, r["tflop_s"] / mxu
    gpu_bench.print_table(ceil, checks, rows)
    result = {
        "jax_version": jax.__version__,
        "device_kind": device.device_kind,
        "backend": jax.default_backend(),
        "smoke": args.smoke,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": time.time() - started,
        "ceilings": ceil,
        "peaks": {"hbm_gb_s": hbm, "mxu_tflop_s": mxu},
        "checks": checks,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    if args.append_validated:
        if jax.default_backend() != "tpu" or args.smoke:
            print("--append-validated records only full runs on a TPU", file=sys.stderr)
            return 2
        new = gpu_bench.validation_rows(checks, device.device_kind)
        path = pallas_kernels.VALIDATED_PATH
        path.write_text(json.dumps([*json.loads(path.read_text()), *new], indent=1) + "\n")
        print(f"appended {[r['kernel'] for r in new]} to {path}")
    return 0 if all(c["passed"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
