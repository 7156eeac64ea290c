"""The native CPU kernels' sources (csrc/*.cc) compile for the CPUs this host is not, with clang: for aarch64
(the portable variant alone: every x86 part behind MOE_X86) and for x86-64 (clang's target pushes for the AVX2 and
AVX-512 variants, where GCC builds them here). Compile only, warnings as errors, the setup.py flags at -O0: clang's
warnings come from its front end and -O0 still generates code (where the intrinsics' target features are checked),
in a third of -O1's time; the object's ELF machine is checked. clang is zig's (`ziglang` in the test extra: a pip
package with clang and the targets' libc headers, no system toolchain).
By hand: `python -m ziglang c++ -target aarch64-linux-gnu ...`.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tables import FULL

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p.name for p in (ROOT / "csrc").glob("*.cc"))
HEADERS = sorted(p.name for p in (ROOT / "csrc").glob("*.h"))
TARGETS = {"aarch64-linux-gnu": 183, "x86_64-linux-gnu": 62}  # target: ELF e_machine (EM_AARCH64, EM_X86_64)
FLAGS = ["-std=c++17", "-O0", "-g0", "-ffp-contract=off", "-fvisibility=hidden", "-fno-math-errno", "-fPIC"]

needs_zig = pytest.mark.skipif(importlib.util.find_spec("ziglang") is None, reason="needs ziglang (the test extra)")


def test_every_source_is_built_by_setup_py():
    """The glob above is the extension's source list (a new .cc missing from either would go unchecked)."""
    setup = (ROOT / "setup.py").read_text()
    assert SOURCES and all(f'"csrc/{name}"' in setup for name in SOURCES)


# In the suite: the kernels, portable for aarch64 (the code other CPUs run) and the x86 variants for x86_64 (20 s a
# compile). Every source for every target with MOEJAX_TESTS_FULL=1.
SUITE = [("aarch64-linux-gnu", "moe_generic.cc"), ("aarch64-linux-gnu", "backward_cpu.cc")]
SUITE += [("x86_64-linux-gnu", "moe_avx2.cc"), ("x86_64-linux-gnu", "moe_avx512.cc")]
CASES = [(t, s) for t in TARGETS for s in SOURCES] if FULL else SUITE


@needs_zig
@pytest.mark.parametrize(("target", "source"), CASES)
def test_source_compiles_for_target(target, source, tmp_path):
    obj = tmp_path / "out.o"
    cmd = [sys.executable, "-m", "ziglang", "c++", "-target", target, *FLAGS, "-Wall", "-Wextra", "-Werror"]
    cmd += ["-Icsrc", "-isystem", "csrc/third_party", "-I", sysconfig.get_paths()["include"]]
    done = subprocess.run([*cmd, "-c", f"csrc/{source}", "-o", str(obj)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{source} for {target}:\n{done.stderr[-4000:]}"
    header = obj.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == TARGETS[target], source


@needs_zig
@pytest.mark.parametrize(("target", "fused"), [("aarch64-linux-gnu", 1), ("x86_64-linux-gnu", 0)])
def test_the_portable_variant_fuses_multiply_adds_where_the_target_has_them(target, fused, tmp_path):
    """vec_generic.h's vfma is std::fma (one rounding: the AVX2 and AVX-512 variants' bits) on aarch64, a product
    then a sum on x86-64's baseline (csrc/moe_cpu.cc's header says which variants give which bits)."""
    src = tmp_path / "probe.cc"
    src.write_text('#include "vec_generic.h"\nint moe_generic_fused = MOE_GENERIC_FUSED;\n')
    cmd = [sys.executable, "-m", "ziglang", "c++", "-target", target, *FLAGS, "-Icsrc", "-E", str(src)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"int moe_generic_fused = {fused};" in done.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("header", HEADERS)
def test_every_header_compiles_on_its_own(header, tmp_path):
    """A csrc/*.h included first and twice (its guard), nothing else: it includes what it uses and defines its names
    in a namespace of its own, so any file may include it anywhere before its code (the textual per-ISA parts are
    the .inc files). The host's g++, the setup.py flags, warnings as errors."""
    src = tmp_path / "alone.cc"
    src.write_text(f'#include "{header}"\n#include "{header}"\n')
    cmd = ["g++", *FLAGS, "-Wall", "-Wextra", "-Werror", "-Icsrc", "-isystem", "csrc/third_party", "-fsyntax-only"]
    done = subprocess.run([*cmd, str(src)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{header}:\n{done.stderr[-4000:]}"
