"""Whole checkpoints: one call from a transformers-saved directory to a layer's `(MoEConfig, MoEParams)`, and back.

`load_layer(dir, L)` reads `config.json`, takes the family record of its `model_type`, finds which of the
record's checkpoint classes the directory holds (the block prefix whose router key is present for layer L),
and reads that block's tensors alone, shard by shard. `load_layers` does every MoE layer, reading each shard
once (`moejax.hf.checkpoint_save` writes a block back). A quantized checkpoint's routed experts stay quantized
(`moejax.hf.quant_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from moejax.config import MoEConfig
from moejax.hf import files as shards
from moejax.hf import quant_config
from moejax.hf.convert import block_keys_of, block_quant_of, params_of_block
from moejax.hf.families import Block, Family, config_from_hf, family_config, layer_kind, moe_layer_indices, num_layers
from moejax.hf.keys import SHARED_PREFIXES
from moejax.hf.quant_config import BlockQuant
from moejax.hf.state_dict import StateDict
from moejax.params import MoEParams
from moejax.weights import Layout

CONFIG = "config.json"
Checkpoint = str | os.PathLike


# -- finding blocks --------------------------------------------------------------------------------------------


def _block_keys(block: Block) -> tuple[str, ...]:
    return (block.keys.router, *block.keys.identify)


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
        patterns.append(re.compile(f"(?P<prefix>{prefix}){re.escape(block.keys.router)}$"))
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
        self.quant = quant_config.read(path, self.hf_config)
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
            looked = ", ".join(f"{b.at(layer)}{b.keys.router} ({b.checkpoint})" for b in self.family.blocks)
            raise ValueError(f"{what}: no MoE block found; looked for {looked}; {_listing(self.prefixes())}")
        prefix = block.at(layer)
        # Under a decoder-layer prefix (Gemma-4, Step-3.7) the layer's other modules are not read.
        keys = [k for k in self.weight_map if k.startswith(prefix) and block.keys.owns(k[len(prefix) :])]
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
        for part, starts in (("experts", ("experts.",)), ("shared", SHARED_PREFIXES)):
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
    return (quant.experts and key.startswith("experts.")) or (quant.shared and key.startswith(SHARED_PREFIXES))


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
    relative = _cast(relative, dtype, block.keys.correction, quant)
    try:
        params = params_of_block(StateDict(relative), cfg, block.keys, layout, quant)
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
) -> dict[int, tuple[MoEConfig, MoEParams]]:
    """`load_layer` for several layers (default: every MoE layer, `moe_layer_indices`), each shard read once:
    `{decoder layer index: (cfg, params)}`, in the order of `layer_indices` (default: the model's layer order).

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
    return {layer: loaded[layer] for layer in layer_indices}


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
    block_keys = block_keys_of(sd.raw, family)
    return params_of_block(sd, cfg, block_keys, layout, block_quant_of(sd, block_keys, quantization_config))
