"""Training cost of the MoE layer: moejax's gradients next to torch autograd through the Hugging Face block.

On the Qwen3-30B-A3B layer (H=2048, E=128, top-8, I=768, float32), in one process, on the same weights:

* **full**: `jax.value_and_grad` of `<y, probe>` w.r.t. x and the routed experts (`impl="auto"`), against torch
  autograd through transformers' `Qwen3MoeSparseMoeBlock` (every experts backend of transformers that runs here;
  the fastest is "HF best"), forward + backward of the same loss and gradients;
* **lora**: LoRA r=16 on the experts' projections and the router, base frozen: gradients w.r.t. the adapters and
  x, against peft's LoRA on the same block (`target_parameters` on the fused expert weights and the router);
* each next to the forward alone (`jax.jit(moe_forward)`; HF under `torch.no_grad`), as `x fwd`;
* **memory**: the compiled temporary memory of the full grad program at E = 16, 64, 128, 256 (K=8, same T),
  compiled from shapes alone (nothing allocated), next to the issue's budget 2·T·K·(H+3I)·4 bytes.

Times are medians of --repeats rounds after a warm-up round; a round calls each contender of a library once
(interleaved within moejax, within transformers and within peft; one library after the other, since two copies of
the layer's weights and gradients beside a third fill a 24 GB machine: run it on a quiet machine). torch runs with
2 threads (--torch-threads). `--only moejax|hf|peft` runs one library per process (a process's peak memory is one
library's); `--json PATH` then merges its fields into PATH's rows (by case), and the ratios are taken once both
sides are there. `--recompute` runs moejax's native backward without the saved pre-activations
(`moejax.backends.native.save_residuals(False)`), for an A/B in two processes. `--keep-freed-memory` makes malloc
keep freed memory in the process (`moejax.backends.native.keep_freed_memory()`: each step's fresh gradient buffers
then reuse the last step's pages instead of faulting in anew), for every library of the process alike. Both options
name their rows ("T=512 keep_freed_memory"), so a file holds them beside the default rows.

    pip install -e ".[peft]"                          # torch (CPU), transformers, peft
    JAX_PLATFORMS=cpu python benchmarks/train_bench.py --json   # T=512 and 2048, median of 3; benchmarks/results/
    python benchmarks/train_bench.py --quick           # tiny shapes: a smoke run
    # one library per process, merged into one results file:
    for lib in moejax hf peft; do
      JAX_PLATFORMS=cpu python benchmarks/train_bench.py --only $lib --json benchmarks/results/train_bench_run.json
    done
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import vs_hf  # benchmarks/vs_hf.py: the HF block built on moejax's weights

import moejax
from moejax.lora import LoRAPair, from_pairs, stack

RANK = 16


def lora_stack(cfg: moejax.MoEConfig, rank: int, seed: int = 0):
    """One random adapter (A ~ N(0, 1/in), B ~ N(0, 0.01²), s = 2) on the router and the experts' projections,
    as a stack (id 1 on every row)."""
    rng = np.random.default_rng(seed)
    E, H, I, N = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.num_selectable
    shapes = {"router": ((), H, N), "experts.gate": ((E,), H, I), "experts.up": ((E,), H, I)}
    shapes["experts.down"] = ((E,), I, H)
    pairs = {}
    for name, (lead, n_in, n_out) in shapes.items():
        a = rng.standard_normal((*lead, rank, n_in), np.float32) / np.sqrt(n_in)
        b = 0.01 * rng.standard_normal((*lead, n_out, rank), np.float32)
        pairs[name] = LoRAPair(jnp.asarray(a), jnp.asarray(b), jnp.float32(2.0))
    return stack([from_pairs(pairs)])


def median_ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 1)


def interleaved(calls: dict, repeats: int) -> dict[str, list[float]]:
    samples = {name: [] for name in calls}
    for round_ in range(1 + repeats):  # one warm-up round
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return samples


def moejax_calls(cfg, params, x, probe, lora):
    """jitted forward, full value_and_grad, LoRA value_and_grad (base frozen) of `<y, probe>`. The parameters are
    arguments, never closed over (a closure would make them constants of each program: another copy apiece)."""
    ids = jnp.ones(x.shape[0], jnp.int32)

    def loss(experts, params, x, probe):
        return jnp.sum(moejax.moe_forward(dataclasses.replace(params, experts=experts), x, cfg) * probe)

    def lora_loss(lora, params, x, probe, ids):
        return jnp.sum(moejax.moe_forward(params, x, cfg, lora=lora, adapter_ids=ids) * probe)

    fwd = jax.jit(lambda params, x: moejax.moe_forward(params, x, cfg))
    full = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
    adapters = jax.jit(jax.value_and_grad(lora_loss, argnums=(0, 2)))
    return {
        "fwd": lambda: jax.block_until_ready(fwd(params, x)),
        "full": lambda: jax.block_until_ready(full(params.experts, params, x, probe)),
        "lora": lambda: jax.block_until_ready(adapters(lora, params, x, probe, ids)),
    }


def hf_calls(layer, params, x, probe, threads: int, backends: list[str], *, peft: bool) -> tuple[dict, dict]:
    """Per experts backend of transformers: forward (no_grad) and forward+backward w.r.t. x and the experts, or
    (`peft`) peft's LoRA (target_parameters) forward+backward w.r.t. the adapters and x. Backends that fail are
    reported with their reason (or skipped where `vs_hf` skips them: batched_mm's T·K copies of the weights)."""
    import torch

    torch.set_num_threads(threads)
    case = vs_hf.Case("prefill", x.shape[0], "random", "float32")
    skipped = {b: reason for b in backends if (reason := vs_hf.skip_reason(b, case, layer.cfg))}
    backends = [b for b in backends if b not in skipped]
    xt = torch.from_numpy(np.asarray(x)).clone()[None]
    pt = torch.from_numpy(np.asarray(probe)).clone()[None]
    if peft:
        try:
            return _peft_calls(layer, params, xt, pt, backends), skipped
        except Exception as err:
            return {}, {"peft": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]}
    block = vs_hf.build_hf_block(layer, params, "float32")
    calls = {}
    for backend in backends:
        vs_hf.set_backend(block, backend)
        try:
            step = _hf_train_step(block, xt, pt, [block.experts.gate_up_proj, block.experts.down_proj])
            step()
        except Exception as err:  # a backend may need CUDA or a kernels package: report it and go on
            skipped[backend] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
            continue
        calls[f"hf {backend} fwd"] = _hf_forward(block, xt, backend)
        calls[f"hf {backend} full"] = step
    return calls, skipped


