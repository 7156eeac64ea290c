"""moejax's MoE layer next to the Hugging Face transformers MoE block of the same layer, timed in one process.

Both sides hold the same weights (`moejax.init_params`, converted with `moejax.hf.params_to_hf` and loaded into the
transformers block with `load_state_dict`), and their outputs are checked to agree before anything is timed. The
transformers block runs under each experts backend of transformers 5 (`config._experts_implementation`: "eager"
and the `ExpertsInterface` entries, e.g. "batched_mm", "grouped_mm"); a backend that cannot run on this machine is
skipped with its reason, and the fastest one that runs is "HF best". moejax runs `jax.jit(moejax.moe_forward)` with
`impl="auto"` (--impl: another backend; on CPU "auto" is the native kernels when built); its compile time is
excluded from the timing and printed apart.

Cases (default layer Qwen3-30B-A3B, float32): decode T=1, 2, 4, 8 with random tokens, T=8 with one token repeated,
prefill T=512 and T=2048, and a bfloat16 decode T=1. Each row prints the HF time per backend, HF best, the moejax
time, the ratio HF best / moejax (>= 1.0: moejax is faster), and for decode the GB/s moejax reaches over the bytes
of the union experts' weights (distinct experts chosen by the T tokens, plus a shared expert if the layer has one),
for prefill its GFLOP/s over 2·3·H·I per (token, slot) pair, each next to a ceiling measured in the same run: the
read bandwidth of a contiguous float32 GEMV in jax and the rate of a 2048³ float32 matmul in jax (the best of a
measurement before and one after the cases). Times are medians of --repeats rounds after a warm-up round; a round
calls moejax and every HF backend once, so that on a shared machine all of them see the same stretches of load.
torch runs under `torch.inference_mode()` with `torch.set_num_threads(2)` (--torch-threads); jax uses every core.
In a round each contender waits SETTLE_S, then makes WARM_CALLS untimed calls right before its timed one, so the
timed call runs as in a model (after calls of its own, not of the other library): torch's OpenMP threads spin for a
while after a call (libgomp's default) and took the cores from a jax call that followed at once (quiet 2-core
machine, median of 7, moejax decode T=1 float32 11.82 ms right after torch vs 7.57 with torch's threads passive;
with one untimed call and no wait, bfloat16 T=1 at ~3.5 ms a call still ran 5.9 ms), and after the wait HF's
block needed two calls to be back at its pace (bfloat16 T=1: 5.9 ms after one, 4.4 after two).

Run (torch and transformers come with the `peers` extra; torch==2.13.0 is a CPU build):

    pip install -e ".[peers]"
    python benchmarks/vs_hf.py                          # Qwen3-30B-A3B layer, median of 5
    python benchmarks/vs_hf.py --quick                  # tiny shapes: a smoke run of a few seconds
    python benchmarks/vs_hf.py --layer mixtral-8x7b --repeats 3 --json vs_hf.json
    python benchmarks/vs_hf.py --only "T=8 repeated" --only bfloat16     # rerun some cases (a noisy one)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from model_layers import MODEL_LAYERS  # this script's directory is on sys.path

import moejax

try:
    import torch
    import transformers
except ImportError as _err:
    torch = transformers = None
    _PEERS_MISSING = str(_err)

THREADS = 2
# batched_mm gathers one copy of the expert weights per (token, slot) pair: skip it past this many bytes.
BATCHED_MM_MAX_BYTES = 3 * 2**30
# max |HF - moejax| / max |moejax| allowed by the agreement check, per dtype
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
FALLBACK_BACKENDS = ("eager", "batched_mm", "grouped_mm")
SETTLE_S = 0.1  # seconds each contender waits before its calls (the module docstring: torch's spinning threads)
WARM_CALLS = 2  # untimed calls of a contender right before its timed one


# -- layers ----------------------------------------------------------------------------------------------------


def _qwen3_kwargs(cfg: moejax.MoEConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.hidden_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": cfg.normalize,
    }


def _mixtral_kwargs(cfg: moejax.MoEConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.hidden_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "intermediate_size": cfg.intermediate_size,
        "router_jitter_noise": 0.0,
    }


def _deepseek_kwargs(cfg: moejax.MoEConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.hidden_size,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.intermediate_size,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "n_shared_experts": cfg.shared_intermediate_size // cfg.intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.normalize,
    }


# layer name (model_layers.MODEL_LAYERS) -> (HF model_type, HF MoE block class, HF config kwargs from the cfg)
HF_BLOCKS: dict[str, tuple[str, str, Callable[[moejax.MoEConfig], dict[str, Any]]]] = {
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", _qwen3_kwargs),
    "mixtral-8x7b": ("mixtral", "MixtralSparseMoeBlock", _mixtral_kwargs),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3MoE", _deepseek_kwargs),
}


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    cfg: moejax.MoEConfig
    model_type: str
    block: str
    hf_kwargs: dict[str, Any]


def make_layer(name: str, quick: bool) -> Layer:
    cfg = MODEL_LAYERS[name]
    label = name
    if name == "qwen3-30b-a3b":
        cfg = cfg.replace(normalize=True)  # the released Qwen3-30B-A3B config sets norm_topk_prob=True
    if quick:
        shared = 64 if cfg.shared_intermediate_size else 0
        top_k = min(cfg.top_k, 4)
        cfg = cfg.replace(
            hidden_size=128, intermediate_size=64, num_experts=min(cfg.num_experts, 16), top_k=top_k,
            shared_intermediate_size=shared,
        )  # fmt: skip
        label = f"{name}/tiny"
    elif name == "deepseek-v3":
        cfg = cfg.replace(num_experts=32)  # 256 experts are 45 GB per copy in float32: keep 32 (4 per group)
        label = f"{name}/E32"
    model_type, block, kwargs = HF_BLOCKS[name]
    return Layer(label, cfg, model_type, block, kwargs(cfg))


def expert_bytes(cfg: moejax.MoEConfig, itemsize: int) -> int:
    return 3 * cfg.hidden_size * cfg.intermediate_size * itemsize


def shared_bytes(cfg: moejax.MoEConfig, itemsize: int) -> int:
    return 3 * cfg.hidden_size * cfg.shared_intermediate_size * itemsize


# -- cases -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    phase: str  # "decode" or "prefill"
    T: int
    kind: str  # "random" or "repeated"
    dtype: str

    @property
    def label(self) -> str:
        suffix = " repeated" if self.kind == "repeated" else ""
        return f"{self.phase} T={self.T}{suffix}"


def make_cases(quick: bool) -> list[Case]:
    cases = [Case("decode", T, "random", "float32") for T in (1, 2, 4, 8)]
    cases.append(Case("decode", 8, "repeated", "float32"))
    cases += [Case("prefill", T, "random", "float32") for T in ((64, 256) if quick else (512, 2048))]
    cases.append(Case("decode", 1, "random", "bfloat16"))
    return cases


def make_input(case: Case, hidden: int, key: jax.Array) -> jax.Array:
    """x ~ N(0, 1) rows (routing spreads over the experts), or one such row on every row."""
    rows = 1 if case.kind == "repeated" else case.T
    x = jax.random.normal(key, (rows, hidden), jnp.float32)
    return jnp.broadcast_to(x, (case.T, hidden)).astype(case.dtype)


def union_size(params, x: jax.Array, cfg: moejax.MoEConfig) -> int:
    indices = np.asarray(moejax.route(params, x, cfg).indices)
    return int(np.unique(indices[indices < cfg.num_experts]).size)


# -- timing ----------------------------------------------------------------------------------------------------


def sample_seconds(call: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    """Seconds of each of `repeats` calls of `call`, after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def measure_ceilings(quick: bool, repeats: int) -> dict[str, Any]:
    """Read bandwidth of a jitted float32 GEMV [1, n] x [n, n] and the rate of an m³ float32 matmul, in jax.

    A ceiling is the best rate seen, so each takes the fastest of its runs (not the median). The GEMV's 1 GiB is
    well over a last-level cache (a 256 MiB matrix read partly from a 260 MiB L3 gave 30-42 GB/s between runs).
    """
    n, m = (2048, 512) if quick else (16384, 2048)
    key = jax.random.key(0)
    w = jax.random.normal(key, (n, n), jnp.float32)
    v = jnp.ones((1, n), jnp.float32)
    gemv = jax.jit(lambda v, w: v @ w)
    seconds = min(sample_seconds(lambda: gemv(v, w).block_until_ready(), 2 * repeats, warmup=2))
    read = w.size * 4 / seconds / 1e9
    a = jax.random.normal(key, (m, m), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    seconds = min(sample_seconds(lambda: matmul(a, a).block_until_ready(), 2 * repeats, warmup=2))
    return {
        "gemv_n": n,
        "gemv_MB": w.size * 4 / 1e6,
        "read_GBps": read,
        "matmul_m": m,
        "matmul_GFLOPs": 2 * m**3 / seconds / 1e9,
    }


def best_ceilings(before: dict, after: dict) -> dict:
    """The higher of the rates measured before and after the cases (the machine may be shared)."""
    best = {key: max(before[key], after[key]) for key in ("read_GBps", "matmul_GFLOPs")}
    return {**before, **best, "before": before, "after": after}


@dataclasses.dataclass(frozen=True)
class Contender:
    """One implementation of a case: `setup` (untimed, e.g. pick the HF backend), then `call` (timed)."""

    name: str
    setup: Callable[[], Any]
    call: Callable[[], Any]


def interleaved_samples(contenders: list[Contender], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of `repeats` calls of each contender, round-robin (one call of each per round), after `warmup`
    untimed rounds: on a shared machine every contender then sees the same stretches of load. Each timed call
    follows WARM_CALLS untimed calls of the same contender (module docstring)."""
    samples: dict[str, list[float]] = {c.name: [] for c in contenders}
    for round_ in range(warmup + repeats):
        for contender in contenders:
            time.sleep(SETTLE_S)  # the other library's spinning threads park first
            for _ in range(WARM_CALLS):
                contender.setup()
                contender.call()
            contender.setup()
            start = time.perf_counter()
            contender.call()
            if round_ >= warmup:
                samples[contender.name].append(time.perf_counter() - start)
    return samples


# -- Hugging Face side -----------------------------------------------------------------------------------------


def hf_backends() -> list[str]:
    """ "eager" (the block's own forward) plus every entry of transformers' ExpertsInterface."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return list(FALLBACK_BACKENDS)
    return ["eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]


def to_torch(a: Any) -> torch.Tensor:
    """A torch view of `a`'s buffer (no copy): only read from (load_state_dict copies; inputs are cloned)."""
    a = np.asarray(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        if a.dtype == jnp.bfloat16:  # numpy has no native bfloat16: move the bits
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def build_hf_block(layer: Layer, params, dtype: str) -> torch.nn.Module:
    """The transformers MoE block of `layer` holding moejax's `params` (converted with moejax.hf.params_to_hf)."""
    config = transformers.AutoConfig.for_model(layer.model_type, **layer.hf_kwargs)
    module = importlib.import_module(f"transformers.models.{layer.model_type}.modeling_{layer.model_type}")
    block = getattr(module, layer.block)(config).to(getattr(torch, dtype)).eval()
    state = {key: to_torch(value) for key, value in moejax.hf.params_to_hf(params, layer.cfg).items()}
    block.load_state_dict(state, strict=True)
    return block


def set_backend(block: torch.nn.Module, backend: str) -> None:
    for module in block.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = backend


def run_hf(block: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        out = block(x[None])[0]
    return out.float().numpy()


def rel_err(out: np.ndarray, reference: np.ndarray) -> float:
    reference = np.asarray(reference, np.float32)
    return float(np.max(np.abs(out - reference)) / max(float(np.max(np.abs(reference))), 1e-30))


def skip_reason(backend: str, case: Case, cfg: moejax.MoEConfig) -> str | None:
    gathered = case.T * cfg.top_k * expert_bytes(cfg, jnp.dtype(case.dtype).itemsize)
    if backend == "batched_mm" and gathered > BATCHED_MM_MAX_BYTES:
        return f"would gather {gathered / 2**30:.0f} GiB of expert weights (T·K copies), over the 3 GiB limit"
    return None


def try_hf_backend(block, x: torch.Tensor, backend: str, case: Case, cfg, reference: np.ndarray) -> dict:
    """{"rel_err"} of one backend's output against moejax's, or {"skipped": reason} when it cannot run here."""
    reason = skip_reason(backend, case, cfg)
    if reason:
        return {"skipped": reason}
    set_backend(block, backend)
    try:
        out = run_hf(block, x)
    except Exception as err:  # a backend may need CUDA, a kernels package or a newer torch: report and go on
        message = str(err).splitlines()[0] if str(err) else ""
        return {"skipped": f"{type(err).__name__}: {message}"[:200]}
    return {"rel_err": rel_err(out, reference)}


def hf_contender(block, x: torch.Tensor, backend: str) -> Contender:
    return Contender(backend, lambda: set_backend(block, backend), lambda: block(x[None]))


# -- one dtype group -------------------------------------------------------------------------------------------


def check_agreement(block, params, layer: Layer, dtype: str, forward) -> dict:
    """HF eager vs moejax on one input before any timing; exits when they disagree."""
    case = Case("decode", 8 if dtype == "float32" else 1, "random", dtype)
    x = make_input(case, layer.cfg.hidden_size, jax.random.key(7))
    reference = np.asarray(forward(params, x, cfg=layer.cfg), np.float32)
    set_backend(block, "eager")
    err = rel_err(run_hf(block, to_torch(x).clone()), reference)
    ok = err < TOLERANCE[dtype]
    print(
        f"check {dtype}: max|HF eager - moejax| / max|moejax| = {err:.2e} at T={case.T} "
        f"(tolerance {TOLERANCE[dtype]:.0e}) {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    if not ok:
        sys.exit("the HF block and moejax disagree: timings would compare different computations")
    return {"dtype": dtype, "T": case.T, "rel_err": err, "ok": ok}


def run_case(case: Case, layer: Layer, params, block, forward, backends: list[str], repeats: int) -> dict:
    """Time moejax and each HF backend that runs on one case; the shares of the ceilings are added at the end."""
    cfg = layer.cfg
    x = make_input(case, cfg.hidden_size, jax.random.fold_in(jax.random.key(1), case.T))
    start = time.perf_counter()
    reference = np.asarray(jax.block_until_ready(forward(params, x, cfg=cfg)), np.float32)
    first = time.perf_counter() - start
    x_torch = to_torch(x).clone()
    hf = {b: try_hf_backend(block, x_torch, b, case, cfg, reference) for b in backends}
    contenders = [Contender("moejax", lambda: None, lambda: forward(params, x, cfg=cfg).block_until_ready())]
    contenders += [hf_contender(block, x_torch, b) for b in backends if "skipped" not in hf[b]]
    with torch.inference_mode():
        samples = interleaved_samples(contenders, repeats, warmup=1)
    for name, seconds in samples.items():
        if name != "moejax":
            hf[name] |= {"ms": float(np.median(seconds)) * 1e3, "min_ms": min(seconds) * 1e3}
    timed = {name: r["ms"] for name, r in hf.items() if "ms" in r}
    best = min(timed, key=timed.get) if timed else None
    seconds = float(np.median(samples["moejax"]))
    row = {
        "case": case.label, "phase": case.phase, "T": case.T, "kind": case.kind, "dtype": case.dtype,
        "hf": hf, "hf_best": best, "hf_best_ms": timed.get(best), "moejax_ms": seconds * 1e3,
        "moejax_min_ms": min(samples["moejax"]) * 1e3, "moejax_first_call_s": first,
    }  # fmt: skip
    row["ratio"] = row["hf_best_ms"] / row["moejax_ms"] if best else None
    return row | rates(case, cfg, params, x, seconds)


def rates(case: Case, cfg: moejax.MoEConfig, params, x: jax.Array, seconds: float) -> dict:
    """Decode: union size, bytes of the union experts and moejax's GB/s; prefill: useful flops and GFLOP/s."""
    itemsize = jnp.dtype(case.dtype).itemsize
    if case.phase == "decode":
        union = union_size(params, x, cfg)
        nbytes = union * expert_bytes(cfg, itemsize) + shared_bytes(cfg, itemsize)
        return {"union": union, "bytes": nbytes, "GBps": nbytes / seconds / 1e9}
    flops = 2 * 3 * cfg.hidden_size * (cfg.intermediate_size * cfg.top_k + cfg.shared_intermediate_size) * case.T
    return {"flops": flops, "GFLOPs": flops / seconds / 1e9}


def add_ceiling_shares(rows: list[dict], ceilings: dict) -> None:
    for row in rows:
        if row["phase"] == "decode":
            row["pct_ceiling"] = 100 * row["GBps"] / ceilings["read_GBps"]
        else:
            row["pct_ceiling"] = 100 * row["GFLOPs"] / ceilings["matmul_GFLOPs"]


def run_dtype(
    layer: Layer, dtype: str, cases: list[Case], backends: list[str], repeats: int, impl: str = "auto"
) -> tuple[dict, list]:
    """Build both copies of the layer in `dtype`, check they agree, run its cases (moejax with `impl`), free both."""
    forward = functools.partial(jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl")), impl=impl)
    params = moejax.init_params(layer.cfg, jax.random.key(0), getattr(jnp, dtype))
    block = build_hf_block(layer, params, dtype)
    check = check_agreement(block, params, layer, dtype, forward)
    rows = []
    for case in cases:
        print(f"  ... {case.label} {dtype}", file=sys.stderr, flush=True)
        rows.append(run_case(case, layer, params, block, forward, backends, repeats))
    del block, params
    gc.collect()
    return check, rows


# -- output ----------------------------------------------------------------------------------------------------


class Table:
    """The table of results, one row per case."""

    def __init__(self, backends: list[str]):
        self.backends = backends
        self.columns = ["case", "dtype", "union", *(f"{b} ms" for b in backends), "HF best ms", "moejax ms"]
        self.columns += ["jit s", "HF/moejax", "moejax rate", "% ceiling"]
        self.widths = [19, 8, 5, *(max(len(b) + 3, 10) for b in backends), 22, 9, 6, 9, 14, 9]
        self.skips: dict[str, set[str]] = {}

    def print(self, rows: list[dict]) -> None:
        self._print(self.columns)
        for row in rows:
            self._print(self._cells(row))
        for backend, reasons in self.skips.items():
            for reason in sorted(reasons):
                print(f"  {backend} skipped: {reason}")
        print("  '!' after a time: that backend's output differs from moejax's by more than the check's tolerance")

    def _print(self, cells: list[str]) -> None:
        pairs = enumerate(zip(cells, self.widths, strict=True))
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs))

    def _backend_cell(self, backend: str, result: dict, dtype: str) -> str:
        if "skipped" in result:
            self.skips.setdefault(backend, set()).add(result["skipped"])
            return "skip"
        return f"{result['ms']:.2f}" + ("!" if result["rel_err"] > TOLERANCE[dtype] else "")

    def _cells(self, r: dict) -> list[str]:
        cells = [r["case"], r["dtype"], str(r.get("union", "-"))]
        cells += [self._backend_cell(b, r["hf"][b], r["dtype"]) for b in self.backends]
        cells.append(f"{r['hf_best_ms']:.2f} ({r['hf_best']})" if r["hf_best"] else "-")
        cells += [f"{r['moejax_ms']:.2f}", f"{r['moejax_first_call_s']:.1f}"]
        cells.append(f"{r['ratio']:.2f}" if r["ratio"] else "-")
        cells.append(f"{r['GBps']:.1f} GB/s" if r["phase"] == "decode" else f"{r['GFLOPs']:.1f} GFLOP/s")
        cells.append(f"{r['pct_ceiling']:.0f}%")
        return cells


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def print_preamble(layer: Layer, backends: list[str], args: argparse.Namespace) -> None:
    cfg = layer.cfg
    shared = f" shared I={cfg.shared_intermediate_size}" if cfg.shared_intermediate_size else ""
    print(
        f"moejax vs Hugging Face transformers {transformers.__version__} {layer.block}: layer {layer.name} "
        f"(H={cfg.hidden_size} E={cfg.num_experts} K={cfg.top_k} I={cfg.intermediate_size}{shared}, "
        f"normalize={cfg.normalize})"
    )
    print(
        f"torch {torch.__version__}, torch.set_num_threads({args.torch_threads}), inference_mode | jax "
        f"{jax.__version__} ({jax.default_backend()}), jit(moe_forward, impl={args.impl!r}) | median of "
        f"{args.repeats} rounds (round-robin) after warm-up | {os.cpu_count()} CPUs, load average "
        f"{load_average():.1f} at start"
    )
    print(f"HF experts backends found: {', '.join(backends)}", flush=True)


def print_summary(ceilings: dict) -> None:
    before, after = ceilings["before"], ceilings["after"]
    n, m = ceilings["gemv_n"], ceilings["matmul_m"]
    print(
        f"ceilings (jax, float32, best of before/after the cases): GEMV read {ceilings['read_GBps']:.1f} GB/s "
        f"([1,{n}]x[{n},{n}], {ceilings['gemv_MB']:.0f} MB; {before['read_GBps']:.1f}/{after['read_GBps']:.1f}), "
        f"matmul {ceilings['matmul_GFLOPs']:.1f} GFLOP/s ({m}^3; "
        f"{before['matmul_GFLOPs']:.1f}/{after['matmul_GFLOPs']:.1f}) | load average {load_average():.1f} at end"
    )
    print(
        "moejax rate: decode GB/s over the union experts' weight bytes (% of GEMV read), prefill GFLOP/s over "
        "2·3·H·I per (token, slot) (% of matmul) | HF/moejax >= 1.0: moejax is faster | jit s: moejax's first call "
        "(compile + run), ~0 when an earlier case compiled the same shape"
    )


# -- main ------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="qwen3-30b-a3b", choices=[n for n in HF_BLOCKS if n in MODEL_LAYERS])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median counts)")
    parser.add_argument("--json", nargs="?", const="", metavar="PATH", help="results file (default: results/)")
    parser.add_argument(
        "--impl", default="auto", choices=moejax.backends.IMPLS, help="moejax's routed-expert backend (auto: the "
        "native CPU kernels when built, else the CPU plans); e.g. --impl cpu for the XLA plans",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke run")
    parser.add_argument(
        "--only", action="append", metavar="TEXT", help='run only the cases whose "label dtype" contains TEXT, e.g. '
        '"T=8 repeated" or "prefill T=512 float32" (repeatable): to rerun a noisy case',
    )  # fmt: skip
    parser.add_argument(
        "--torch-threads", type=int, default=THREADS, help=f"torch.set_num_threads (default {THREADS}, the cores "
        "of the CPU CI machines; on a loaded machine 1 can be much faster)",
    )  # fmt: skip
    return parser.parse_args(argv)


def require_peers() -> None:
    if torch is None or transformers is None:
        sys.exit(
            f"benchmarks/vs_hf.py compares against torch + transformers, which are not installed ({_PEERS_MISSING}).\n"
            'Install them with:  pip install -e ".[peers]"'
        )
    if int(transformers.__version__.split(".")[0]) < 5:
        sys.exit(f'transformers {transformers.__version__} is older than 5: pip install -e ".[peers]"')


def select_cases(args: argparse.Namespace) -> list[Case]:
    cases = make_cases(args.quick)
    return [c for c in cases if not args.only or any(text in f"{c.label} {c.dtype}" for text in args.only)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_peers()
    torch.set_num_threads(args.torch_threads)
    layer = make_layer(args.layer, args.quick)
    backends = hf_backends()
    print_preamble(layer, backends, args)
    before = measure_ceilings(args.quick, args.repeats)
    checks, rows = [], []
    cases = select_cases(args)
    for dtype in dict.fromkeys(c.dtype for c in cases):
        dtype_cases = [c for c in cases if c.dtype == dtype]
        check, dtype_rows = run_dtype(layer, dtype, dtype_cases, backends, args.repeats, args.impl)
        checks.append(check)
        rows += dtype_rows
    ceilings = best_ceilings(before, measure_ceilings(args.quick, args.repeats))
    add_ceiling_shares(rows, ceilings)
    print_summary(ceilings)
    Table(backends).print(rows)
    if args.json is not None:
        write_json(args, layer, ceilings, checks, rows)


def write_json(args, layer: Layer, ceilings, checks, rows) -> None:
    from report import write  # benchmarks/report.py: the results files' one schema

    flat = [{k: v for k, v in r.items() if k != "hf"} | {f"hf_{b}_ms": t["ms"] for b, t in r["hf"].items() if "ms" in t}
            for r in rows]  # fmt: skip
    notes = (
        f"{layer.name} next to transformers {transformers.__version__}'s {layer.block} (torch {torch.__version__}, "
        f"{args.torch_threads} threads), medians of {args.repeats} rounds, moejax impl={args.impl!r}; ceilings in the "
        f"same run: GEMV read {ceilings['read_GBps']:.1f} GB/s, matmul {ceilings['matmul_GFLOPs']:.1f} GFLOP/s; "
        f"outputs checked: " + ", ".join(f"{c['dtype']} {c['rel_err']:.1e}" for c in checks)
    )
    write("vs_hf", flat, args.json or None, notes=notes)


if __name__ == "__main__":
    main()
