"""Writing one MoE block into a transformers checkpoint directory (`save_layer`, a transaction), and the tensors it
writes (`layer_tensors`): the family's on-disk keys, quantized experts in the checkpoint's own layout."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from moejax.config import MoEConfig
from moejax.hf import files as shards
from moejax.hf import quant_config, transaction
from moejax.hf.checkpoint import CONFIG, Checkpoint, find_block
from moejax.hf.config_mapping import as_dict
from moejax.hf.convert import params_to_hf
from moejax.hf.families import Block, Family, config_from_hf, family_config, is_composite
from moejax.hf.quant_config import HfQuant
from moejax.params import MoEParams
from moejax.quantized.formats import QuantizedExperts
from moejax.weights import as_stacked


def _block_for(family: Family, checkpoint_class: str | None, composite: bool) -> Block:
    """The named checkpoint class, or the first one that goes with a composite (multimodal) or text config."""
    if checkpoint_class is None:
        return next(b for b in family.blocks if b.composite in (None, composite))
    for block in family.blocks:
        if block.checkpoint == checkpoint_class:
            return block
    known = [b.checkpoint for b in family.blocks]
    raise ValueError(f"{family.name} has no checkpoint class {checkpoint_class!r}; known: {known}")


def layer_tensors(
    params: MoEParams,
    hf_config: Any,
    layer_idx: int,
    *,
    checkpoint_class: str | None = None,
    experts: Literal["fused", "per_expert"] | None = None,
    hf_quant_config: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """The block of `layer_idx` as a checkpoint holds it: full keys (with the block prefix) -> numpy arrays.

    `checkpoint_class` picks one of the family record's checkpoint classes (default: the first that goes with
    `hf_config`, text or multimodal); `experts` overrides how that class stores the routed experts. Quantized
    experts are written in the on-disk layout of `hf_config`'s `quantization_config` (or of ModelOpt's
    `hf_quant_config`); the shared expert and router are written dense.
    """
    family, _ = family_config(hf_config)
    block = _block_for(family, checkpoint_class, is_composite(hf_config))
    quant = quant_config.from_configs(as_dict(hf_config), hf_quant_config)
    hf = quant.hf if quant is not None else None
    return _block_tensors(params, config_from_hf(hf_config, layer_idx), block, layer_idx, experts, hf)


def _block_tensors(
    params: MoEParams,
    cfg: MoEConfig,
    block: Block,
    layer: int,
    experts: Literal["fused", "per_expert"] | None,
    quant: HfQuant | None = None,
) -> dict[str, np.ndarray]:
    try:
        relative = params_to_hf(params, cfg, experts or block.experts, block_keys=block.keys, quant=quant)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"layer {layer} ({block.checkpoint}): {e}") from None
    prefix = block.at(layer)
    return {prefix + key: np.ascontiguousarray(value) for key, value in relative.items()}


def save_layer(
    checkpoint: Checkpoint,
    layer_idx: int,
    params: MoEParams,
    *,
    hf_config: Any = None,
    checkpoint_class: str | None = None,
    experts: Literal["fused", "per_expert"] | None = None,
) -> str:
    """Write the MoE block of `layer_idx` into a checkpoint directory, in the family's on-disk layout.

    The block goes where the checkpoint already keeps that layer's block (else at the prefix of
    `checkpoint_class`, by default the first class of the family record that goes with the config), into its own
    shard `model-moejax-layer-{L:05d}.safetensors` (`...-{L:05d}-v1.safetensors` when that name is in use);
    `model.safetensors.index.json` is written or updated (created from the existing `.safetensors` files if there
    was none) and the old block's tensors leave the other shards, so `from_pretrained` and `load_layer` see the
    new block only. `hf_config` (a transformers config or its dict) becomes `config.json` when given; otherwise
    the directory's `config.json` is used.

    The save is a transaction (`moejax.hf.transaction`): everything is validated first (a wrong `hf_config`
    raises before anything is written); new shards are written to temporary files and fsynced, a shard that
    loses the old block's tensors is rewritten under a new name (never edited in place); the index then
    `config.json` / `hf_quant_config.json` are swapped in with `os.replace`; old shards are removed after.
    A reader sees the whole old checkpoint or the whole new one, a crash leaves at most temporary files (the
    next save removes them), and a retry after any failure succeeds. A lock file (`.moejax.lock`) serialises
    writers of one directory. Files that are symlinks (a Hugging Face cache snapshot) are replaced by regular
    files, never written through. (When the ignore list of a quantized checkpoint changes, the index and
    config.json are two renames: between them `load_layer` refuses the block rather than misreading it.)

    Quantized checkpoints: the format comes from the checkpoint's config (`quantization_config` of `hf_config` or
    of the directory's `config.json`, or ModelOpt's `hf_quant_config.json` in the directory); quantized routed
    experts must be in that format and are written in its on-disk layout, so load -> save -> load is exact. No
    quantization config is invented: saving quantized params where there is none is a ValueError (pass an
    `hf_config` that has one). The modules written dense that the config would quantize (the shared expert, which
    moejax holds dense, so DeepSeek-V3's FP8 one is written as its float32 dequantization; dense routed experts;
    the router) are added to the config's ignore list (`ignore`, `modules_to_not_convert` or `exclude_modules`) in
    `config.json` / `hf_quant_config.json`, so transformers and `load_layer` read them dense.

    Returns:
      the new shard's path.
    Raises:
      ValueError: no config.json and no `hf_config`; quantized params without a quantization config; an index
        entry pointing outside the directory or to a missing shard (naming the index and the entry or file); a
        journal `moejax.hf.transaction` cannot prove its own (naming it); what `layer_tensors` raises.
      TimeoutError: another writer held the directory's lock for `transaction.LOCK_TIMEOUT_S` seconds.
    """
    path = os.fspath(checkpoint)
    with transaction.Transaction(path, index=shards.INDEX) as tx:
        config, config_changed = _new_or_read_config(path, hf_config)
        quant = quant_config.read(path, config)
        if quant is None and isinstance(as_stacked(params.experts), QuantizedExperts):
            raise ValueError(
                f"layer {layer_idx}: params hold quantized experts ({type(as_stacked(params.experts)).__name__}) "
                f"but {path} has no quantization config: pass an hf_config with a quantization_config "
                "(docs/FORMATS.md)"
            )
        family, _ = family_config(config)
        indexed = os.path.exists(os.path.join(path, shards.INDEX))
        weight_map = _relative_weight_map(path) if indexed or _has_weights(path) else {}
        existing = find_block(family, weight_map, layer_idx)
        if existing is not None and checkpoint_class is None:
            block = existing
        else:
            block = _block_for(family, checkpoint_class, is_composite(config))
        hf = quant.hf if quant is not None else None
        layer_cfg = config_from_hf(config, layer_idx)
        tensors = _block_tensors(params, layer_cfg, block, layer_idx, experts, hf)
        hqc = None
        if quant is not None:
            with_dense, hqc = _ignore_dense_modules(config, quant, tensors, block.at(layer_idx), params)
            config_changed = config_changed or with_dense is not config
            config = with_dense
        owned = []
        if existing is not None:
            prefix = existing.at(layer_idx)
            owned = [k for k in weight_map if k.startswith(prefix) and existing.keys.owns(k[len(prefix) :])]
        if existing is not None and block.keys.zero_expert_rows:
            stored = existing.at(layer_idx), block.at(layer_idx)
            tensors = _zero_expert_rows_as_stored(tensors, path, weight_map, *stored, layer_cfg.num_experts)
        _check_kept_shards(path, weight_map, owned)
        # Everything is validated; from here on only temporary files are written until `commit`.
        if weight_map and not indexed:  # readers without an index glob *.safetensors: name the old files first
            _stage_index(tx, path, weight_map, {})
            tx.commit()
        sizes: dict[str, int] = {}
        if owned:
            _drop_keys(tx, path, weight_map, owned, sizes)
        shard = _fresh_name(path, weight_map, sizes, f"model-moejax-layer-{layer_idx:05d}")
        sizes[shard] = _create_shard(tx, shard, tensors)
        weight_map |= dict.fromkeys(tensors, shard)
        _stage_index(tx, path, weight_map, sizes)
        if config_changed:
            tx.replace_json(CONFIG, config, indent=2, sort_keys=True)
        if hqc is not None:
            tx.replace_json(quant_config.HF_QUANT_CONFIG, hqc, indent=2)
        tx.commit()
    return os.path.join(path, shard)


def _new_or_read_config(path: str, hf_config: Any) -> tuple[dict[str, Any], bool]:
    """(the config to save with, whether config.json must be written): `hf_config` when given, else the
    directory's. Nothing is written here."""
    config_path = os.path.join(path, CONFIG)
    on_disk = None
    if os.path.exists(config_path):
        on_disk = shards.read_json(config_path, "config")
    if hf_config is not None:
        config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        config = json.loads(json.dumps(config))  # what json writes (tuples -> lists), to compare with the file's
        return config, config != on_disk
    if on_disk is None:
        raise ValueError(f"{path} has no {CONFIG}: pass hf_config")
    return on_disk, False


