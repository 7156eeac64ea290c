"""Kernels for the MoE hot loops, each beside a plain-jnp reference with the same signature.

* `moe_decode` (gpu_decode.py): union-of-experts decode, T <= 8 rows, every selected expert's weights read once.
* `moe_grouped` (gpu_grouped.py): grouped prefill over pairs sorted by expert in block-aligned 64-row tiles.
* `moe_tpu_decode` (tpu_decode.py), `moe_tpu_grouped` (tpu_grouped.py, on jax's megablox `gmm`): the same two ops
  on Mosaic TPU, which `moe_decode` / `moe_grouped` lower to in programs built for TPU.
* `moe_grouped_vjp` (grouped_backward.py): the routed experts' gradients on grouped kernels (gpu_backward.py's
  transposed grouped matmul and tgmm; on TPU `moe_tpu_grouped_vjp`, megablox's: tpu_backward.py).

The four share one signature, checks and reference (moe_op.py). The Mosaic GPU ops run the two tile kernels of
gpu_tiles.py (bodies: gpu_tile_kernels.py dense, gpu_quant_tiles.py for `QuantizedWeight`s, quantized_weights.py,
whose codes codecs.py decodes for moejax's formats too). With `interpret=None` (the default) a kernel is compiled
where the program is lowered for CUDA and interpreted where it is lowered for CPU (platform.py). Nothing here
imports moejax. `validated.json` lists the kernels that benchmarks/gpu_bench.py and tpu_bench.py checked against
their references on a real device; `is_validated` reads it (moejax's `impl="auto"` picks only those).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pallas_kernels.activations import GatedActivation
from pallas_kernels.gpu_decode import DecodeBlockSizes, moe_decode, moe_decode_reference
from pallas_kernels.gpu_grouped import GroupedBlockSizes, moe_grouped, moe_grouped_reference
from pallas_kernels.gpu_tiles import TileBlockSizes
from pallas_kernels.grouped_backward import MoEGrads, moe_grouped_vjp, moe_grouped_vjp_reference, moe_tpu_grouped_vjp
from pallas_kernels.platform import register_tpu_variant
from pallas_kernels.quantized_weights import QuantizedWeight, dequantize_weight
from pallas_kernels.tpu_decode import TpuDecodeBlockSizes, moe_tpu_decode, moe_tpu_decode_reference
from pallas_kernels.tpu_grouped import TpuGroupedBlockSizes, moe_tpu_grouped, moe_tpu_grouped_reference

# Programs lowered for TPU run the Mosaic TPU kernels in place of the Mosaic GPU ones (platform.py).
register_tpu_variant(moe_decode, moe_tpu_decode)
register_tpu_variant(moe_grouped, moe_tpu_grouped)

KERNELS = ("moe_decode", "moe_grouped")
BACKWARD_KERNELS = ("moe_grouped_vjp",)  # checked on a device apart: validated.json rows of their own
VALIDATED_PATH = Path(__file__).with_name("validated.json")


@functools.cache
def validated_records(path: Path = VALIDATED_PATH) -> tuple[dict, ...]:
    """The rows of validated.json: `{"kernel", "device_kind", "jax_version", "date", "max_abs_error", ...}`."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected a JSON list of objects")
    return tuple(rows)


def is_validated(
    kernel_name: str, device_kind: str | None, jax_version: str, path: Path = VALIDATED_PATH, *, weights: str = "dense"
) -> bool:
    """Whether `kernel_name` was checked against its reference on `device_kind` (e.g. "NVIDIA H200") with
    exactly this JAX version: a new JAX (a new Mosaic GPU compiler) or a new GPU needs a new check. `weights`: the
    weight format of the check, a row's `"weights"` field ("dense" when absent; quantized formats by name, e.g.
    "int8_g128_sym", "fp8_block": each quantized kernel body needs its own check). `device_kind=None`: on any
    device kind (TPU rows name theirs as JAX does, e.g. "TPU v5 lite")."""
    if kernel_name not in KERNELS + BACKWARD_KERNELS:
        raise ValueError(f"kernel_name={kernel_name!r} is not one of {KERNELS + BACKWARD_KERNELS}")
    return any(
        r.get("kernel") == kernel_name
        and (device_kind is None or r.get("device_kind") == device_kind)
        and r.get("jax_version") == jax_version
        and r.get("weights", "dense") == weights
        for r in validated_records(Path(path))
    )


__all__ = [
    "BACKWARD_KERNELS",
    "KERNELS",
    "VALIDATED_PATH",
    "DecodeBlockSizes",
    "GatedActivation",
    "GroupedBlockSizes",
    "MoEGrads",
    "QuantizedWeight",
    "TileBlockSizes",
    "TpuDecodeBlockSizes",
    "TpuGroupedBlockSizes",
    "dequantize_weight",
    "is_validated",
    "moe_decode",
    "moe_decode_reference",
    "moe_grouped",
    "moe_grouped_reference",
    "moe_grouped_vjp",
    "moe_grouped_vjp_reference",
    "moe_tpu_decode",
    "moe_tpu_decode_reference",
    "moe_tpu_grouped",
    "moe_tpu_grouped_reference",
    "moe_tpu_grouped_vjp",
    "validated_records",
]
