"""Whole checkpoints: one call from a transformers-saved directory to a layer's `(MoEConfig, MoEParams)`, and back.

`load_layer(dir, L)` reads `config.json`, takes the family record of its `model_type`, finds which of the
record's checkpoint classes the directory holds (the block prefix whose router key is present for layer L),
and reads that block's tensors alone, shard by shard. `load_layers` does every MoE layer, reading each shard
once. `save_layer` writes a block back under the family's on-disk keys. A quantized checkpoint's routed experts
stay quantized both ways (`moejax.hf.quant`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import ml_dtypes
import numpy as np

from moejax.config import MoEConfig
from moejax.hf import files as shards
from moejax.hf import quant as hfquant
from moejax.hf import transaction
from moejax.hf.configs import (
    config_from_hf,
    family_config,
    is_composite,
    layer_kind,
    moe_layer_indices,
    num_layers,
)
from moejax.hf.convert import block_quant_of, layout_of, params_from_layout, params_to_hf
from moejax.hf.families import Block, Family
from moejax.hf.hfconfig import as_dict
from moejax.hf.layouts import StateDict
from moejax.hf.quant import BlockQuant
from moejax.params import MoEParams
from moejax.quantized import HfQuant, QuantizedExperts
from moejax.weights import Layout, as_stacked

CONFIG = "config.json"
Checkpoint = str | os.PathLike


# -- finding blocks --------------------------------------------------------------------------------------------


def _block_keys(block: Block) -> tuple[str, ...]:
    return (block.layout.router, *block.layout.identify)


def find_block(family: Family, keys: Mapping[str, Any] | set[str], layer: int) -> Block | None:
    """The first of the family's checkpoint classes whose block of `layer` is in `keys` (router key present)."""
    for block in family.blocks:
        prefix = block.at(layer)
        if all(prefix + k in keys for k in _block_keys(block)):
            return block
    return None


def moe_prefixes(family: Family, keys: Iterable[str]) -> list[str]:
    """Every prefix in `keys` that holds an MoE block of `family` (any checkpoint class), by layer."""
    patterns = []
    for block in family.blocks:
        prefix = re.escape(block.prefix).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
        patterns.append(re.compile(f"(?P<prefix>{prefix}){re.escape(block.layout.router)}$"))
    found: dict[str, int] = {}
    for key in keys:
        for pattern in patterns:
            match = pattern.match(key)
            if match:
                found[match.group("prefix")] = int(match.group("layer"))
    return sorted(found, key=lambda p: (found[p], p))


def _layers_held(family: Family, keys: Iterable[str]) -> int:
    """1 + the largest decoder-layer index of any key under one of the family's layer prefixes (0 for none)."""
    patterns = set()
    for block in family.blocks:
        layer_prefix = block.prefix[: block.prefix.index("{layer}")]
        patterns.add(re.compile(re.escape(layer_prefix) + r"(\d+)\."))
    held = 0
    for key in keys:
        for pattern in patterns:
            match = pattern.match(key)
            if match:
                held = max(held, int(match.group(1)) + 1)
    return held


def _listing(prefixes: list[str]) -> str:
    if not prefixes:
        return "no prefix holds an MoE block of this family"
    shown = prefixes if len(prefixes) <= 6 else [*prefixes[:3], "...", *prefixes[-2:]]
    return f"the MoE blocks are at {', '.join(shown)} ({len(prefixes)} in all)"


# -- opening a checkpoint --------------------------------------------------------------------------------------