def _hf_forward(block, xt, backend):
    import torch

    def call():
        vs_hf.set_backend(block, backend)
        with torch.no_grad():
            block(xt)

    return call


def _hf_train_step(block, xt, pt, params):
    import torch

    for p in block.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def call():
        x = xt.detach().requires_grad_(True)
        loss = (block(x) * pt).sum()
        torch.autograd.grad(loss, [x, *params])

    return call


def _peft_calls(layer, params, xt, pt, backends: list[str]) -> dict:
    import peft
    import torch

    block = vs_hf.build_hf_block(layer, params, "float32")
    targets = ["experts.gate_up_proj", "experts.down_proj", "gate.weight"]
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=[], target_parameters=targets)
    model = peft.get_peft_model(block, config)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in adapters:
        torch.nn.init.normal_(p, std=0.01)
    calls = {}
    for backend in backends:

        def step(backend=backend):
            vs_hf.set_backend(block, backend)
            x = xt.detach().requires_grad_(True)
            loss = (model(x) * pt).sum()
            torch.autograd.grad(loss, [x, *adapters])

        try:
            step()
        except Exception:  # the backends that cannot run here are reported by the full case
            continue
        calls[f"peft {backend} lora"] = step
    return calls


def temp_memory(cfg, T: int, num_experts: tuple[int, ...]) -> list[dict]:
    """Compiled temporary bytes of the full grad program at each E (shapes only), per layout."""
    rows = []
    budget = 2 * T * cfg.top_k * (cfg.hidden_size + 3 * cfg.intermediate_size) * 4
    for E in num_experts:
        c = cfg.replace(num_experts=E)
        for layout in ("per_expert", "stacked"):
            params = jax.eval_shape(lambda c=c, layout=layout: moejax.init_params(c, jax.random.key(0), layout=layout))
            x = jax.ShapeDtypeStruct((T, c.hidden_size), jnp.float32)

            def loss(experts, params, x, c=c):
                return jnp.sum(moejax.moe_forward(dataclasses.replace(params, experts=experts), x, c) ** 2)

            grad = jax.jit(jax.grad(loss, argnums=(0, 2)))
            memory = grad.lower(params.experts, params, x).compile().memory_analysis()
            grads = 3 * E * c.hidden_size * c.intermediate_size * 4
            rows.append(
                {
                    "case": f"memory E={E} {layout}",
                    "temp_MB": round(memory.temp_size_in_bytes / 1e6, 1),
                    "gradient_MB": round(grads / 1e6, 1),
                    "budget_MB": round(budget / 1e6, 1),
                }
            )
            print(rows[-1], flush=True)
    return rows


LIBRARIES = ("moejax", "hf", "peft")


