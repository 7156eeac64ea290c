"""GPU benchmark of the Pallas MoE kernels: check each against its reference, then time them beside the XLA plans
and `jax.lax.ragged_dot`, next to a device-to-device copy, a large read and a large bf16 matmul measured in the
same run.

    python benchmarks/gpu_bench.py                        # on a GPU: checks + full table (about 5 min on an H200)
    python benchmarks/gpu_bench.py --append-validated     # ... and record passing kernels in validated.json
    python benchmarks/gpu_bench.py --backward             # also the backward: check, then time value_and_grad
    python benchmarks/gpu_bench.py --dry-run              # the plan (layers, shapes, bytes) without running
    python benchmarks/gpu_bench.py --smoke                # tiny shapes; on CPU the kernels are interpreted

"pallas" is `moejax.backends.pallas` (decode kernel for T <= 8, grouped kernels above), "xla" the
`moejax.backends.xla` plans of the same split, "ragged_dot" a sort + `jax.lax.ragged_dot` implementation (the
measurement: kernel_bench.py).

`--backward`: `pallas_kernels.moe_grouped_vjp` (the Pallas backward: grouped products and tgmm) checked against
`jax.vjp` of the dense reference, then `jax.value_and_grad` of `<y, probe>` w.r.t. the routed experts and x through
`moejax.moe_forward` per impl ("pallas": the kernels both ways; "xla": the XLA plans and moejax's routed-pairs
backward; "ragged": `ragged_dot` and its own transpose), next to the same impl's forward alone.
Targets on an H200: decode >= 80% of the read bandwidth; prefill >= 60% of the matmul rate and >= 2x
ragged_dot.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):  # this checkout and kernel_bench, also when run from anywhere
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import kernel_bench  # noqa: E402
from kernel_bench import (  # noqa: E402
    REL_TOL,
    ceilings,
    check_kernels,
    failed_row,
    kernel_args,
    make_layer,
    print_table,
    routed_inputs,
    run_layers,
    timed,
    todo_layers,
    validation_rows,
)

import moejax  # noqa: E402
import pallas_kernels  # noqa: E402
from moejax.slots import expert_activation  # noqa: E402
from pallas_kernels.grouped_backward import moe_grouped_vjp, moe_grouped_vjp_reference  # noqa: E402

GRADIENTS = ("x", "gate", "up", "down", "weights")  # what moe_grouped_vjp returns for a bias-free layer
TRAIN_IMPLS = ("pallas", "xla", "ragged")

__all__ = ["main", "validation_rows"]


def check_gpu_kernels(params, cfg, smoke: bool) -> list[dict]:
    """Each kernel against its reference (and the XLA plan) on the layer's real shapes, bf16. The kernels run
    compiled on a GPU and interpreted on a CPU (`interpret=None`: the platform decides)."""
    pairs = (
        (pallas_kernels.moe_decode, pallas_kernels.moe_decode_reference),
        (pallas_kernels.moe_grouped, pallas_kernels.moe_grouped_reference),
    )
    return check_kernels(params, cfg, smoke, pairs, {}, compare_xla=True)


def check_backward(params, cfg, smoke: bool) -> list[dict]:
    """`moe_grouped_vjp` against `jax.vjp` of the dense reference on the layer's real shapes, bf16, for a random
    cotangent: each gradient's largest error relative to its largest element."""
    act = expert_activation(cfg)
    T = 40 if smoke else 512
    x, slots = routed_inputs(params, cfg, T, seed=2)
    cotangent = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)

    def grads(vjp):
        return jax.jit(lambda ct, *a: vjp(*a, activation=act, cotangent=ct))(cotangent, *kernel_args(params, x, slots))

    got, want = grads(moe_grouped_vjp), grads(moe_grouped_vjp_reference)
    rel, abs_err, finite = {}, 0.0, True
    for name in GRADIENTS:
        g, w = getattr(got, name).astype(jnp.float32), getattr(want, name).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(g - w)))
        rel[name] = err / float(jnp.max(jnp.abs(w)))
        abs_err = max(abs_err, err)
        finite = finite and bool(jnp.all(jnp.isfinite(g)))
    worst = max(rel.values())
    row = {"kernel": "moe_grouped_vjp", "T": T, "max_abs_error": abs_err, "max_rel_error": worst}
    row |= {f"rel_error_{k}": v for k, v in rel.items()}
    return [{**row, "finite": finite, "passed": finite and worst <= REL_TOL}]


