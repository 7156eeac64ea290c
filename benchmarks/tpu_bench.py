"""TPU benchmark of the Mosaic TPU MoE kernels: check each against its reference, then time them beside the XLA
plans and `jax.lax.ragged_dot`, against the chip's HBM bandwidth and MXU peak (and a copy and a large bf16 matmul
measured in the same run).

    python benchmarks/tpu_bench.py                        # on a TPU: checks + full table
    python benchmarks/tpu_bench.py --append-validated     # ... and record passing kernels in validated.json
    python benchmarks/tpu_bench.py --smoke                # tiny shapes; on CPU the kernels run interpreted

The measurement is gpu_bench.py's (kernel_bench.py: same layers, same `repeated` programs, same table): "pallas" is
`moejax.backends.pallas`, whose kernels lower to the Mosaic TPU ones on a TPU (`pallas_kernels/tpu_decode.py`,
`tpu_grouped.py`); GB/s counts the union experts' bf16 weights, TFLOP/s the useful 2·3·H·I per (token, slot) pair.
Targets (issue 21): decode >= 85% of HBM bandwidth over the union's bytes, prefill >= 70% of the MXU peak at
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

import kernel_bench  # noqa: E402
from kernel_bench import ceilings, check_kernels, print_table, run_layers  # noqa: E402

import pallas_kernels  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    args = kernel_bench.parser(__doc__, "tpu_bench.json", "TPU").parse_args(argv)
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
    peaks = {"hbm_gb_s": hbm, "mxu_tflop_s": mxu}
    return kernel_bench.finish(args, started, ceil, checks, rows, "tpu", peaks=peaks)


if __name__ == "__main__":
    sys.exit(main())
