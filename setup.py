"""Builds moejax's optional native CPU kernels (csrc/, an XLA FFI handler in a plain CPython extension).

The extension is optional: without a C++ compiler, or with MOEJAX_NATIVE_BUILD=0 at build time, the package
installs without it and `impl="auto"` runs the XLA plans. Baseline flags only (never -march=native): the AVX2 and
AVX-512 variants are compiled with `#pragma GCC target` and chosen at load (csrc/cpu_features.h).
MOEJAX_NATIVE_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer (tests only: run Python with
LD_PRELOAD of libasan).
"""

import glob
import os
import platform
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """build_ext compiling an extension's sources side by side, one per core (setuptools compiles them one after
    the other): the kernel variants (moe_generic.cc, moe_avx2.cc, moe_avx512.cc) are most of it."""

    def build_extension(self, ext):
        original = self.compiler.compile

        def compile_each(sources, *args, **kwargs):
            with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                objects = pool.map(lambda source: original([source], *args, **kwargs), sources)
                return [obj for per_source in objects for obj in per_source]

        self.compiler.compile = compile_each
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = original


def _native_extensions() -> list[Extension]:
    if os.environ.get("MOEJAX_NATIVE_BUILD", "1") == "0" or platform.system() == "Windows":
        return []
    compile_args = [
        "-std=c++17",
        "-isystem",
        "csrc/third_party",
        "-O3",
        "-g0",  # no debug info (Python's default flags add -g): a 5x smaller library
        "-ffp-contract=off",
        "-fvisibility=hidden",
        "-fno-math-errno",
    ]
    link_args: list[str] = []
    if os.environ.get("MOEJAX_NATIVE_SANITIZE") == "1":
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
        compile_args = [*(a for a in compile_args if a not in ("-O3", "-g0")), "-O1", "-g", *sanitize]
        link_args = sanitize
    return [
        Extension(
            "moejax._native_cpu",
            sources=[
                "csrc/moe_cpu.cc",
                "csrc/cpu_features.cc",
                "csrc/moe_generic.cc",
                "csrc/moe_avx2.cc",
                "csrc/moe_avx512.cc",
                "csrc/linear_cpu.cc",
                "csrc/scores_cpu.cc",
                "csrc/backward_cpu.cc",
            ],
            include_dirs=["csrc"],
            depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/*.inc")),  # a header edit rebuilds it
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            language="c++",
            optional=True,  # a failed compile leaves the package installable (auto runs the XLA plans)
        )
    ]


setup(ext_modules=_native_extensions(), cmdclass={"build_ext": ParallelBuildExt})