def measure(library: str, layer, params, lora, x, probe, args, backends) -> tuple[dict, dict]:
    """One library's fields of a T's row (and the backends it skipped, with their reasons)."""
    if library == "moejax":
        ours = moejax_calls(layer.cfg, params, x, probe, lora)
        for call in ours.values():
            call()  # compile
        ms = {name: median_ms(s) for name, s in interleaved(ours, args.repeats).items()}
        del ours
        gc.collect()
        fwd = ms["fwd"]
        row = {"fwd_ms": fwd, "full_ms": ms["full"], "full_x_fwd": ms["full"] / fwd}
        return row | {"lora_ms": ms["lora"], "lora_x_fwd": ms["lora"] / fwd}, {}
    theirs, skipped = hf_calls(layer, params, x, probe, args.torch_threads, backends, peft=library == "peft")
    ms = {name: median_ms(s) for name, s in interleaved(theirs, args.repeats).items()}
    del theirs
    gc.collect()
    print(library, ms, flush=True)
    if library == "peft":
        peft = [(v, k) for k, v in ms.items()]
        return ({"peft_best_ms": min(peft)[0], "peft_best": min(peft)[1].split()[1]} if peft else {}), skipped
    full = [(v, k) for k, v in ms.items() if k.endswith(" full")]
    if not full:
        return {}, skipped
    best = min(full)[1].split()[1]
    return {"hf_best_full_ms": min(full)[0], "hf_best": best, "hf_best_fwd_ms": ms[f"hf {best} fwd"]}, skipped


def with_ratios(row: dict) -> dict:
    """The row with the cross-library ratios its fields allow, floats rounded."""
    row = dict(row)
    if "hf_best_full_ms" in row and "full_ms" in row:
        row["hf_over_full"] = row["hf_best_full_ms"] / row["full_ms"]
    if "peft_best_ms" in row and "lora_ms" in row:
        row["peft_over_lora"] = row["peft_best_ms"] / row["lora_ms"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def merged(path: Path, rows: list[dict]) -> list[dict]:
    """PATH's rows (when the file exists) updated with `rows`' fields, case by case, in PATH's order."""
    old = json.loads(path.read_text())["results"] if path.exists() else []
    by_case = {row["case"]: dict(row) for row in old}
    for row in rows:
        by_case.setdefault(row["case"], {}).update(row)
    return [with_ratios(row) for row in by_case.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("-T", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--only", nargs="*", choices=LIBRARIES, default=None, help="the libraries to run (default: all)"
    )
    parser.add_argument("--recompute", action="store_true", help="native backward without saved pre-activations")
    parser.add_argument(
        "--keep-freed-memory", action="store_true", help="malloc keeps freed memory (every library's, native.py)"
    )
    parser.add_argument("--hf-backends", nargs="*", default=None, help="transformers experts backends (default: all)")
    parser.add_argument("--memory-E", type=int, nargs="*", default=None, help="E of the memory rows")
    parser.add_argument("--json", nargs="?", const="", default=None, help="results file (default: results/)")
    args = parser.parse_args()
    libraries = args.only or LIBRARIES
    if args.recompute:
        from moejax.backends import native

        native.save_residuals(False)
    if args.keep_freed_memory:
        from moejax.backends import native

        native.keep_freed_memory()
    layer = vs_hf.make_layer("qwen3-30b-a3b", args.quick)
    cfg = layer.cfg
    params = moejax.init_params(cfg, jax.random.key(0), jnp.float32)
    lora = lora_stack(cfg, RANK)
    backends = vs_hf.hf_backends() if args.hf_backends is None else list(args.hf_backends)
    rows = []
    for T in args.T or ((64, 256) if args.quick else (512, 2048)):
        x = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size), jnp.float32)
        probe = jax.random.normal(jax.random.key(2), (T, cfg.hidden_size), jnp.float32)
        # The options in the case's name: a run with them merged into a file keeps the default run's rows.
        options = " recomputed" * args.recompute + " keep_freed_memory" * args.keep_freed_memory
        row, skipped = {"case": f"T={T}{options}"}, {}
        for library in libraries:
            fields, more_skipped = measure(library, layer, params, lora, x, probe, args, backends)
            row |= fields
            skipped |= more_skipped
        rows.append(with_ratios(row))
        print(rows[-1], "\n  skipped:", skipped, flush=True)
    if not args.no_memory and "moejax" in libraries:
        sizes = args.memory_E or ((16, 64) if args.quick else (16, 64, 128, 256))
        rows += temp_memory(cfg, 64 if args.quick else 512, tuple(sizes))
    if args.json is not None:
        from report import write  # benchmarks/report.py: the results files' one schema

        size = " (tiny)" if args.quick else ""
        notes = (  # the same for every run merged into a file: the options are in the rows' names
            f"Qwen3-30B-A3B layer{size}, float32; LoRA r={RANK}; medians of {args.repeats}; pre-activations saved "
            "(rows named recomputed: recomputed in the backward; keep_freed_memory: malloc keeps freed memory, "
            "native.keep_freed_memory)"
        )
        path = Path(args.json) if args.json else None
        write("train_bench", merged(path, rows) if path else rows, path, notes)


if __name__ == "__main__":
    main()
