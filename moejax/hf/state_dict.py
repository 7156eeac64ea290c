"""The tensors of one MoE block in a Hugging Face state dict: lookups with shape checks and a record of the keys
read (every key must be used or ignored by name), and the router's and shared expert's tensors both ways. The routed
experts' tensors are `moejax.hf.expert_tensors`'; key names are `moejax.hf.keys`'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from moejax.config import MoEConfig, SharedExpert
from moejax.hf.keys import SHARED_PREFIXES, BlockKeys, linear_names
from moejax.hf.quant_config import HfQuant
from moejax.hf.quant_tensors import dequantize_projection, projection_from_hf

# -- the state dict of one block -------------------------------------------------------------------------------

# Quantized-checkpoint tensors (FP8 block scales, DeepSeek-V4's expert scales, packed ints): named in the error.
_QUANTIZED_KEY = re.compile(r"(scale_inv|weight_scale|_blocks|_scales|\.scales?|\.qweight|\.qzeros)$")


def to_numpy(value: Any) -> np.ndarray:
    """A host numpy array from numpy / jax / torch (bfloat16 torch tensors have no numpy dtype: viewed as int16)."""
    if str(getattr(value, "dtype", "")) == "torch.bfloat16":
        import torch  # only reached with a torch tensor, so torch is importable

        return value.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if hasattr(value, "detach"):  # torch tensors that require grad refuse __array__
        value = value.detach().cpu()
    return np.asarray(value)


def _shape_text(shapes: tuple[tuple[int, ...], ...]) -> str:
    return " or ".join(str(s) for s in shapes)


class Reads(Mapping):
    """A read-only view of a state dict that records which keys were read (`[key]`, not `in`): what a decoder
    consumed, so keys it left unread are reported rather than silently dropped."""

    def __init__(self, raw: Mapping[str, Any]):
        self.raw = raw
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        value = self.raw[key]
        self.read.add(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def __iter__(self):
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class StateDict:
    """The HF tensors of one block: lookups with shape checks, and a record of the keys used."""

    def __init__(self, state_dict: Mapping[str, Any]):
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping from key to array, got {type(state_dict).__name__}")
        self.raw = dict(state_dict)
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def find(self, keys: tuple[str, ...]) -> str:
        """The first of `keys` present, else the first (so the error names the usual key)."""
        return next((k for k in keys if k in self.raw), keys[0])

    def take(self, keys: str | tuple[str, ...], *shapes: tuple[int, ...]) -> np.ndarray:
        """The array under the first present of `keys`, checked to have one of `shapes`."""
        keys = (keys,) if isinstance(keys, str) else keys
        key = self.find(keys)
        if key not in self.raw:
            also = f" (also accepted: {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""
            raise ValueError(f"state dict is missing key {key!r}{also}, expected shape {_shape_text(shapes)}")
        array = to_numpy(self.raw[key])
        if array.shape not in shapes:
            raise ValueError(f"state dict key {key!r}: expected shape {_shape_text(shapes)}, got {array.shape}")
        self.used.add(key)
        return array

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.raw)

    def check_all_used(self, ignored: tuple[str, ...], cfg: MoEConfig, quant: HfQuant | None = None) -> None:
        """ValueError naming every key no loader read (nor ignored by name): a tensor the block holds that
        moejax would drop. Without a quantization config, quantized-looking keys are NotImplementedError."""

        def is_ignored(key: str) -> bool:
            return any(key == p or key.startswith(p + ".") for p in ignored)

        extra = sorted(k for k in self.raw if k not in self.used and not is_ignored(k))
        if not extra:
            return
        described = ", ".join(f"{k!r} with shape {to_numpy(self.raw[k]).shape}" for k in extra[:8])
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        if quant is not None:
            raise ValueError(
                f"state dict has keys no loader read: {described}{more} (not part of the {quant.fmt.scheme.name} "
                f"{quant.source} layout for {cfg})"
            )
        if any(_QUANTIZED_KEY.search(k) and k != "router.scale" for k in extra):
            raise NotImplementedError(
                f"quantized checkpoint tensors without a quantization config, or in a layout moejax does not read: "
                f"{described}{more} (load_layer reads the config; params_from_hf takes quantization_config=)"
            )
        raise ValueError(f"state dict has unexpected keys {described}{more}: not used by {cfg}")


# -- reading ---------------------------------------------------------------------------------------------------


def router_from_hf(sd: StateDict, block_keys: BlockKeys, cfg: MoEConfig) -> dict[str, np.ndarray]:
    H, E, N, K = cfg.hidden_size, cfg.num_experts, cfg.num_selectable, cfg.top_k
    flat = {"router.kernel": sd.take(block_keys.router, (N, H)).T}
    if cfg.router_bias:
        flat["router.bias"] = sd.take("router.bias", (N,))
    if cfg.correction_bias:
        flat["router.correction_bias"] = sd.take(block_keys.correction, (N,)).astype(np.float32)
    if cfg.router_prenorm:
        flat["router.scale"] = sd.take("router.scale", (H,))
    if cfg.per_expert_scale:
        flat["router.per_expert_scale"] = sd.take("router.per_expert_scale", (E,))
    if cfg.hash_routing:
        table = sd.take("gate.tid2eid", (cfg.vocab_size, K))
        if table.size and (table.min() < 0 or table.max() >= N):
            raise ValueError(f"gate.tid2eid has expert ids in [{table.min()}, {table.max()}], outside [0, {N})")
        flat["router.tid2eid"] = table.astype(np.int32)
    return flat


def activation_scales(keys: Mapping[str, Any], modules: list[str]) -> set[str]:
    """The activation-scale keys among `keys` of the Linear modules `modules` (prefixes ending in a dot):
    weight-only, so known and left unread."""
    return {m + s for m in modules for s in ("input_scale", "input_global_scale") if m + s in keys}


def _shared_prefix_in(sd: StateDict, block_keys: BlockKeys) -> str:
    """The layout's shared-MLP prefix, or the other transformers spelling (singular / plural) when that is used."""
    if block_keys.decoder_layer:
        return block_keys.shared_prefix
    singular, plural = SHARED_PREFIXES
    other = plural if block_keys.shared_prefix == singular else singular
    return other if not sd.has_prefix(block_keys.shared_prefix) and sd.has_prefix(other) else block_keys.shared_prefix