class _Opened:
    """A checkpoint directory: its config, family record and key -> shard map (from the index or the headers)."""

    def __init__(self, checkpoint: Checkpoint):
        path = os.fspath(checkpoint)
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint {path!r} is not a directory (expected config.json and .safetensors files)")
        config_path = os.path.join(path, CONFIG)
        if not os.path.exists(config_path):
            raise ValueError(
                f"{path} has no {CONFIG}: expected a checkpoint directory as transformers' save_pretrained writes it"
            )
        self.hf_config = shards.read_json(config_path, "config")
        self.path = path
        self.family, self.text = family_config(self.hf_config)
        self.quant = hfquant.read(path, self.hf_config)
        self.weight_map = shards.weight_map(path)

    def prefixes(self) -> list[str]:
        return moe_prefixes(self.family, self.weight_map)

    def check_layer_count(self) -> None:
        """ValueError when the config counts more decoder layers than the weight map holds: listing the MoE
        layers walks every layer the config counts, so a hostile `num_hidden_layers=10**9` must stop here."""
        n = num_layers(self.family, self.text)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            if n is None:
                return  # moe_layer_indices names the missing field
            raise ValueError(f"{self.path}/{CONFIG}: {self.family.num_layers}={n!r} is not a layer count")
        held = _layers_held(self.family, self.weight_map)
        if n > held:
            raise ValueError(
                f"{self.path}/{CONFIG}: {self.family.num_layers}={n}, but the weights hold decoder layers "
                f"0..{held - 1} only ({held} layers)"
            )

    def block(self, layer: int) -> tuple[MoEConfig, Block, list[str]]:
        """The layer's config, block and keys, or ValueError naming the layer and where MoE blocks are."""
        what = f"layer {layer} of {self.path} ({self.text.model_type})"
        try:
            kind, reason = layer_kind(self.hf_config, layer)
        except ValueError as e:
            raise ValueError(f"{what}: {e}; {_listing(self.prefixes())}") from None
        if kind == "dense":
            raise ValueError(f"{what} is a dense MLP ({reason}), not an MoE block; {_listing(self.prefixes())}")
        block = find_block(self.family, self.weight_map, layer)
        if block is None:
            looked = ", ".join(f"{b.at(layer)}{b.layout.router} ({b.checkpoint})" for b in self.family.blocks)
            raise ValueError(f"{what}: no MoE block found; looked for {looked}; {_listing(self.prefixes())}")
        prefix = block.at(layer)
        # Under a decoder-layer prefix (Gemma-4, Step-3.7) the layer's other modules are not read.
        keys = [k for k in self.weight_map if k.startswith(prefix) and block.layout.owns(k[len(prefix) :])]
        return config_from_hf(self.hf_config, layer), block, keys

    def block_quant(self, layer: int, block: Block, keys: list[str]) -> BlockQuant | None:
        """Which of the block's modules the checkpoint's quantization config quantizes (None: a dense checkpoint).

        The routed experts are quantized unless no expert module is (compressed-tensors' `targets` miss them, or
        the config's ignore list names them); the shared expert likewise; a block with some expert modules
        quantized and others not is not supported.
        """
        if self.quant is None:
            return None
        prefix = block.at(layer)
        found = {}
        for part, starts in (("experts", ("experts.",)), ("shared", ("shared_expert.", "shared_experts."))):
            modules = sorted({k.rsplit(".", 1)[0] for k in keys if k[len(prefix) :].startswith(starts)})
            quantized = [self.quant.quantizes(m) for m in modules]
            if any(quantized) and not all(quantized):
                dense = [m for m, q in zip(modules, quantized, strict=True) if not q]
                raise NotImplementedError(
                    f"layer {layer}: the quantization config ignores some {part} modules ({dense[:3]}...) but not "
                    "all: one format per block is supported"
                )
            found[part] = bool(modules) and all(quantized)
        return BlockQuant(self.quant.hf, experts=found["experts"], shared=found["shared"])


# -- loading ---------------------------------------------------------------------------------------------------


# The dtypes `dtype=` converts: not float8 (quantized data, meaningless without its scales) nor integers.
_CASTABLE = frozenset(np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16))


def _quantized_tensor(key: str, quant: BlockQuant | None) -> bool:
    """A quantized module's codes or scales (never cast); its biases are ordinary tensors."""
    if quant is None or key.endswith("bias"):
        return False
    return (quant.experts and key.startswith("experts.")) or (
        quant.shared and key.startswith(("shared_expert.", "shared_experts."))
    )


def _cast(
    tensors: dict[str, np.ndarray], dtype: Any, keep: tuple[str, ...], quant: BlockQuant | None = None
) -> dict[str, np.ndarray]:
    """Floating tensors in `dtype`, except `keep` (the correction bias stays float32 as in transformers) and the
    codes and scales of quantized modules."""
    if dtype is None:
        return tensors
    dtype = np.dtype(dtype)
    return {
        k: v.astype(dtype) if v.dtype in _CASTABLE and k not in keep and not _quantized_tensor(k, quant) else v
        for k, v in tensors.items()
    }


def _params(
    cfg: MoEConfig,
    block: Block,
    layer: int,
    tensors: dict[str, np.ndarray],
    dtype: Any,
    layout: Layout,
    quant: BlockQuant | None = None,
) -> MoEParams:
    prefix = block.at(layer)
    relative = {key[len(prefix) :]: value for key, value in tensors.items()}
    relative = _cast(relative, dtype, block.layout.correction, quant)
    try:
        params = params_from_layout(StateDict(relative), cfg, block.layout, layout, quant)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"layer {layer} ({block.checkpoint}, prefix {prefix!r}): {e}") from None
    if dtype is not None and quant is not None and quant.shared:  # dequantized to float32 on the host
        shared = params.shared
        cast = {f: getattr(shared, f).astype(dtype) for f in ("gate", "up", "down")}
        params = dataclasses.replace(params, shared=dataclasses.replace(shared, **cast))
    return params


