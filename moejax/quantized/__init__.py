"""Quantized routed experts: the formats (`formats`), the host quantizer (`quantizer`), qwix interop (`qwix`).

The Hugging Face on-disk codecs of these formats are in `moejax.hf.quant_config` and `moejax.hf.quant_tensors`.
"""

from moejax.quantized.formats import (
    FORMAT_NAMES,
    PROJECTIONS,
    QuantizedExperts,
    Scheme,
    format_by_name,
    quantized_format,
)
from moejax.quantized.quantizer import dequantize, quantize, quantize_experts, quantize_projection
from moejax.quantized.qwix import from_qwix, to_qwix
from moejax.weights import format_of
from pallas_kernels.codecs import E2M1_VALUES, e2m1_to_f32, e8m0_to_f32, pack_nibbles, unpack_nibbles

__all__ = [
    "E2M1_VALUES",
    "FORMAT_NAMES",
    "PROJECTIONS",
    "QuantizedExperts",
    "Scheme",
    "dequantize",
    "e2m1_to_f32",
    "e8m0_to_f32",
    "format_by_name",
    "format_of",
    "from_qwix",
    "pack_nibbles",
    "quantize",
    "quantize_experts",
    "quantize_projection",
    "quantized_format",
    "to_qwix",
    "unpack_nibbles",
]
