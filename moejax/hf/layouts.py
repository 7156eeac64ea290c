"""Key layouts: how one MoE block's tensors are named and shaped in a Hugging Face state dict, both ways.

A `KeyLayout` names the router, correction-bias and shared-expert keys and the shape of the routed experts. The
family records (`moejax.hf.families`) name the layouts of each family: transformers' in-memory module and each
on-disk checkpoint class; nothing here looks at the config's math to decide.

Reading is lenient where checkpoints in the wild differ (fused `experts.gate_up_proj` or per-expert
`experts.{e}.gate_proj.weight` / Mixtral's `w1/w3/w2`, the correction bias under its alternative names), and
strict about everything else: every key must be used or ignored by name, every shape checked. Writing uses the
layout's own names. `experts_from_hf` is the one place that turns the routed experts' tensors into a weight
format's fields (`moejax.weights`): dense, or a quantized format of `moejax.quantized` given the checkpoint's
quantization (`moejax.hf.quant`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

import ml_dtypes
import numpy as np

from moejax import quantized as Q
from moejax.config import MoEConfig, SharedExpert
from moejax.hf.quant import dequantize_projection
from moejax.quantized import HfQuant
from moejax.weights import ExpertFormat, ExpertWeights

Names = tuple[str, str, str]  # (gate, up, down) Linear names
GATE_UP_DOWN: Names = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2: Names = ("w1", "w3", "w2")  # Mixtral / MiniMax / DeepSeek-V4 originals
ExpertsKind = Literal["standard", "gpt_oss", "llama4", "stacked_moe"]


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """The key names of one MoE block, relative to its prefix.

    Attributes:
      name: for messages.
      router: the router weight `[E (+ zero experts), H]`.
      correction: the correction bias; the first is written, all are read.
      experts: the tensor scheme of the routed experts: "standard" (`gate_up_proj [E, 2I, H]`, gate rows first),
        "gpt_oss" (`[E, H, 2I]` with gate in the even columns, biases), "llama4" (`[E, H, 2I]`, halves),
        "stacked_moe" (Step-3.7 on disk: `moe.{gate,up,down}_proj.weight` stacked `[E, out, in]`).
      expert_names: per-expert Linear names written (both spellings are read).
      shared_prefix, shared_names: where the shared MLP lives and its Linear names (as written).
      decoder_layer: the keys are relative to the decoder layer (the block has no module of its own).
      ignored: keys beside the block that are left unread (by name, or name prefix followed by a dot).
      zero_expert_rows: the fused gate_up_proj has rows for LongCat's zero experts (never used).
      identify: keys, besides the router, whose presence tells this layout from another with the same router key.
    """

    name: str
    router: str
    correction: tuple[str, ...] = ("gate.e_score_correction_bias", "e_score_correction_bias", "gate.bias")
    experts: ExpertsKind = "standard"
    expert_names: Names = GATE_UP_DOWN
    shared_prefix: str = "shared_experts."
    shared_names: Names = GATE_UP_DOWN
    decoder_layer: bool = False
    ignored: tuple[str, ...] = ()
    zero_expert_rows: bool = False
    identify: tuple[str, ...] = ()

    def owns(self, key: str) -> bool:
        """Whether a key under the block prefix belongs to the block (not one of the `ignored` modules beside it)."""
        return not any(key == p or key.startswith(p + ".") for p in self.ignored)

    def matches(self, keys: set[str] | frozenset[str]) -> bool:
        """Whether a block's keys are in this layout (its router key and identifying keys present)."""
        return self.router in keys and all(k in keys for k in self.identify)


# -- the state dict of one block -------------------------------------------------------------------------------

# Quantized-checkpoint tensors (FP8 block scales, DeepSeek-V4's expert scales, packed ints): named in the error.
_QUANTIZED_KEY = re.compile(r"(scale_inv|weight_scale|_blocks|_scales|\.scales?|\.qweight|\.qzeros)$")
_PER_EXPERT_KEY = re.compile(r"experts\.(\d+)\.")


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


class _Reads(Mapping):
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


def router_from_hf(sd: StateDict, layout: KeyLayout, cfg: MoEConfig) -> dict[str, np.ndarray]:
    H, E, N, K = cfg.hidden_size, cfg.num_experts, cfg.num_selectable, cfg.top_k
    flat = {"router.kernel": sd.take(layout.router, (N, H)).T}
    if cfg.router_bias:
        flat["router.bias"] = sd.take("router.bias", (N,))
    if cfg.correction_bias:
        flat["router.correction_bias"] = sd.take(layout.correction, (N,)).astype(np.float32)
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


