"""XLA:CPU compile pipelines for the tests.

The suite compiles with XLA:CPU's cheap pipeline (conftest.py: `--xla_backend_optimization_level=0`, no expensive
LLVM passes, the elemental emitters instead of the fusion emitters), which vectorizes nothing. Tests whose claim is
about bits across batches (batch invariance) compile with `DEFAULT_PIPELINE`, what users get: at the default
pipeline XLA's exp differs between a loop's vector body and its scalar tail (docs/DESIGN.md, "Batch invariance"),
which the cheap pipeline would hide.
"""

DEFAULT_PIPELINE = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
    "xla_cpu_use_fusion_emitters": True,
}