def shared_from_hf(
    sd: StateDict, block_keys: BlockKeys, cfg: MoEConfig, quant: HfQuant | None = None
) -> dict[str, np.ndarray]:
    """The shared MLP, `[in, out]`. With `quant` its Linear modules are stored quantized (DeepSeek-V3's FP8, ...):
    moejax's shared expert is dense, so each is dequantized here on the host, exactly, to float32."""
    H, Is = cfg.hidden_size, cfg.shared_intermediate_size
    prefix = _shared_prefix_in(sd, block_keys)
    gate, up, down = linear_names(sd.raw, prefix)
    flat = {}
    for name, hf_name, shape in (("gate", gate, (Is, H)), ("up", up, (Is, H)), ("down", down, (H, Is))):
        module = f"{prefix}{hf_name}."
        if quant is None:
            flat[f"shared.{name}"] = sd.take(f"{module}weight", shape).T
            continue
        if quant.source == "gpt-oss":
            raise NotImplementedError(f"{module}: gpt-oss's MXFP4 layout has no shared expert")
        tensors = Reads(sd.raw)
        fields = projection_from_hf(tensors, module, quant.fmt.scheme, quant.source, *shape)
        sd.used |= tensors.read | activation_scales(sd.raw, [module])
        flat[f"shared.{name}"] = dequantize_projection(fields, quant.fmt.scheme)
    if cfg.shared_expert is SharedExpert.SIGMOID_GATED:
        flat["shared.gate_kernel"] = sd.take("shared_expert_gate.weight", (1, H)).T
    return flat


def ignored_keys(block_keys: BlockKeys, cfg: MoEConfig) -> tuple[str, ...]:
    ignored = block_keys.ignored
    if block_keys.zero_expert_rows:
        # A per-expert save of the in-memory tensor has gate/up weights for the unused zero-expert rows.
        ignored += tuple(
            f"experts.{e}.{n}" for e in range(cfg.num_experts, cfg.num_selectable) for n in ("gate_proj", "up_proj")
        )
    return ignored


# -- writing ---------------------------------------------------------------------------------------------------

_SAME_NAME = ("router.bias", "router.scale", "router.per_expert_scale")


def block_to_hf(flat: dict[str, np.ndarray], block_keys: BlockKeys) -> dict[str, np.ndarray]:
    """moejax's flat stacked arrays (`moejax.params.flatten`) -> the layout's keys, relative to the block, all but
    the routed experts' (`moejax.hf.expert_tensors.experts_to_hf`)."""
    hf = {block_keys.router: flat["router.kernel"].T}
    hf |= {name: flat[name] for name in _SAME_NAME if name in flat}
    if "router.correction_bias" in flat:
        hf[block_keys.correction[0]] = flat["router.correction_bias"]
    if "router.tid2eid" in flat:
        hf["gate.tid2eid"] = flat["router.tid2eid"]
    if "shared.gate" in flat:
        for name, hf_name in zip(("gate", "up", "down"), block_keys.shared_names, strict=True):
            hf[f"{block_keys.shared_prefix}{hf_name}.weight"] = flat[f"shared.{name}"].T
    if "shared.gate_kernel" in flat:
        hf["shared_expert_gate.weight"] = flat["shared.gate_kernel"].T
    if "expert_norm" in flat:
        hf["pre_feedforward_layernorm_2.weight"] = flat["expert_norm"]
    return hf
