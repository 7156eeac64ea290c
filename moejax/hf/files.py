"""Safetensors checkpoints read lazily: which file holds which key, and only the tensors asked for.

A checkpoint is one `.safetensors` file, several, or a directory with `model.safetensors.index.json` (the map
from key to shard written by transformers). Keys are found from the index or from each file's JSON header (the
first bytes of the file), so nothing but the requested tensors is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
# safetensors dtype names -> numpy (little endian, as the format stores them); ml_dtypes for bfloat16 / float8.
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def header(path: str) -> tuple[int, dict[str, Any]]:
    """(offset of the data, the JSON header) of a safetensors file: 8-byte little-endian size, header, data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def read_file(path: str, keys: Iterable[str]) -> dict[str, np.ndarray]:
    """The tensors `keys` of one safetensors file, each read from its byte range alone."""
    data_start, head = header(path)
    tensors = {}
    with open(path, "rb") as raw:
        for key in keys:
            if key not in head:
                raise ValueError(f"{path} has no tensor {key!r}")
            info = head[key]
            if info["dtype"] not in _DTYPES:
                known = list(_DTYPES)
                raise NotImplementedError(f"{path}: tensor {key!r} has dtype {info['dtype']}, not one of {known}")
            start, end = info["data_offsets"]
            raw.seek(data_start + start)
            data = np.frombuffer(raw.read(end - start), _DTYPES[info["dtype"]])
            tensors[key] = data.reshape(info["shape"])
    return tensors


def weight_map_of_files(paths: Iterable[str]) -> dict[str, str]:
    """{key: file} from the headers of `paths`; a key in two files is an error."""
    weight_map: dict[str, str] = {}
    for path in paths:
        for key in header(path)[1]:
            if key == "__metadata__":
                continue
            if key in weight_map:
                raise ValueError(f"tensor {key!r} is in both {weight_map[key]} and {path}")
            weight_map[key] = path
    return weight_map


def weight_map_of_index(index: str) -> dict[str, str]:
    """{key: file path} from a `model.safetensors.index.json` (files relative to its folder)."""
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    folder = os.path.dirname(index)
    return {key: os.path.join(folder, file) for key, file in weight_map.items()}


def weight_map(files: str | os.PathLike | Iterable[str | os.PathLike]) -> dict[str, str]:
    """{key: file} of one file, a list of files, an index json, or a directory (its index, else its files)."""
    if not isinstance(files, str | os.PathLike):
        return weight_map_of_files([os.fspath(f) for f in files])
    path = os.fspath(files)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            return weight_map_of_index(index)
        paths = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not paths:
            raise ValueError(f"{path} holds neither {INDEX} nor .safetensors files")
        return weight_map_of_files(paths)
    if path.endswith(".json"):
        return weight_map_of_index(path)
    return weight_map_of_files([path])


def by_file(weight_map: Mapping[str, str], keys: Iterable[str]) -> dict[str, list[str]]:
    """`keys` grouped by the file holding them, files in the order first needed."""
    grouped: dict[str, list[str]] = {}
    for key in keys:
        grouped.setdefault(weight_map[key], []).append(key)
    return grouped


def check_files_exist(grouped: Mapping[str, list[str]], what: str) -> None:
    """ValueError naming a shard the index points to that is not on disk, and the keys it should hold."""
    for path, keys in grouped.items():
        if not os.path.exists(path):
            more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
            raise ValueError(
                f"{what}: the index maps {keys[0]!r}{more} to {os.path.basename(path)}, which is missing from "
                f"{os.path.dirname(path) or '.'}"
            )