def experts_from_hf(
    sd: StateDict, layout: KeyLayout, cfg: MoEConfig, quant: HfQuant | None = None
) -> tuple[type[ExpertFormat], dict[str, np.ndarray]]:
    """The routed experts of one block: (their weight format, its fields as host arrays `[E, ...]`).

    The one place a checkpoint's expert tensors become a format: dense tensors give `ExpertWeights`
    (`[in, out]`, gate and up apart); with `quant` (the checkpoint's quantization, `moejax.quantized.HfQuant`) the
    experts stay in its quantized format (`moejax.quantized.fields_from_hf_tensors`). gpt-oss's MXFP4 blocks are
    read as the MXFP4 format without `quant` too (their keys say what they are).
    """
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    if quant is None and layout.experts == "gpt_oss" and "experts.gate_up_proj_blocks" in sd:
        quant = Q.HfQuant(Q.quantized_format("mxfp4"), "gpt-oss")
    if quant is not None:
        return quant.fmt, _quantized_experts(sd, layout, cfg, quant)
    if layout.experts == "stacked_moe":  # Step-3.7 on disk: stacked per layer, Linear [out, in] per expert
        return ExpertWeights, {
            "gate": sd.take("moe.gate_proj.weight", (E, I, H)).transpose(0, 2, 1),
            "up": sd.take("moe.up_proj.weight", (E, I, H)).transpose(0, 2, 1),
            "down": sd.take("moe.down_proj.weight", (E, H, I)).transpose(0, 2, 1),
        }
    if any(_PER_EXPERT_KEY.match(k) for k in sd.raw):
        return ExpertWeights, _per_expert(sd, cfg)
    if layout.experts == "gpt_oss":
        return ExpertWeights, _gpt_oss_experts(sd, cfg)
    if layout.experts == "llama4":  # transposed [in, out], concatenated halves
        gate_up = sd.take("experts.gate_up_proj", (E, H, 2 * I))
        down = sd.take("experts.down_proj", (E, I, H))
        return ExpertWeights, {"gate": gate_up[..., :I], "up": gate_up[..., I:], "down": down}
    # LongCat sizes gate_up_proj with the zero experts too; their rows are never used (FAMILIES.md §11).
    rows = (E, cfg.num_selectable) if layout.zero_expert_rows else (E,)
    gate_up = sd.take("experts.gate_up_proj", *((r, 2 * I, H) for r in rows))[:E]
    down = sd.take("experts.down_proj", (E, H, I))
    return ExpertWeights, {
        "gate": gate_up[:, :I, :].transpose(0, 2, 1),
        "up": gate_up[:, I:, :].transpose(0, 2, 1),
        "down": down.transpose(0, 2, 1),
    }


def _quantized_experts(sd: StateDict, layout: KeyLayout, cfg: MoEConfig, quant: HfQuant) -> dict[str, np.ndarray]:
    """`fields_from_hf_tensors` of the expert keys; the keys it read are marked used, and so are the activation
    scales (weight-only: known and left unread); anything else under `experts.` is left for the unused-key check."""
    if layout.experts == "stacked_moe":
        raise NotImplementedError(f"quantized experts in the {layout.name} layout (stacked moe.*) are not supported")
    if (quant.source == "gpt-oss") != (layout.experts == "gpt_oss"):
        what = "gpt-oss's fused MXFP4 blocks" if quant.source == "gpt-oss" else f"{quant.source} per-expert keys"
        raise ValueError(f"the {layout.name} layout does not hold {what}")
    tensors = _Reads({k: to_numpy(v) for k, v in sd.raw.items() if k.startswith("experts.")})
    fields = Q.fields_from_hf_tensors(tensors, cfg, quant)
    modules = [f"experts.{e}.{n}." for e in range(cfg.num_experts) for n in GATE_UP_DOWN + W1_W3_W2]
    sd.used |= tensors.read | _activation_scales(tensors, modules)
    return fields


def _activation_scales(keys: Mapping[str, Any], modules: list[str]) -> set[str]:
    """The activation-scale keys among `keys` of the Linear modules `modules` (prefixes ending in a dot):
    weight-only, so known and left unread."""
    return {m + s for m in modules for s in ("input_scale", "input_global_scale") if m + s in keys}


