"""The tensors of one MoE block (a state dict relative to the block) <-> `MoEParams`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig, SharedExpert
from moejax.hf.expert_tensors import experts_from_hf, experts_to_hf, quantized_experts_to_hf
from moejax.hf.families import BY_NAME
from moejax.hf.keys import BLOCK_KEYS, DEEPSEEK, QWEN, SHARED_PREFIXES, BlockKeys
from moejax.hf.quant_config import BlockQuant, HfQuant, from_quantization_config
from moejax.hf.state_dict import StateDict, block_to_hf, ignored_keys, router_from_hf, shared_from_hf
from moejax.params import MoEParams, check_params, flatten, unflatten, with_experts_layout
from moejax.quantized.formats import QuantizedExperts
from moejax.weights import Layout, as_stacked, from_host


def _family_block_keys(family: str | None) -> tuple[BlockKeys, ...]:
    """`family`'s `BlockKeys`, in-memory first (all families' for None); ValueError for an unknown family."""
    if family is None:
        return BLOCK_KEYS
    if family not in BY_NAME:
        raise ValueError(f"unknown family {family!r}; known families: {', '.join(BY_NAME)}")
    return BY_NAME[family].block_keys


def block_keys_of(keys: Any, family: str | None = None) -> BlockKeys:
    """The `BlockKeys` a block's keys are in: among `family`'s (all families' when None), the one whose router key
    (and identifying keys) are present. `BlockKeys` that read alike (same router key) count as one."""
    keys = frozenset(keys)
    candidates = [bk for bk in _family_block_keys(family) if bk.matches(keys)]
    routers = {bk.router for bk in candidates}
    if len(routers) == 1 and len({bk.experts for bk in candidates}) == 1:
        return candidates[0]
    known = sorted({bk.router for bk in _family_block_keys(family)})
    where = f"the {family} layouts" if family else "any family's layout"
    if not candidates:
        raise ValueError(f"state dict holds no router key of {where} (one of {known}); keys: {sorted(keys)[:8]}")
    names = [bk.name for bk in candidates]
    raise ValueError(f"state dict keys fit several layouts {names}: pass family= to params_from_hf")


def params_from_hf(
    state_dict: Mapping[str, Any],
    cfg: MoEConfig,
    *,
    layout: Layout = "auto",
    family: str | None = None,
    quantization_config: Mapping[str, Any] | None = None,
) -> MoEParams:
    """Convert the Hugging Face tensors of one MoE block into `MoEParams` (moejax's layout, dtypes kept).

    Args:
      state_dict: key -> array (numpy, jax, torch or anything with `__array__`), keys relative to the block
        (`gate.weight`, `experts.gate_up_proj`, ...); for Gemma-4 and Step-3.7's on-disk layout, relative to
        the decoder layer (`router.proj.weight`, `moe.gate_proj.weight`). Accepted expert layouts: the fused
        in-memory tensors of transformers, the per-expert keys `experts.{e}.{gate,up,down}_proj.weight`
        (or `w1/w3/w2`; with `.bias` for gpt-oss), Step-3.7's stacked `moe.*`, gpt-oss's MXFP4 blocks (read as
        the MXFP4 format), and with `quantization_config` the quantized layouts of docs/FORMATS.md.
      cfg: the block's config, e.g. from `config_from_hf`.
      layout: the routed experts' layout (`moejax.weights`): "auto" is per-expert on a CPU backend (what
        XLA:CPU reads in place), stacked elsewhere.
      family: the moejax family (`moejax.FAMILIES`) whose key layouts to read; None: the layout is found from
        the keys (its router key), an error when they fit several.
      quantization_config: config.json's `quantization_config` (or `{"quantization": ...}` of ModelOpt's
        `hf_quant_config.json`): the routed experts stay in that quantized format (`moejax.quantized`) and a
        quantized shared expert is dequantized to float32 on the host. Its ignore lists are not applied here
        (they name full module paths): `moejax.hf.load_layer` applies them.
    Returns:
      `MoEParams` with weights `[in, out]`, gate and up apart. Arrays keep their dtype, except the correction
      bias (float32), the hash table (int32) and a dequantized shared expert (float32).
    Raises:
      ValueError: a missing key, an unexpected key (keys the family legitimately leaves unused are ignored by
        name), or a mis-shaped tensor; the message names the key and the expected and actual shapes.
      NotImplementedError: quantized tensors without `quantization_config` (other than gpt-oss's MXFP4).
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a moejax.MoEConfig, got {type(cfg).__name__}")
    sd = StateDict(state_dict)
    block_keys = block_keys_of(sd.raw, family)
    return params_of_block(sd, cfg, block_keys, layout, block_quant_of(sd, block_keys, quantization_config))


def block_quant_of(
    sd: StateDict, block_keys: BlockKeys, quantization_config: Mapping[str, Any] | None
) -> BlockQuant | None:
    """A block's quantization from a `quantization_config` (or ModelOpt's `{"quantization": ...}`) alone: the
    routed experts in its format, the shared expert when its keys are quantized ones."""
    if quantization_config is None:
        return None
    hf = from_quantization_config(quantization_config)
    return BlockQuant(hf, experts=True, shared=_shared_is_quantized(sd, block_keys, hf))


def _shared_is_quantized(sd: StateDict, block_keys: BlockKeys, hf: HfQuant) -> bool:
    """Without module names to match an ignore list against: whether the shared MLP's keys are quantized ones."""
    return hf.source != "gpt-oss" and any(
        k.startswith((*SHARED_PREFIXES, block_keys.shared_prefix)) and not k.endswith((".weight", ".bias"))
        for k in sd.raw
    )


def params_of_block(
    sd: StateDict, cfg: MoEConfig, block_keys: BlockKeys, layout: Layout = "auto", quant: BlockQuant | None = None
) -> MoEParams:
    """`params_from_hf` for a known key layout; `quant` says which of the block's modules are quantized."""
    flat = router_from_hf(sd, block_keys, cfg)
    fmt, expert_fields = experts_from_hf(sd, block_keys, cfg, quant.hf if quant and quant.experts else None)
    if cfg.shared_expert is not SharedExpert.NONE:
        flat |= shared_from_hf(sd, block_keys, cfg, quant.hf if quant and quant.shared else None)
    if cfg.expert_prenorm:
        flat["expert_norm"] = sd.take("pre_feedforward_layernorm_2.weight", (cfg.hidden_size,))
    sd.check_all_used(ignored_keys(block_keys, cfg), cfg, quant.hf if quant is not None else None)
    experts = from_host(expert_fields, fmt, layout)
    params = unflatten({name: jnp.asarray(value) for name, value in flat.items()}, experts=experts)
    check_params(params, cfg)
    return params


def _default_write_keys(cfg: MoEConfig, flat: dict[str, np.ndarray]) -> BlockKeys:
    """Without a family: transformers' usual in-memory names (Qwen's gated shared expert is singular,
    DeepSeek's ungated one plural); what those names cannot hold asks for the family."""
    extra = sorted(n for n in flat if n in ("router.bias", "router.scale", "router.per_expert_scale", "expert_norm"))
    extra += sorted(n for n in flat if n.startswith("experts.") and n.endswith("_bias"))
    if extra or cfg.num_zero_experts or cfg.weights_on_input:
        raise ValueError(f"params_to_hf needs family= for this config (it has {extra or 'a family-specific layout'})")
    return QWEN if cfg.shared_expert is SharedExpert.SIGMOID_GATED else DEEPSEEK


def params_to_hf(
    params: MoEParams,
    cfg: MoEConfig,
    layout: Literal["fused", "per_expert"] = "fused",
    *,
    family: str | None = None,
    block_keys: BlockKeys | None = None,
    quant: HfQuant | None = None,
) -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf`: numpy arrays under Hugging Face keys relative to the block.

    `layout="fused"` writes the in-memory tensors of transformers (`experts.gate_up_proj`, ...);
    `layout="per_expert"` writes `experts.{e}.{gate,up,down}_proj.weight` (and `.bias` for gpt-oss). The names
    are those of `family`'s in-memory block (or `block_keys`, e.g. the on-disk keys of a family record);
    without either, transformers' usual names, an error for configs they cannot hold. LongCat's
    `gate_up_proj` has zero rows for its zero experts, as some transformers versions size it (`save_layer` keeps
    what the checkpoint it updates stores).

    Quantized routed experts (`moejax.quantized`) are written in `quant`'s on-disk layout
    (`moejax.hf.expert_tensors.format_to_hf_tensors`: per-expert keys, or gpt-oss's fused MXFP4 blocks whatever `layout`
    says); `quant` may be left out for MXFP4 experts in the gpt-oss layout.
    """
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout={layout!r} is not one of ['fused', 'per_expert']")
    check_params(params, cfg)
    quantized = isinstance(as_stacked(params.experts), QuantizedExperts)
    flat = {
        name: np.asarray(value)
        for name, value in flatten(with_experts_layout(params, "stacked")).items()
        if not (quantized and name.startswith("experts."))
    }
    if block_keys is None:
        block_keys = _family_block_keys(family)[0] if family is not None else _default_write_keys(cfg, flat)
    hf = block_to_hf(flat, block_keys)
    if quantized:
        return hf | quantized_experts_to_hf(params.experts, block_keys, quant)
    return hf | experts_to_hf(flat, block_keys, cfg, layout)