def _ignore_dense_modules(
    config: dict[str, Any],
    quant: quant_config.CheckpointQuant,
    tensors: dict[str, np.ndarray],
    prefix: str,
    params: MoEParams,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, hf_quant_config.json or None when unchanged) with the block's dense Linear modules (a 2-D or
    3-D `.weight`, or fused dense experts, that is not a quantized expert's) added to the quantization config's
    ignore list where it would quantize them. config.json is returned unchanged (the same object) when it needs
    no entry."""
    quantized_experts = isinstance(as_stacked(params.experts), QuantizedExperts)
    dense = []
    for key, value in tensors.items():
        module, name = key.rsplit(".", 1)
        if quantized_experts and key[len(prefix) :].startswith("experts."):
            continue
        fused = name in ("gate_up_proj", "down_proj") and module.endswith(".experts")
        if fused or (name == "weight" and value.ndim in (2, 3)):
            dense.append(module)
    new_config, new_hqc = quant_config.with_dense_modules(quant, config, dict.fromkeys(dense))
    if new_hqc is not None and new_hqc == quant.hf_quant_config:
        new_hqc = None
    return new_config, new_hqc


def _zero_expert_rows_as_stored(
    tensors: dict[str, np.ndarray], path: str, weight_map: dict[str, str], old: str, new: str, num_experts: int
) -> dict[str, np.ndarray]:
    """LongCat's block with rows for the zero experts (never used) only where the checkpoint already stores them:
    transformers versions differ (some size the fused `gate_up_proj` with them, others refuse them), and the
    checkpoint being updated was written for the version that reads it."""
    fused, stored = new + "experts.gate_up_proj", old + "experts.gate_up_proj"
    if fused in tensors and stored in weight_map:
        rows = shards.header(os.path.join(path, weight_map[stored]))[1][stored]["shape"][0]
        return tensors | {fused: tensors[fused][:num_experts]} if rows == num_experts else tensors
    zero_expert = re.compile(re.escape(new) + r"experts\.(\d+)\.")
    padded = lambda k: (m := zero_expert.match(k)) is not None and int(m.group(1)) >= num_experts
    kept = {old + k[len(new) :] for k in tensors if padded(k)} & set(weight_map)
    return tensors if kept else {k: v for k, v in tensors.items() if not padded(k)}


def _has_weights(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


def _relative_weight_map(path: str) -> dict[str, str]:
    """{key: file name relative to `path`} of the checkpoint, every file checked to be inside the directory."""
    source = os.path.join(path, shards.INDEX)
    if not os.path.exists(source):
        source = path
    relative = {}
    for key, file in shards.weight_map(path).items():
        name = os.path.relpath(file, path)
        transaction.inside(path, name, source)
        relative[key] = os.path.normpath(name)
    return relative


def _check_kept_shards(path: str, weight_map: dict[str, str], replaced: list[str]) -> None:
    """ValueError naming the index and the file when a shard the saved index keeps referencing (any but the
    keys of the block being `replaced`) is missing: the save would write an index that points at nothing."""
    dropped = set(replaced)
    kept = {key: os.path.join(path, file) for key, file in weight_map.items() if key not in dropped}
    shards.check_files_exist(shards.by_file(kept, kept), os.path.join(path, shards.INDEX))


def _fresh_name(path: str, weight_map: dict[str, str], sizes: dict[str, int], stem: str) -> str:
    """`{stem}.safetensors`, else `{stem}-v1.safetensors`, ...: the first name no file, index entry or file of
    this save uses (a replaced shard always gets a new name, so a reader of the old index never sees it change).
    A trailing `-vN` of `stem` is dropped first, so names do not grow over saves."""
    stem = re.sub(r"-v\d+$", "", stem)
    used = set(weight_map.values()) | set(sizes) | set(os.listdir(path))
    version = 0
    while True:
        name = f"{stem}.safetensors" if version == 0 else f"{stem}-v{version}.safetensors"
        if name not in used:
            return name
        version += 1


def _create_shard(
    tx: transaction.Transaction, name: str, tensors: Mapping[str, np.ndarray], metadata: dict | None = None
) -> int:
    """Stage a new safetensors file; its size in bytes."""
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=metadata)
    tx.create(name, data)
    return len(data)


def _drop_keys(
    tx: transaction.Transaction, path: str, weight_map: dict[str, str], keys: list[str], sizes: dict[str, int]
) -> None:
    """Remove `keys` from the map; each shard that held some is staged anew under a new name without them (when
    it keeps any) and made obsolete: shards are never edited in place."""
    for shard, drop in shards.by_file(weight_map, keys).items():
        for key in drop:
            del weight_map[key]
        kept = [k for k, file in weight_map.items() if file == shard]
        full = os.path.join(path, shard)
        if kept:
            metadata = shards.header(full)[1].get("__metadata__")
            name = _fresh_name(path, weight_map, sizes, os.path.splitext(os.path.basename(shard))[0])
            sizes[name] = _create_shard(tx, name, shards.read_file(full, kept), metadata)
            weight_map |= dict.fromkeys(kept, name)
        tx.obsolete(shard)


def _stage_index(tx: transaction.Transaction, path: str, weight_map: dict[str, str], sizes: dict[str, int]) -> None:
    """Stage `model.safetensors.index.json` for `weight_map` (file sizes: `sizes` for new files, else on disk)."""
    files = set(weight_map.values())
    total = sum(sizes[f] if f in sizes else os.path.getsize(os.path.join(path, f)) for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    tx.replace_json(shards.INDEX, index, indent=2)
