"""GPU benchmark of the Pallas MoE kernels: check each against its reference, then time them beside the XLA plans
and `jax.lax.ragged_dot`, next to a device-to-device copy and a large bf16 matmul measured in the same run.

    python benchmarks/gpu_bench.py                        # on a GPU: checks + full table (about 8 min on an H200)
    python benchmarks/gpu_bench.py --append-validated     # ... and record passing kernels in validated.json
    python benchmarks/gpu_bench.py --dry-run              # the plan (layers, shapes, bytes) without running
    python benchmarks/gpu_bench.py --smoke                # tiny shapes; on CPU the kernels are interpreted

"pallas" is `moejax.backends.pallas` (decode kernel for T <= 8, grouped kernels above), "xla" the
`moejax.backends.xla` plans of the same split, "ragged_dot" a sort + `jax.lax.ragged_dot` implementation (the
measurement: kernel_bench.py).
Targets on an H200: decode >= 80% of the copy bandwidth; prefill >= 60% of the matmul rate and >= 2x
ragged_dot.
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
from kernel_bench import ceilings, check_kernels, print_table, run_layers, todo_layers, validation_rows  # noqa: E402

import pallas_kernels  # noqa: E402

__all__ = ["main", "validation_rows"]


def check_gpu_kernels(params, cfg, smoke: bool) -> list[dict]:
    """Each kernel against its reference (and the XLA plan) on the layer's real shapes, bf16. The kernels run
    compiled on a GPU and interpreted on a CPU (`interpret=None`: the platform decides)."""
    pairs = (
        (pallas_kernels.moe_decode, pallas_kernels.moe_decode_reference),
        (pallas_kernels.moe_grouped, pallas_kernels.moe_grouped_reference),
    )
    return check_kernels(params, cfg, smoke, pairs, {}, compare_xla=True)


def main(argv: list[str] | None = None) -> int:
    parser = kernel_bench.parser(__doc__, "gpu_bench.json", "GPU")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = parser.parse_args(argv)

    decode_T = args.decode_T if args.decode_T is not None else ([2] if args.smoke else [1, 2, 4, 8, 16, 64])
    prefill_T = args.prefill_T if args.prefill_T is not None else ([40] if args.smoke else [512, 2048, 8192])
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); backend {jax.default_backend()}")
    if args.dry_run:
        for layer in todo_layers(args):
            c = layer.cfg
            gb = c.num_experts * 3 * c.hidden_size * c.intermediate_size * 2 / 1e9
            print(
                f"{layer.name}: H={c.hidden_size} E={c.num_experts} K={c.top_k} I={c.intermediate_size}, "
                f"{gb:.1f} GB of bf16 experts; decode T={decode_T}, prefill T={prefill_T}, impls pallas/xla/ragged_dot"
            )
        return 0
    if not args.smoke and jax.default_backend() != "gpu":
        print("no GPU: run with --smoke (tiny shapes, interpreted kernels) or --dry-run", file=sys.stderr)
        return 2

    started = time.time()
    ceil = ceilings(args.smoke)
    checks, rows = run_layers(args, decode_T, prefill_T, check_gpu_kernels, time_failed=True)
    print_table(ceil, checks, rows)
    return kernel_bench.finish(args, started, ceil, checks, rows, "gpu")


if __name__ == "__main__":
    sys.exit(main())
