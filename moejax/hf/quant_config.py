"""What a quantized checkpoint's config says: its format (`HfQuant`), and which of a block's modules it quantizes.

Read from config.json's `quantization_config` (compressed-tensors, DeepSeek's `fp8`, gpt-oss's `mxfp4`, `modelopt`)
or ModelOpt's `hf_quant_config.json` beside it: the one parser of both. Modules named in the config's ignore list
(`ignore`, `modules_to_not_convert`, `exclude_modules`) are stored dense. Weight-only (docs/FORMATS.md).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from moejax.hf.files import read_json
from moejax.quantized.formats import FP8_BLOCK, QuantizedExperts, quantized_format

Source = Literal["compressed-tensors", "deepseek", "gpt-oss", "modelopt"]
SOURCES = ("compressed-tensors", "deepseek", "gpt-oss", "modelopt")


@dataclasses.dataclass(frozen=True)
class HfQuant:
    """What a checkpoint's quantization config says: the in-memory format and the on-disk flavour."""

    fmt: type[QuantizedExperts]
    source: Source


_KNOWN_METHODS = ("compressed-tensors", "fp8", "mxfp4", "modelopt")


def format_from_config(quantization_config: Mapping[str, Any] | None, hf_quant_config: Mapping | None = None):
    """The format of a checkpoint from config.json's `quantization_config` and/or `hf_quant_config.json`.

    Returns:
      `HfQuant`, or None when neither is given (a dense checkpoint).

    Raises:
      ValueError: unknown `quant_method`, or a scheme this module does not hold (naming the field).
    """
    if quantization_config is None and hf_quant_config is not None:
        algo = (hf_quant_config.get("quantization") or {}).get("quant_algo")
        return _modelopt(algo, (hf_quant_config.get("quantization") or {}).get("group_size", 16))
    if quantization_config is None:
        return None
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt={qc.get('fmt')!r}: only 'e4m3' FP8 is supported")
        block = list(qc.get("weight_block_size") or [])
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise NotImplementedError(f"quantization_config.weight_block_size={block}: only [128, 128] is supported")
        return HfQuant(quantized_format("fp8_block"), "deepseek")
    if method == "mxfp4":
        return HfQuant(quantized_format("mxfp4"), "gpt-oss")
    if method == "modelopt":
        return _modelopt(qc.get("quant_algo"), qc.get("group_size", 16))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization_config.quant_method={method!r} is not one of {_KNOWN_METHODS}")


def _modelopt(algo, group_size) -> HfQuant:
    if algo != "NVFP4":
        raise NotImplementedError(f"ModelOpt quant_algo={algo!r}: only 'NVFP4' is supported")
    if group_size != 16:
        raise ValueError(f"ModelOpt NVFP4 group_size={group_size}, expected 16")
    return HfQuant(quantized_format("nvfp4"), "modelopt")


def _compressed_tensors(qc: Mapping[str, Any]) -> HfQuant:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ValueError(f"quantization_config.config_groups must be an object, got {type(groups).__name__}")
    for name, g in groups.items():
        if not isinstance(g, Mapping):
            raise ValueError(f"quantization_config.config_groups.{name} must be an object, got {type(g).__name__}")
        if g.get("weights") is not None and not isinstance(g["weights"], Mapping):
            raise ValueError(f"quantization_config.config_groups.{name}.weights must be an object")
    schemes = {name: g.get("weights") for name, g in groups.items() if g.get("weights")}
    if not schemes:
        raise ValueError("quantization_config.config_groups: no group quantizes weights")
    found = {}
    for name, w in schemes.items():
        fmt_name = groups[name].get("format") or qc.get("format")
        found[name] = _ct_scheme(w, fmt_name, f"quantization_config.config_groups.{name}")
    distinct = set(found.values())
    if len(distinct) > 1:
        raise NotImplementedError(f"config_groups quantize layers differently ({found}); one scheme is supported")
    return HfQuant(distinct.pop(), "compressed-tensors")