def bench_training(layer, params, Ts: list[int], smoke: bool) -> list[dict]:
    """Per T and impl: the forward alone and `value_and_grad` of `<y, probe>` w.r.t. the routed experts and x."""
    cfg = layer.cfg
    flops = 2 * 3 * cfg.hidden_size * cfg.intermediate_size * cfg.top_k  # the forward's, per row
    rows = []
    for T in Ts:
        x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size), jnp.bfloat16)
        probe = jax.random.normal(jax.random.key(T + 1), x.shape, jnp.float32)
        for impl in TRAIN_IMPLS:
            if impl == "pallas" and jax.default_backend() == "cpu":
                continue  # interpreted Mosaic GPU kernels run one at a time; a grad program holds independent ones

            def loss(experts, x, params, probe, impl=impl):
                y = moejax.moe_forward(dataclasses.replace(params, experts=experts), x, cfg, impl=impl)
                return jnp.sum(y.astype(jnp.float32) * probe)

            forward, train = jax.jit(loss), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            reps, batches = (1, 1) if smoke else (5, 3)
            try:
                t_fwd = timed(forward, params.experts, x, params, probe, reps=reps, batches=batches)
                t_train = timed(train, params.experts, x, params, probe, reps=reps, batches=batches)
            except Exception as err:  # report a failing implementation and go on with the table
                rows.append(failed_row(layer.name, T, impl, err))
                continue
            rows.append(
                {
                    "layer": layer.name,
                    "T": T,
                    "impl": impl,
                    "forward_us": t_fwd * 1e6,
                    "train_us": t_train * 1e6,
                    "train_over_forward": t_train / t_fwd,
                    # the usual count: the backward does twice the forward's products
                    "train_tflop_s": 3 * flops * T / t_train / 1e12,
                }
            )
    return rows


def print_training(ceil: dict, rows: list[dict]) -> None:
    print("value_and_grad w.r.t. experts and x (TFLOP/s: 3x the forward's products)")
    print(f"{'layer':>14} {'T':>6} {'impl':>8} {'fwd us':>10} {'train us':>10} {'ratio':>6} {'TFLOP/s':>8} {'%mm':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['layer']:>14} {r['T']:>6} {r['impl']:>8}  {r['error'][:80]}")
            continue
        print(
            f"{r['layer']:>14} {r['T']:>6} {r['impl']:>8} {r['forward_us']:>10.1f} {r['train_us']:>10.1f} "
            f"{r['train_over_forward']:>6.2f} {r['train_tflop_s']:>8.1f} "
            f"{100 * r['train_tflop_s'] / ceil['matmul_tflop_s']:>4.0f}%"
        )


def run_backward(args, train_T: list[int]) -> tuple[list[dict], list[dict]]:
    checks, rows = [], []
    for i, layer in enumerate(todo_layers(args)):
        params = make_layer(layer, jax.random.key(i))
        checks += [{"layer": layer.name, **c} for c in check_backward(params, layer.cfg, args.smoke)]
        rows += bench_training(layer, params, train_T, args.smoke)
        del params
    return checks, rows


def main(argv: list[str] | None = None) -> int:
    parser = kernel_bench.parser(__doc__, "gpu_bench.json", "GPU")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    parser.add_argument("--backward", action="store_true", help="also check and time the backward")
    parser.add_argument("--train-T", type=int, nargs="*", default=None, help="T of the backward's timings")
    parser.add_argument("--no-forward", action="store_true", help="skip the forward's checks and table")
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
    checks, rows, training = [], [], []
    if not args.no_forward:
        checks, rows = run_layers(args, decode_T, prefill_T, check_gpu_kernels, time_failed=True)
    if args.backward:
        train_T = args.train_T if args.train_T is not None else ([40] if args.smoke else [512, 4096])
        more, training = run_backward(args, train_T)
        checks += more
    print_table(ceil, checks, rows)
    if training:
        print_training(ceil, training)
    return kernel_bench.finish(args, started, ceil, checks, rows, "gpu", training=training)


if __name__ == "__main__":
    sys.exit(main())