def _names_in(sd: StateDict, prefix: str) -> Names:
    """Which Linear names (gate_proj... or w1/w3/w2) the keys under `prefix` use."""
    return next((n for n in (GATE_UP_DOWN, W1_W3_W2) if f"{prefix}{n[0]}.weight" in sd), GATE_UP_DOWN)


def _per_expert(sd: StateDict, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """`experts.{e}.{gate,up,down}_proj.weight` (or w1/w3/w2), Linear `[out, in]`, stacked on E."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    names = _names_in(sd, "experts.0.")
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
    for e in range(E):
        gate, up, down = (f"experts.{e}.{n}" for n in names)
        out["gate"].append(sd.take(f"{gate}.weight", (I, H)).T)
        out["up"].append(sd.take(f"{up}.weight", (I, H)).T)
        out["down"].append(sd.take(f"{down}.weight", (H, I)).T)
        if cfg.expert_bias:
            out["gate_bias"].append(sd.take(f"{gate}.bias", (I,)))
            out["up_bias"].append(sd.take(f"{up}.bias", (I,)))
            out["down_bias"].append(sd.take(f"{down}.bias", (H,)))
    return {k: np.stack(v) for k, v in out.items() if v}


def _gpt_oss_experts(sd: StateDict, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """gpt-oss: `gate_up_proj [E, H, 2I]` with gate in the even columns and up in the odd ones, plus biases."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    gate_up = sd.take("experts.gate_up_proj", (E, H, 2 * I))
    down = sd.take("experts.down_proj", (E, I, H))
    bias = sd.take("experts.gate_up_proj_bias", (E, 2 * I))
    return {
        "gate": gate_up[..., 0::2],
        "up": gate_up[..., 1::2],
        "down": down,
        "gate_bias": bias[:, 0::2],
        "up_bias": bias[:, 1::2],
        "down_bias": sd.take("experts.down_proj_bias", (E, H)),
    }


def _shared_prefix_in(sd: StateDict, layout: KeyLayout) -> str:
    """The layout's shared-MLP prefix, or the other transformers spelling (singular / plural) when that is used."""
    if layout.decoder_layer:
        return layout.shared_prefix
    other = "shared_experts." if layout.shared_prefix == "shared_expert." else "shared_expert."
    return other if not sd.has_prefix(layout.shared_prefix) and sd.has_prefix(other) else layout.shared_prefix


def shared_from_hf(
    sd: StateDict, layout: KeyLayout, cfg: MoEConfig, quant: HfQuant | None = None
) -> dict[str, np.ndarray]:
    """The shared MLP, `[in, out]`. With `quant` its Linear modules are stored quantized (DeepSeek-V3's FP8, ...):
    moejax's shared expert is dense, so each is dequantized here on the host, exactly, to float32."""
    H, Is = cfg.hidden_size, cfg.shared_intermediate_size
    prefix = _shared_prefix_in(sd, layout)
    gate, up, down = _names_in(sd, prefix)
    flat = {}
    for name, hf_name, shape in (("gate", gate, (Is, H)), ("up", up, (Is, H)), ("down", down, (H, Is))):
        module = f"{prefix}{hf_name}."
        if quant is None:
            flat[f"shared.{name}"] = sd.take(f"{module}weight", shape).T
            continue
        if quant.source == "gpt-oss":
            raise NotImplementedError(f"{module}: gpt-oss's MXFP4 layout has no shared expert")
        tensors = _Reads(sd.raw)
        fields = Q.projection_from_hf(tensors, module, quant.fmt.scheme, quant.source, *shape)
        sd.used |= tensors.read | _activation_scales(sd.raw, [module])
        flat[f"shared.{name}"] = dequantize_projection(fields, quant.fmt.scheme)
    if cfg.shared_expert is SharedExpert.SIGMOID_GATED:
        flat["shared.gate_kernel"] = sd.take("shared_expert_gate.weight", (1, H)).T
    return flat


def ignored_keys(layout: KeyLayout, cfg: MoEConfig) -> tuple[str, ...]:
    ignored = layout.ignored
    if layout.zero_expert_rows:
        # A per-expert save of the in-memory tensor has gate/up weights for the unused zero-expert rows.
        ignored += tuple(
            f"experts.{e}.{n}" for e in range(cfg.num_experts, cfg.num_selectable) for n in ("gate_proj", "up_proj")
        )
    return ignored


# -- writing ---------------------------------------------------------------------------------------------------

_SAME_NAME = ("router.bias", "router.scale", "router.per_expert_scale")


def block_to_hf(
    flat: dict[str, np.ndarray], layout: KeyLayout, cfg: MoEConfig, experts: Literal["fused", "per_expert"]
) -> dict[str, np.ndarray]:
    """moejax's flat stacked arrays (`moejax.params.flatten`) -> the layout's keys, relative to the block."""
    hf = {layout.router: flat["router.kernel"].T}
    hf |= {name: flat[name] for name in _SAME_NAME if name in flat}
    if "router.correction_bias" in flat:
        hf[layout.correction[0]] = flat["router.correction_bias"]
    if "router.tid2eid" in flat:
        hf["gate.tid2eid"] = flat["router.tid2eid"]
    if "shared.gate" in flat:
        for name, hf_name in zip(("gate", "up", "down"), layout.shared_names, strict=True):
            hf[f"{layout.shared_prefix}{hf_name}.weight"] = flat[f"shared.{name}"].T
    if "shared.gate_kernel" in flat:
        hf["shared_expert_gate.weight"] = flat["shared.gate_kernel"].T
    if "expert_norm" in flat:
        hf["pre_feedforward_layernorm_2.weight"] = flat["expert_norm"]
    if "experts.gate" not in flat:  # quantized experts: written by the caller in their on-disk layout
        return hf
    if experts == "per_expert":
        if layout.experts == "stacked_moe":
            raise ValueError(f"the {layout.name} layout stores experts stacked: per-expert keys do not exist there")
        hf |= _per_expert_to_hf(flat, layout, cfg)
    else:
        hf |= _fused_to_hf(flat, layout)
    return hf | _zero_expert_rows(hf, layout, cfg) if layout.zero_expert_rows else hf


def _zero_expert_rows(hf: dict[str, np.ndarray], layout: KeyLayout, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """LongCat's gate_up_proj has rows for the zero experts too (never used; FAMILIES.md §19.2): transformers
    refuses a checkpoint without them, so they are written as zeros."""
    zeros = cfg.num_zero_experts
    if "experts.gate_up_proj" in hf:
        gate_up = hf["experts.gate_up_proj"]
        return {"experts.gate_up_proj": np.concatenate([gate_up, np.zeros((zeros, *gate_up.shape[1:]), gate_up.dtype)])}
    pad = {}
    for e in range(cfg.num_experts, cfg.num_selectable):
        for name in layout.expert_names[:2]:
            weight = hf[f"experts.0.{name}.weight"]
            pad[f"experts.{e}.{name}.weight"] = np.zeros_like(weight)
    return pad


def _fused_to_hf(flat: dict[str, np.ndarray], layout: KeyLayout) -> dict[str, np.ndarray]:
    gate, up, down = flat["experts.gate"], flat["experts.up"], flat["experts.down"]
    if layout.experts == "gpt_oss":
        E, H, I = gate.shape
        gate_up = np.stack([gate, up], axis=-1).reshape(E, H, 2 * I)  # interleave: even gate, odd up
        bias = np.stack([flat["experts.gate_bias"], flat["experts.up_bias"]], axis=-1).reshape(E, 2 * I)
        return {
            "experts.gate_up_proj": gate_up,
            "experts.gate_up_proj_bias": bias,
            "experts.down_proj": down,
            "experts.down_proj_bias": flat["experts.down_bias"],
        }
    if layout.experts == "llama4":
        return {"experts.gate_up_proj": np.concatenate([gate, up], axis=-1), "experts.down_proj": down}
    if layout.experts == "stacked_moe":
        return {
            "moe.gate_proj.weight": gate.transpose(0, 2, 1),
            "moe.up_proj.weight": up.transpose(0, 2, 1),
            "moe.down_proj.weight": down.transpose(0, 2, 1),
        }
    gate_up = np.concatenate([gate, up], axis=-1).transpose(0, 2, 1)  # [E, 2I, H]
    return {"experts.gate_up_proj": gate_up, "experts.down_proj": down.transpose(0, 2, 1)}


def _per_expert_to_hf(flat: dict[str, np.ndarray], layout: KeyLayout, cfg: MoEConfig) -> dict[str, np.ndarray]:
    hf = {}
    for e in range(cfg.num_experts):
        for name, hf_name in zip(("gate", "up", "down"), layout.expert_names, strict=True):
            hf[f"experts.{e}.{hf_name}.weight"] = flat[f"experts.{name}"][e].T
            if cfg.expert_bias:
                hf[f"experts.{e}.{hf_name}.bias"] = flat[f"experts.{name}_bias"][e]
    return hf