def load_layer(
    checkpoint: Checkpoint, layer_idx: int, *, dtype: Any = None, layout: Layout = "auto"
) -> tuple[MoEConfig, MoEParams]:
    """The MoE block of decoder layer `layer_idx` of a transformers checkpoint directory, in one call.

    Args:
      checkpoint: a directory holding `config.json` and the safetensors weights (one file or shards with
        `model.safetensors.index.json`), as `save_pretrained` writes them, of any family in `moejax.FAMILIES`
        (text-only or multimodal classes).
      layer_idx: the decoder layer.
      dtype: cast the block's floating tensors to this dtype (e.g. `jnp.bfloat16`); None keeps the stored ones.
        The correction bias stays float32.
      layout: the routed experts' layout (`moejax.weights`), as in `params_from_hf`.
    Returns:
      (the block's `MoEConfig`, its `MoEParams`). Only the block's tensors are read, file by file.

    Quantized checkpoints (docs/FORMATS.md): config.json's `quantization_config` (compressed-tensors, DeepSeek's
    `fp8`, gpt-oss's `mxfp4`, `modelopt`) or ModelOpt's `hf_quant_config.json` beside it picks the format, and the
    routed experts stay in it (`moejax.quantized`: packed codes and scales as stored, per-expert keys or gpt-oss's
    fused MXFP4 blocks; `moejax.dequantize(params)` gives dense float32 weights). Weight-only: activation scales
    are not read. The router is read dense. moejax's shared expert is dense, so a quantized one (DeepSeek-V3's FP8
    `shared_experts.*.weight` + `weight_scale_inv`) is dequantized on the host here, exactly (float32 scale math),
    to float32 (then `dtype`). Modules named in the config's `ignore` / `modules_to_not_convert` /
    `exclude_modules` are read dense. `dtype` never applies to codes or scales.
    Raises:
      ValueError: not a checkpoint directory, an unsupported model_type, a layer out of range or without an MoE
        block, keys that match no checkpoint class of the family, a shard missing; the message names the layer and
        lists the prefixes that do hold an MoE block. For quantized checkpoints: an unknown `quant_method`, a scale
        grid not matching its weight, a group not dividing `in`, a missing zero point or global scale (naming
        the key).
      NotImplementedError: quantized tensors without a quantization config; a scheme moejax does not hold.
    """
    opened = _Opened(checkpoint)
    cfg, block, keys = opened.block(layer_idx)
    quant = opened.block_quant(layer_idx, block, keys)
    grouped = shards.by_file(opened.weight_map, keys)
    shards.check_files_exist(grouped, f"layer {layer_idx}")
    tensors: dict[str, np.ndarray] = {}
    for path, file_keys in grouped.items():
        tensors |= shards.read_file(path, file_keys)
    return cfg, _params(cfg, block, layer_idx, tensors, dtype, layout, quant)


