"""Safetensors checkpoints read lazily: which file holds which key, and only the tensors asked for.

A checkpoint is one `.safetensors` file, several, or a directory with `model.safetensors.index.json` (the map
from key to shard written by transformers). Keys are found from the index or from each file's JSON header (the
first bytes of the file), so nothing but the requested tensors is read.

Files are read as hostile input. A header is checked as the safetensors library checks it before any tensor is
read (length at most 100 MB, a UTF-8 JSON object, a known dtype per tensor, byte ranges that match shape x dtype
and tile the data area from its first byte to the end of the file, in order, without overlap); index entries must
name files inside the checkpoint directory. Every violation is a `ValueError` naming the file (and the key).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # bytes; the safetensors library refuses longer headers (HeaderTooLarge)
# safetensors dtype names -> numpy (little endian, as the format stores them); ml_dtypes for bfloat16 / float8.
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "C64": np.dtype("<c8"),
}
# Bits per element of every dtype the safetensors format defines (the sub-byte ones have no numpy dtype here).
_BITS = {name: 8 * dtype.itemsize for name, dtype in _DTYPES.items()} | {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def read_json(path: str, what: str = "JSON file") -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming the file when it is not UTF-8, not JSON, or not an object."""
    with open(path, "rb") as f:
        raw = f.read()
    return _json_object(raw, f"{what} {path}")


def _json_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: hostile nesting depth
        raise ValueError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} holds a JSON {type(value).__name__}, expected an object")
    return value


def header(path: str) -> tuple[int, dict[str, Any]]:
    """(offset of the data, the JSON header) of a safetensors file: 8-byte little-endian size, header, data.

    The header is validated (`_check_header`) before it is returned, so every entry's byte range lies in the
    file and holds exactly its tensor.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is truncated: {file_size} bytes, shorter than the 8-byte header length")
        size = int.from_bytes(prefix, "little")
        if size > MAX_HEADER:
            raise ValueError(
                f"{path}: header length {size} exceeds the safetensors limit of {MAX_HEADER} bytes "
                "(not a safetensors file, or a corrupt one)"
            )
        if 8 + size > file_size:
            raise ValueError(f"{path} is truncated: its header needs {8 + size} bytes, the file has {file_size}")
        raw = f.read(size)
    head = _json_object(raw, f"the safetensors header of {path}")
    _check_header(path, head, file_size - 8 - size)
    return 8 + size, head


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(path: str, key: str, info: Any, data_size: int) -> tuple[int, int]:
    """The (begin, end) of one tensor's entry, checked: known dtype, shape and offsets of counts, begin <= end
    <= the data area's size, and `end - begin` = the bytes of shape x dtype."""
    where = f"{path}: tensor {key!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: header entry is a {type(info).__name__}, expected an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _BITS:
        raise ValueError(f"{where}: unknown dtype {dtype!r}, not one of {sorted(_BITS)}")
    if not isinstance(shape, list) or not all(map(_is_count, shape)):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise ValueError(f"{where}: data_offsets {offsets} begin after they end")
    if end > data_size:
        raise ValueError(
            f"{path} is truncated or corrupt: tensor {key!r} ends at byte {end} of the data area, which holds "
            f"{data_size} bytes"
        )
    bits = math.prod(shape) * _BITS[dtype]
    if bits % 8 or end - begin != bits // 8:
        raise ValueError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, shape {shape} of {dtype} needs {bits / 8:g}"
        )
    return begin, end


def _check_header(path: str, head: dict[str, Any], data_size: int) -> None:
    """The safetensors library's rules: every entry valid (`_check_entry`); sorted by offset, the byte ranges
    follow each other from 0 to the end of the file with no gap and no overlap (so no tensor reads another's
    bytes); `__metadata__` maps strings to strings."""
    ranges = []
    for key, info in head.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError(f"{path}: __metadata__ must map strings to strings, got {info!r:.200}")
            continue
        ranges.append((*_check_entry(path, key, info, data_size), key))
    position = 0
    for begin, end, key in sorted(ranges):
        if begin != position:
            problem = "overlaps the bytes of the tensor before it" if begin < position else "leaves a gap before it"
            raise ValueError(
                f"{path}: tensor {key!r} starts at byte {begin} of the data area, expected {position}: it {problem} "
                "(invalid offsets; the safetensors library refuses this file)"
            )
        position = end
    if position != data_size:
        raise ValueError(
            f"{path}: the data area has {data_size - position} bytes after its last tensor (invalid offsets; the "
            "safetensors library refuses this file)"
        )


def read_file(path: str, keys: Iterable[str]) -> dict[str, np.ndarray]:
    """The tensors `keys` of one safetensors file, each read from its byte range alone."""
    data_start, head = header(path)
    tensors = {}
    with open(path, "rb") as raw:
        for key in keys:
            if key not in head or key == "__metadata__":
                raise ValueError(f"{path} has no tensor {key!r}")
            info = head[key]
            if info["dtype"] not in _DTYPES:
                known = list(_DTYPES)
                raise NotImplementedError(f"{path}: tensor {key!r} has dtype {info['dtype']}, not one of {known}")
            start, end = info["data_offsets"]
            raw.seek(data_start + start)
            data = raw.read(end - start)
            if len(data) != end - start:  # the file shrank after its header was read
                raise ValueError(f"{path} is truncated: tensor {key!r} has {len(data)} of its {end - start} bytes")
            tensors[key] = np.frombuffer(data, _DTYPES[info["dtype"]]).reshape(info["shape"])
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


def shard_path(folder: str, file: Any, index: str, key: str) -> str:
    """`folder/file` for an index entry `key -> file`; ValueError naming the index and the entry when `file` is
    not a relative name that stays inside `folder` (no absolute path, no `..` out of it, no directory symlink
    leading out). Shards themselves may be symlinks (a Hugging Face cache snapshot links them to its blobs)."""
    if not isinstance(file, str) or not file or "\x00" in file:
        raise ValueError(f"{index}: entry {key!r} maps to {file!r}, not a file name")
    normal = os.path.normpath(file)
    if os.path.isabs(file) or normal == ".." or normal.startswith(".." + os.sep):
        raise ValueError(f"{index}: entry {key!r} -> {file!r} points outside the checkpoint directory {folder}")
    path = os.path.join(folder, normal)
    real_folder = os.path.realpath(folder)
    real_parent = os.path.realpath(os.path.dirname(path))
    if os.path.commonpath([real_folder, real_parent]) != real_folder:
        raise ValueError(
            f"{index}: entry {key!r} -> {file!r} resolves to {real_parent}, outside the checkpoint directory {folder}"
        )
    return path


def weight_map_of_index(index: str) -> dict[str, str]:
    """{key: file path} from a `model.safetensors.index.json` (files relative to its folder, and inside it)."""
    weight_map = read_json(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"safetensors index {index} has no 'weight_map' object (key -> shard file)")
    folder = os.path.dirname(index)
    paths: dict[Any, str] = {}  # one resolution per shard, not per key
    out = {}
    for key, file in weight_map.items():
        if not isinstance(file, str) or file not in paths:
            paths[file] = shard_path(folder, file, index, key)
        out[key] = paths[file]
    return out


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
