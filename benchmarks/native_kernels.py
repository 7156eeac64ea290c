"""Kernel-only timing of the native routed-expert kernels (benchmarks/native_kernels.cc): no XLA, no router.

    python benchmarks/native_kernels.py [--csrc csrc [--csrc /tmp/old/csrc ...]] [--formats int8 int4 ...]
        [--threads 1 2] [--rounds 6] [--reps 5] [-E 48] [-T 1] [--group 128] [--cpu-time] [--phases 7] [--read]
        [--isa avx2 avx512] [--prefetch-f32 auto|on|off] [--json [PATH]]

Compiles the harness once per csrc tree (g++, the package's flags; libraries cached under /tmp/moejax_kernels),
builds one model per format (Qwen3-30B-A3B's experts: H=2048, I=768, E=48 by default: more bytes than the L3, so
the weights come from memory; int8 / int4 groups of --group inputs, default 128, symmetric; a format's _a8 name:
the same weights with int8 activations, csrc/act8.h, in groups of the weight's group), then times calls of
T rows (default decode, T=1; each row K=8 distinct random experts, a new x and new experts per call; -T 128 -E 32:
about 32 rows per expert, prefill's many-row kernels) in interleaved rounds: per round every (format, threads, tree)
runs --reps calls; the minimum over all is printed with its GMAC/s and GB/s per thread and its ratio to
float32 (the fused [out, in] layout) of the same tree and thread count. --cpu-time (or --cpu): CPU time instead
of the wall clock (one thread: the thread's clock, far less sensitive to other load on the machine; more threads:
the process's). --read: the read ceiling (GB/s of a 4-accumulator float32 sum of float32 T=1's 151 MB, a fresh
region per rep); each format's GB/s is then also given as a fraction of it (`of_read`). --json: a results file
(native_kernels_decode at T=1, else native_kernels_prefill; the default path in benchmarks/results/).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import pathlib
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

HARNESS = ROOT / "benchmarks" / "native_kernels.cc"
FORMATS = {"float32": 3, "bf16": 4, "int8": 6, "int4": 7, "fp8": 8, "mxfp4": 9, "nvfp4": 10, "f32_inout": 0}
# int8 activations (csrc/act8.h) of a weight format: name -> (weight format, None: the int group, else the group)
ACT8 = {"int8_a8": ("int8", None), "int4_a8": ("int4", None), "mxfp4_a8": ("mxfp4", 32), "nvfp4_a8": ("nvfp4", 16)}
K = 8
ISAS = {"generic": 0, "avx2": 1, "avx512": 2}  # a tree without the AVX-512 variant runs its AVX2 one for avx512


def best_isa() -> str:
    """The widest variant this CPU runs (the flags csrc/cpu_features.cc checks)."""
    flags = set(pathlib.Path("/proc/cpuinfo").read_text().split()) if pathlib.Path("/proc/cpuinfo").exists() else set()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "generic"


def build(csrc: pathlib.Path) -> ctypes.CDLL:
    """The harness compiled against the csrc tree `csrc` (cached by the sources' contents)."""
    sources = [HARNESS, *sorted(csrc.glob("*.cc")), *sorted(csrc.glob("*.h")), *sorted(csrc.glob("*.inc"))]
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    out = pathlib.Path("/tmp/moejax_kernels") / f"{digest}.so"
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        include = sysconfig.get_paths()["include"]
        cmd = ["g++", "-shared", "-fPIC", "-std=c++17", "-O3", "-g0", "-ffp-contract=off", "-fno-math-errno"]
        cmd += ["-isystem", str(ROOT / "csrc/third_party"), f"-I{csrc}", f"-I{include}", "-o", str(out)]
        cmd += [str(HARNESS), str(csrc / "linear_cpu.cc"), str(csrc / "scores_cpu.cc")]
        # newer trees: the variants in translation units of their own, the CPU probe in one, the backward (its
        # FFI handlers are in moe_cpu.cc's registration table)
        variants = ("moe_generic.cc", "moe_avx2.cc", "moe_avx512.cc", "cpu_features.cc", "backward_cpu.cc")
        cmd += [str(csrc / f) for f in variants if (csrc / f).exists()]
        subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.kb_make.restype = ctypes.c_void_p
    lib.kb_make.argtypes = [ctypes.c_int] * 5
    lib.kb_free.argtypes = [ctypes.c_void_p]
    lib.kb_expert_bytes.restype = ctypes.c_double
    lib.kb_expert_bytes.argtypes = [ctypes.c_void_p]
    lib.kb_run.restype = ctypes.c_double
    lib.kb_run.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 7 + [ctypes.POINTER(ctypes.c_double)]
    lib.kb_set_cpu_clock.argtypes = [ctypes.c_int]
    lib.kb_set_prefetch_f32.argtypes = [ctypes.c_int]
    lib.kb_set_act8.argtypes = [ctypes.c_int]
    lib.kb_read.restype = ctypes.c_double
    lib.kb_read.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csrc", action="append", help="csrc trees to compare (default: this checkout's)")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS)[:7], choices=[*FORMATS, *ACT8])
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5, help="calls per (round, case)")
    parser.add_argument("-E", type=int, default=48, help="experts in the model (K=8 chosen per call)")
    parser.add_argument("-H", type=int, default=2048, help="hidden size")
    parser.add_argument("-I", type=int, default=768, help="intermediate size (-I 128 -E 8: the weights fit the L3)")
    parser.add_argument("-T", type=int, default=1, help="rows per call (K distinct experts each)")
    parser.add_argument("--group", type=int, default=128, help="int8 / int4 group size (inputs per scale)")
    parser.add_argument("--cpu-time", "--cpu", action="store_true", help="time CPU time, not the wall clock")
    parser.add_argument("--phases", type=int, default=7, help="bit 0 gate/up, bit 1 down, bit 2 combine")
    parser.add_argument("--read", action="store_true", help="also time the read ceiling")
    parser.add_argument("--isa", nargs="+", default=[best_isa()], choices=list(ISAS), help="kernel variants")
    parser.add_argument(
        "--prefetch-f32", default="auto", choices=["auto", "on", "off"], help="float32 software prefetch (moe_job.h)"
    )
    parser.add_argument("--json", nargs="?", const="", default=None, help="write a results file")
    parser.add_argument("--note", default="", help="a sentence added to the results file's notes")
    args = parser.parse_args()
    H, I = args.H, args.I
    trees = [pathlib.Path(c).resolve() for c in (args.csrc or [str(ROOT / "csrc")])]
    libs = {str(t): build(t) for t in trees}
    for lib in libs.values():
        lib.kb_set_cpu_clock(int(args.cpu_time))
        lib.kb_set_prefetch_f32({"auto": -1, "on": 1, "off": 0}[args.prefetch_f32])
    first = next(iter(libs.values()))  # the Model type is the harness's own: one set of models serves every tree
    codes = {f: FORMATS[ACT8[f][0] if f in ACT8 else f] for f in args.formats}
    act_group = {f: (ACT8[f][1] or args.group) if f in ACT8 else 0 for f in args.formats}
    models = {f: first.kb_make(codes[f], H, I, args.E, args.group) for f in args.formats}
    variants = {f"{isa} {tree}": (lib, ISAS[isa]) for tree, lib in libs.items() for isa in args.isa}
    best: dict[tuple[str, int, str], float] = {}
    for _ in range(args.rounds):
        for f in args.formats:
            for th in args.threads:
                for name, (lib, isa) in variants.items():
                    mn = ctypes.c_double()
                    lib.kb_set_act8(act_group[f])
                    lib.kb_run(models[f], args.T, K, th, args.reps, args.phases, isa, 0, ctypes.byref(mn))
                    key = (f, th, name)
                    best[key] = min(best.get(key, 1e9), mn.value)
    macs = args.T * K * 3 * H * I
    shape = f"T={args.T}, K={K} of E={args.E}, H={H}, I={I}, int group {args.group}"
    print(f"{shape}; min over {args.rounds} x {args.reps} calls, phases {args.phases}")
    print(f"{'format':10s} thr {'ms':>7s} {'GMAC/s/thr':>10s} {'GB/s/thr':>9s} {'/f32':>5s}  isa tree")
    rows = []
    for f in args.formats:
        nbytes = min(args.T * K, args.E) * first.kb_expert_bytes(models[f])  # about: each union expert once
        for th in args.threads:
            for name in variants:
                s = best[f, th, name]
                ref = best.get(("float32", th, name))
                ratio = f"{s / ref:5.2f}" if ref else "    -"
                rates = f"{macs / s / th / 1e9:10.2f} {nbytes / s / th / 1e9:9.2f}"
                print(f"{f:10s} {th:3d} {s * 1e3:7.2f} {rates} {ratio}  {name}")
                isa, tree = name.split(" ", 1)
                rows.append({"format": f, "threads": th})
                rows[-1] |= ({"isa": isa} if len(args.isa) > 1 else {}) | ({"tree": tree} if len(trees) > 1 else {})
                rows[-1] |= {"ms": round(s * 1e3, 3), "GMAC/s/thread": round(macs / s / th / 1e9, 2)}
                rows[-1] |= {"GB/s/thread": round(nbytes / s / th / 1e9, 2), "of_f32": ref and round(s / ref, 2)}
    for m in models.values():
        first.kb_free(m)
    ceiling = {}
    if args.read:
        nbytes = K * 3 * H * I * 4  # the float32 call's weight bytes (151 MB), a fresh region of 604 MB per rep
        for th in args.threads:
            ceiling[th] = nbytes / first.kb_read(nbytes, 4 * nbytes, th, 12) / th  # per thread
            total, per = ceiling[th] * th / 1e9, ceiling[th] / 1e9
            print(f"read ceiling, {th} thread(s): {total:.2f} GB/s ({per:.2f} per thread)")
        for row in rows:
            row["of_read"] = round(row["GB/s/thread"] * 1e9 / ceiling[row["threads"]], 2)
    if args.json is not None:
        timed = "CPU time" if args.cpu_time else "wall-clock"
        read = "".join(f" Read ceiling on {th} thread(s): {c * th / 1e9:.2f} GB/s." for th, c in ceiling.items())
        notes = (
            f"Kernels alone (no XLA), {shape}, phases {args.phases}; min {timed} ms over {args.rounds} x {args.reps} "
            "calls; GB/s per thread over the bytes each format stores (each union expert once); of_f32: the time over "
            "float32's (fused [out, in]); of_read: GB/s over the read ceiling measured in the same run."
            + read
            + (f" {args.note}" if args.note else "")
        )
        benchmark = "native_kernels_decode" if args.T == 1 else "native_kernels_prefill"
        report.write(benchmark, rows, args.json or None, notes=notes)


if __name__ == "__main__":
    main()