@contextlib.contextmanager
def _progress(total: int, description: str) -> Iterator[Any]:
    """A rich progress bar on a terminal or in a notebook; silent (None) when output is not interactive."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if not (console.is_terminal or console.is_jupyter):
        yield None
        return
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda label: bar.update(task, advance=1, description=f"{description} {label}")


def load_layers(
    checkpoint: Checkpoint,
    layer_indices: list[int] | None = None,
    *,
    dtype: Any = None,
    layout: Layout = "auto",
) -> list[tuple[MoEConfig, MoEParams]]:
    """`load_layer` for several layers (default: every MoE layer, `moe_layer_indices`), each shard read once.

    Shards are read in the order the layers need them; a layer is converted as soon as all its tensors are in,
    so at most the layers spanning the current shard are held on the host. A progress bar is shown on a
    terminal or in a notebook (silent when output is not interactive).
    """
    opened = _Opened(checkpoint)
    if layer_indices is None:
        opened.check_layer_count()
        layer_indices = moe_layer_indices(opened.hf_config)
    blocks = {layer: opened.block(layer) for layer in layer_indices}
    quants = {layer: opened.block_quant(layer, block, keys) for layer, (_, block, keys) in blocks.items()}
    pending = {layer: set(keys) for layer, (_, _, keys) in blocks.items()}
    grouped = shards.by_file(opened.weight_map, [k for layer in layer_indices for k in blocks[layer][2]])
    shards.check_files_exist(grouped, f"layers {layer_indices}")
    owner = {key: layer for layer, (_, _, keys) in blocks.items() for key in keys}
    tensors: dict[int, dict[str, np.ndarray]] = {layer: {} for layer in layer_indices}
    loaded: dict[int, tuple[MoEConfig, MoEParams]] = {}
    with _progress(len(grouped), "loading MoE layers") as advance:
        for path, keys in grouped.items():
            for key, value in shards.read_file(path, keys).items():
                tensors[owner[key]][key] = value
                pending[owner[key]].discard(key)
            for layer in [layer for layer in tensors if not pending[layer]]:
                cfg, block, _ = blocks[layer]
                params = _params(cfg, block, layer, tensors.pop(layer), dtype, layout, quants[layer])
                loaded[layer] = (cfg, params)
            if advance is not None:
                advance(os.path.basename(path))
    return [loaded[layer] for layer in layer_indices]


def load_safetensors(
    files: str | os.PathLike | Iterable[str | os.PathLike],
    cfg: MoEConfig,
    prefix: str,
    *,
    layout: Layout = "auto",
    family: str | None = None,
    quantization_config: Mapping[str, Any] | None = None,
) -> MoEParams:
    """Load one MoE block from a (sharded) safetensors checkpoint, given its key prefix.

    Args:
      files: a `.safetensors` file, a list of them, a `model.safetensors.index.json`, or a directory holding an
        index (else all its `.safetensors` files). Only the files holding keys under `prefix` are opened and only
        those tensors read.
      cfg: the block's config (see `params_from_hf`).
      prefix: the block's key prefix, e.g. `"model.layers.3.mlp."` (a missing trailing dot is added); for
        Gemma-4 and Step-3.7 checkpoints the decoder layer's, e.g. `"model.layers.3."`. `load_layer` finds it.
      family, quantization_config: as in `params_from_hf`.
    Returns:
      `params_from_hf` of the tensors under `prefix`, with the prefix stripped.
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    weight_map = shards.weight_map(files)
    keys = [k for k in weight_map if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"no tensors under prefix {prefix!r} in {files}")
    grouped = shards.by_file(weight_map, keys)
    shards.check_files_exist(grouped, f"prefix {prefix!r}")
    tensors: dict[str, np.ndarray] = {}
    for path, file_keys in grouped.items():
        tensors |= shards.read_file(path, file_keys)
    sd = StateDict({key[len(prefix) :]: value for key, value in tensors.items()})
    key_layout = layout_of(sd.raw, family)
    return params_from_layout(sd, cfg, key_layout, layout, block_quant_of(sd, key_layout, quantization_config))


# -- saving ----------------------------------------------------------------------------------------------------


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
    quant = hfquant.from_configs(as_dict(hf_config), hf_quant_config)
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
        relative = params_to_hf(params, cfg, experts or block.experts, key_layout=block.layout, quant=quant)
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
        entry pointing outside the directory (naming the index and the entry); what `layer_tensors` raises.
      TimeoutError: another writer held the directory's lock for `transaction.LOCK_TIMEOUT_S` seconds.
    """
    path = os.fspath(checkpoint)
    with transaction.Transaction(path, index=shards.INDEX) as tx:
        config, config_changed = _new_or_read_config(path, hf_config)
        quant = hfquant.read(path, config)
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
        tensors = _block_tensors(params, config_from_hf(config, layer_idx), block, layer_idx, experts, hf)
        hqc = None
        if quant is not None:
            with_dense, hqc = _ignore_dense_modules(config, quant, tensors, block.at(layer_idx), params)
            config_changed = config_changed or with_dense is not config
            config = with_dense
        # Everything is validated; from here on only temporary files are written until `commit`.
        if weight_map and not indexed:  # readers without an index glob *.safetensors: name the old files first
            _stage_index(tx, path, weight_map, {})
            tx.commit()
        sizes: dict[str, int] = {}
        if existing is not None:
            prefix = existing.at(layer_idx)
            owned = [k for k in weight_map if k.startswith(prefix) and existing.layout.owns(k[len(prefix) :])]
            _drop_keys(tx, path, weight_map, owned, sizes)
        shard = _fresh_name(path, weight_map, sizes, f"model-moejax-layer-{layer_idx:05d}")
        sizes[shard] = _create_shard(tx, shard, tensors)
        weight_map |= dict.fromkeys(tensors, shard)
        _stage_index(tx, path, weight_map, sizes)
        if config_changed:
            tx.replace_json(CONFIG, config, indent=2, sort_keys=True)
        if hqc is not None:
            tx.replace_json(hfquant.HF_QUANT_CONFIG, hqc, indent=2)
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
    quant: hfquant.CheckpointQuant,
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
    new_config, new_hqc = hfquant.with_dense_modules(quant, config, dict.fromkeys(dense))
    if new_hqc is not None and new_hqc == quant.hf_quant_config:
        new_hqc = None
    return new_config, new_hqc


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
