"""Quantized checkpoints: which format a checkpoint's config names, and which of a block's modules it quantizes.

A checkpoint says it is quantized in config.json's `quantization_config` (compressed-tensors, DeepSeek's `fp8`,
gpt-oss's `mxfp4`, `modelopt`) or in ModelOpt's `hf_quant_config.json` beside it; `moejax.quantized.
format_from_config` turns that into an `HfQuant` (the in-memory format and the on-disk flavour). Modules named in
the config's ignore list (`ignore`, `modules_to_not_convert`, `exclude_modules`) are stored dense. The router is
always read dense. moejax's shared expert is dense: a quantized one is dequantized at load (float32 scale math,
the format's own) by `dequantize_projection`. Everything is weight-only (`input_scale` tensors are not read).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from moejax import quantized as Q
from moejax.hf.files import read_json

HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's, beside config.json


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization: its format (`HfQuant`), its ignore patterns, and the config dicts it came from.

    Attributes:
      hf: the format and on-disk flavour.
      ignore: module-name patterns stored dense (`re:` regexes as compressed-tensors writes them, `*` wildcards as
        ModelOpt and transformers write them, or plain module names and name prefixes).
      config: config.json's `quantization_config` (None when only `hf_quant_config.json` has it).
      hf_quant_config: ModelOpt's `hf_quant_config.json` (None when absent).
    """

    hf: Q.HfQuant
    ignore: tuple[str, ...] = ()
    config: Mapping[str, Any] | None = None
    hf_quant_config: Mapping[str, Any] | None = None
    targets: tuple[str, ...] | None = None

    def quantizes(self, module: str) -> bool:
        """Whether the full name of a Linear module (`model.layers.3.mlp.experts.0.gate_proj`) is stored
        quantized: targeted (every module when the format has no `targets`) and not ignored."""
        if self.targets is not None and not any(_targets(t, module) for t in self.targets):
            return False
        return not any(_matches(pattern, module) for pattern in self.ignore)


@dataclasses.dataclass(frozen=True)
class BlockQuant:
    """What of one MoE block is quantized: the routed experts and/or the shared expert, in format `hf`."""

    hf: Q.HfQuant
    experts: bool
    shared: bool


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):  # compressed-tensors: re.match on the module name
        return re.match(pattern[3:], module) is not None
    if module == pattern or module.startswith(pattern + "."):
        return True
    return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")


# Class names a compressed-tensors target can give that match a Linear module (its class and base classes).
_LINEAR_CLASSES = ("Linear", "Module")


def _targets(target: str, module: str) -> bool:
    """compressed-tensors' rule for a Linear module: the target is its name, an `re:` regex `re.match`ing it, or
    the name of its class or a base class."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or target in _LINEAR_CLASSES


def _string_list(value: Any, where: str) -> list[str]:
    """A config field that must be a list of module patterns (a bare string would be read one character at a
    time); `re:` patterns must compile."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings, got {value!r:.200}")
    for pattern in value:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise ValueError(f"{where}: {pattern!r} is not a valid regular expression ({e})") from None
    return value


def _ct_targets(qc: Mapping[str, Any]) -> tuple[str, ...]:
    """The targets of every compressed-tensors config group that quantizes weights."""
    targets: list[str] = []
    for name, group in qc["config_groups"].items():
        if group.get("weights"):
            where = f"quantization_config.config_groups.{name}.targets"
            if "targets" not in group:
                raise ValueError(f"{where} is missing: compressed-tensors names the modules each group quantizes")
            targets += _string_list(group["targets"], where)
    return tuple(dict.fromkeys(targets))


def _ignore_field(quant: CheckpointQuant) -> str:
    return {"compressed-tensors": "ignore", "modelopt": "exclude_modules"}.get(
        quant.hf.source, "modules_to_not_convert"
    )


def from_configs(config: Mapping[str, Any], hf_quant_config: Mapping[str, Any] | None) -> CheckpointQuant | None:
    """The checkpoint's quantization from config.json (`config`, its `quantization_config`, also under a multimodal
    `text_config`) and ModelOpt's `hf_quant_config.json`; None for a dense checkpoint.

    Raises:
      ValueError: an unknown `quant_method` or a scheme `moejax.quantized` does not hold (naming the field).
    """
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), Mapping):
        qc = config["text_config"].get("quantization_config")
    if qc is not None and not isinstance(qc, Mapping):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    if hf_quant_config is not None and not isinstance(hf_quant_config.get("quantization"), Mapping):
        raise ValueError(f"{HF_QUANT_CONFIG} has no 'quantization' object")
    hf = Q.format_from_config(qc, hf_quant_config if qc is None else None)
    if hf is None:
        if hf_quant_config is not None:  # ModelOpt beside a config.json that has none
            hf = Q.format_from_config(None, hf_quant_config)
        else:
            return None
    ignore: list[str] = []
    for where, source in (("quantization_config", qc), (HF_QUANT_CONFIG, (hf_quant_config or {}).get("quantization"))):
        if isinstance(source, Mapping):
            for field in ("ignore", "modules_to_not_convert", "exclude_modules"):
                ignore += _string_list(source.get(field), f"{where}.{field}")
    targets = _ct_targets(qc) if hf.source == "compressed-tensors" else None
    return CheckpointQuant(hf, tuple(dict.fromkeys(ignore)), qc, hf_quant_config, targets)


def read(path: str, config: Mapping[str, Any]) -> CheckpointQuant | None:
    """`from_configs` of a checkpoint directory (reads `hf_quant_config.json` when present)."""
    hqc_path = os.path.join(path, HF_QUANT_CONFIG)
    hqc = read_json(hqc_path, "ModelOpt config") if os.path.exists(hqc_path) else None
    return from_configs(config, hqc)


def with_dense_modules(
    quant: CheckpointQuant, config: dict[str, Any], modules: Iterable[str]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, hf_quant_config.json) with `modules` (full names, written dense) added to the ignore list
    where the quantization config would quantize them, so transformers and `load_layer` read them dense."""
    new = [m for m in modules if quant.quantizes(m)]
    if not new:
        return config, dict(quant.hf_quant_config) if quant.hf_quant_config is not None else None
    field = _ignore_field(quant)
    config = json.loads(json.dumps(config))
    hqc = json.loads(json.dumps(quant.hf_quant_config)) if quant.hf_quant_config is not None else None
    holder = config.get("quantization_config")
    if holder is None and isinstance(config.get("text_config"), Mapping):
        holder = config["text_config"].get("quantization_config")
    for target in (holder, (hqc or {}).get("quantization")):
        if isinstance(target, dict):
            target[field] = list(dict.fromkeys([*(target.get(field) or []), *new]))
    return config, hqc


# -- a quantized Linear dequantized on the host ---------------------------------------------------------------


def dequantize_projection(fields: Mapping[str, np.ndarray], scheme: Q.Scheme) -> np.ndarray:
    """One projection's in-memory fields (`moejax.quantized.projection_from_hf`: `q [in(/2), out]`, `scale`,
    `zero`, `scale2`) -> float32 `[in, out]`, by the format's own dequantization (`QuantizedExperts.weight`, the
    math the plans run), on the default device."""
    fmt = Q.quantized_format(scheme.kind, bits=scheme.bits, group_size=scheme.group_size, symmetric=scheme.symmetric)
    one = fmt(**{f"gate_{name}": jnp.asarray(value) for name, value in fields.items()})
    return np.asarray(one.weight("gate"))
