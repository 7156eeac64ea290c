"""The native kernels' phase 0 (routing: each union expert's distinct rows) and call buffers, on CPU.

Cases (the min of --rounds timed calls of one jitted `native.routed_experts`, float32 [in, out] experts):
  skewed prefill   T=32768 distinct rows, every row's K=4 slots on the same 4 of E=16 experts, H=512, I=64
  one expert       T=70000 distinct rows, E=1, K=1, H=256, I=32
  identical decode T copies of one row (parallel sampling's first step): H=2048, E=128, K=8, I=768 (Qwen3-30B-A3B,
                   bfloat16 weights) for T=1, 8 and 16, and H=512, E=16, K=4, I=256 for T=8
  decode loop      the mean of 200 calls T=1 of the Qwen3-like layer (min of 3 loops), right after a T=32768 call
                   (K=8 of E=16, H=512, I=64: ~600 MB of call buffers): what the call-buffer pool costs or saves
Each case's seconds go under `<label>_s` of its entry in --json (merged into an existing file, so a "before" and
an "after" build fill one file), with the process's resident memory and the pool's retained bytes after the
T=32768 call.

    python benchmarks/native_routing.py --label after --json benchmarks/results/native_routing_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.backends import native
from moejax.slots import Slots
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation

ACT = GatedActivation("silu")


def experts(E: int, H: int, I: int, dtype="float32", seed=0) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    n = lambda shape, fan: jnp.asarray((rng.standard_normal(shape) / np.sqrt(fan)).astype(np.float32)).astype(dtype)
    return ExpertWeights(n((E, H, I), H), n((E, H, I), H), n((E, I, H), I))


def skewed_slots(T: int, K: int, ids: list[int], seed=1) -> Slots:
    """Every row on the experts `ids` (K of them, a random order per row)."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(ids)[:K] for _ in range(min(T, 64))])
    idx = np.resize(idx, (T, K)).astype(np.int32)
    return Slots(jnp.asarray(idx), jnp.asarray(rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)))


def random_slots(T: int, K: int, E: int, seed=2) -> Slots:
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    return Slots(jnp.asarray(idx), jnp.asarray(rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)))


def tiled(slots: Slots, T: int) -> Slots:
    """T copies of the first row's slots."""
    return Slots(jnp.tile(slots.indices[:1], (T, 1)), jnp.tile(slots.out_weight[:1], (T, 1)))


def rows(T: int, H: int, seed=3) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, H)).astype(np.float32))


def best_of(fn, rounds: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def call(w, x, slots):
    run = jax.jit(lambda x, s: native.routed_experts(w, x, s, ACT))
    return lambda: run(x, slots)


def cpu_name() -> str:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def resident_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def retained_mb() -> float | None:
    get = getattr(native, "retained_buffer_bytes", None)
    return None if get is None else round(get() / 2**20, 2)


def cases():
    w = experts(16, 512, 64)
    x, slots = rows(32768, 512), skewed_slots(32768, 4, [3, 7, 11, 12])
    yield "skewed prefill T=32768 (4 of E=16, K=4, H=512, I=64)", call(w, x, slots)
    w = experts(1, 256, 32)
    yield "one expert T=70000 (E=1, K=1, H=256, I=32)", call(w, rows(70000, 256), skewed_slots(70000, 1, [0]))
    small, first = experts(16, 512, 256), random_slots(1, 4, 16)
    yield "identical decode T=8 (E=16, K=4, H=512, I=256)", call(small, jnp.tile(rows(1, 512), (8, 1)), tiled(first, 8))
    big = experts(128, 2048, 768, "bfloat16")
    one = rows(1, 2048)
    first = random_slots(1, 8, 128)
    for T in (1, 8, 16):
        name = f"identical decode T={T} (Qwen3-30B-A3B-like: E=128, K=8, H=2048, I=768, bfloat16)"
        yield name, call(big, jnp.tile(one, (T, 1)), tiled(first, T))
    yield "distinct decode T=16 (Qwen3-30B-A3B-like, bfloat16)", call(big, rows(16, 2048), random_slots(16, 8, 128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the key prefix of this run's numbers: before, after, ...")
    parser.add_argument("--json", type=pathlib.Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = parser.parse_args()
    if not native.available():
        sys.exit("the native extension is not built (python setup.py build_ext --inplace)")
    data = json.loads(args.json.read_text()) if args.json.exists() else None
    if data is None:
        data = {
            "benchmark": "native_routing",
            "machine": {"cpu": cpu_name(), "isa": native.isa(), "cores": os.cpu_count()},
            "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join(sys.argv),
            "results": [],
        }
    entries = {r["case"]: r for r in data["results"]}
    measured = []
    for name, fn in cases():
        if args.only not in name:
            continue
        seconds = best_of(fn, args.rounds)
        print(f"{name}: {seconds:.4f} s", flush=True)
        measured.append((name, {f"{args.label}_s": round(seconds, 5)}))
    if not args.only or "decode loop" in args.only:
        measured.append(("decode loop after a T=32768 call", decode_after_prefill(args.label)))
    for name, numbers in measured:
        entries.setdefault(name, {"case": name}).update(numbers)
    data["results"] = list(entries.values())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")


def decode_after_prefill(label: str) -> dict:
    """A T=32768 call (K=8 of E=16, H=512, I=64: ~600 MB of call buffers), then 200 decode calls of the Qwen3-like
    layer: their mean time, the resident memory and the pool's retained bytes after the big call."""
    w = experts(16, 512, 64)
    jax.block_until_ready(call(w, rows(32768, 512), random_slots(32768, 8, 16))())
    after_big = {f"{label}_resident_mb": round(resident_mb()), f"{label}_retained_mb": retained_mb()}
    big = experts(128, 2048, 768, "bfloat16")
    fn = call(big, rows(1, 2048), random_slots(1, 8, 128))
    jax.block_until_ready(fn())
    means = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(200):
            out = fn()
        jax.block_until_ready(out)
        means.append((time.perf_counter() - start) / 200)
    print(f"decode loop: {min(means) * 1e3:.3f} ms/call, after the big call {after_big}", flush=True)
    return {f"{label}_decode_ms": round(min(means) * 1e3, 4), **after_big}


if __name__ == "__main__":
    main()