def _ct_scheme(w: Mapping[str, Any], fmt_name: str | None, where: str) -> type[QuantizedExperts]:
    bits, typ, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):  # bool("false") is True: a string would silently drop the zero points
        raise ValueError(f"{where}.weights.symmetric={symmetric!r} must be true or false (a JSON boolean)")
    if fmt_name == "nvfp4-pack-quantized":
        if w.get("group_size", 16) != 16:
            raise ValueError(f"{where}.weights.group_size={w.get('group_size')}: NVFP4 groups are 16")
        return quantized_format("nvfp4")
    if fmt_name == "mxfp4-pack-quantized":
        if w.get("group_size", 32) != 32:
            raise ValueError(f"{where}.weights.group_size={w.get('group_size')}: MXFP4 groups are 32")
        return quantized_format("mxfp4")
    if fmt_name == "float-quantized":
        if typ != "float" or bits != 8 or strategy != "block":
            raise NotImplementedError(f"{where}: float-quantized {typ}{bits} {strategy}: only FP8 'block' is supported")
        if list(w.get("block_structure") or []) != [FP8_BLOCK, FP8_BLOCK]:
            raise NotImplementedError(f"{where}.weights.block_structure={w.get('block_structure')}: only [128, 128]")
        return quantized_format("fp8_block")
    if fmt_name == "pack-quantized":
        if typ != "int" or bits not in (4, 8):
            raise NotImplementedError(f"{where}: pack-quantized {typ}{bits}: int4 and int8 are supported")
        if strategy == "group":
            group = w.get("group_size")
            if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
                raise ValueError(f"{where}.weights.group_size={group!r}: a positive group size is needed")
        elif strategy == "channel":
            group = None
        else:
            raise NotImplementedError(f"{where}.weights.strategy={strategy!r}: 'group' and 'channel' are supported")
        if w.get("actorder") not in (None, False, "weight", "static"):
            raise NotImplementedError(f"{where}.weights.actorder={w.get('actorder')!r}: act-order is not supported")
        return quantized_format("int", bits=bits, group_size=group, symmetric=symmetric)
    raise ValueError(
        f"{where}: compressed-tensors format {fmt_name!r} is not one of 'pack-quantized', 'float-quantized', "
        "'nvfp4-pack-quantized', 'mxfp4-pack-quantized'"
    )


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

    hf: HfQuant
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

    hf: HfQuant
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
      ValueError: an unknown `quant_method` or a scheme moejax does not hold (naming the field).
    """
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), Mapping):
        qc = config["text_config"].get("quantization_config")
    if qc is not None and not isinstance(qc, Mapping):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    if hf_quant_config is not None and not isinstance(hf_quant_config.get("quantization"), Mapping):
        raise ValueError(f"{HF_QUANT_CONFIG} has no 'quantization' object")
    hf = format_from_config(qc, hf_quant_config if qc is None else None)
    if hf is None:
        if hf_quant_config is not None:  # ModelOpt beside a config.json that has none
            hf = format_from_config(None, hf_quant_config)
        else:
            return None
    ignore: list[str] = []
    for where, source in (("quantization_config", qc), (HF_QUANT_CONFIG, (hf_quant_config or {}).get("quantization"))):
        if isinstance(source, Mapping):
            for field in ("ignore", "modules_to_not_convert", "exclude_modules"):
                ignore += _string_list(source.get(field), f"{where}.{field}")
    targets = _ct_targets(qc) if hf.source == "compressed-tensors" else None
    return CheckpointQuant(hf, tuple(dict.fromkeys(ignore)), qc, hf_quant_config, targets)


def from_quantization_config(quantization_config: Mapping[str, Any]) -> HfQuant:
    """`format_from_config` of config.json's `quantization_config`, or of ModelOpt's `{"quantization": ...}`
    (`hf_quant_config.json`) passed in its place."""
    if "quantization" in quantization_config and "quant_method" not in quantization_config:
        return format_from_config(None, quantization_config)
    return format_from_config(quantization_config)


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
