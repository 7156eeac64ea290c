"""One home for Hugging Face key names: the key names of one MoE block (`BlockKeys`), the spellings of its Linear
modules, and the `BlockKeys` of every family's in-memory and on-disk blocks (`moejax.hf.families` names them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

Names = tuple[str, str, str]  # (gate, up, down) Linear names
GATE_UP_DOWN: Names = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2: Names = ("w1", "w3", "w2")  # Mixtral / MiniMax / DeepSeek-V4 originals
EXPERT_NAMES: tuple[Names, ...] = (GATE_UP_DOWN, W1_W3_W2)  # the per-expert Linear names, in the order tried
SHARED_PREFIXES = ("shared_expert.", "shared_experts.")  # transformers' two spellings of the shared MLP
ExpertsKind = Literal["standard", "gpt_oss", "llama4", "stacked_moe"]


@dataclasses.dataclass(frozen=True)
class BlockKeys:
    """The key names of one MoE block, relative to its prefix (messages call it the block's layout).

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


def linear_names(keys: Iterable[str], prefix: str) -> Names:
    """Which spelling of the (gate, up, down) Linear names (`gate_proj`... or Mixtral's `w1/w3/w2`) the keys under
    `prefix` use (`prefix` ends in a dot, e.g. "experts.0."); `GATE_UP_DOWN` when neither is there."""
    keys = list(keys)
    for names in EXPERT_NAMES:
        if any(k.startswith(f"{prefix}{names[0]}.") for k in keys):
            return names
    return GATE_UP_DOWN


# -- the key names of every family's blocks ---------------------------------------------------------------

# Keys of the decoder layer that sit beside the block in layouts whose keys are relative to the decoder layer.
_DECODER_SIBLINGS = ("self_attn", "input_layernorm", "post_attention_layernorm")

QWEN = BlockKeys("qwen", router="gate.weight", shared_prefix="shared_expert.")
DEEPSEEK = BlockKeys("deepseek", router="gate.weight", shared_prefix="shared_experts.")
# Mixtral's and MiniMax-M2's checkpoints (`block_sparse_moe.`): w1/w3/w2 experts, MiniMax's bias on the block.
MIXTRAL = BlockKeys(
    "mixtral", router="gate.weight", expert_names=W1_W3_W2, correction=("e_score_correction_bias", "gate.bias")
)
DEEPSEEK_V4 = BlockKeys(  # the original DeepSeek-V4 release (`layers.L.ffn.`)
    "deepseek_v4",
    router="gate.weight",
    correction=("gate.bias", "gate.e_score_correction_bias", "e_score_correction_bias"),
    expert_names=W1_W3_W2,
    shared_names=W1_W3_W2,
)
STEP3P7 = BlockKeys(  # Step-3.7 on disk: keys relative to the decoder layer, experts stacked per layer
    "step3p7",
    router="moe.gate.weight",
    correction=("moe.router_bias",),
    experts="stacked_moe",
    shared_prefix="share_expert.",
    decoder_layer=True,
    ignored=_DECODER_SIBLINGS,
)
LONGCAT = BlockKeys(
    "longcat_flash",
    router="router.classifier.weight",
    correction=("router.e_score_correction_bias",),
    zero_expert_rows=True,
    ignored=("router.classifier.bias",),  # exists with router_bias=True, never applied (docs/FAMILIES.md §19.1)
)
GEMMA4 = BlockKeys(  # no block module: router and experts sit on the decoder layer
    "gemma4",
    router="router.proj.weight",
    decoder_layer=True,
    ignored=(
        *_DECODER_SIBLINGS,
        # The dense branch, the post norms and the per-layer-input branch stay with the model.
        "mlp",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_feedforward_layernorm_1",
        "post_feedforward_layernorm_2",
        "per_layer_input_gate",
        "per_layer_projection",
        "post_per_layer_input_norm",
        "layer_scalar",
    ),
)
GPT_OSS = BlockKeys("gpt_oss", router="router.weight", experts="gpt_oss", identify=("router.bias",))
LLAMA4 = BlockKeys(
    "llama4",
    router="router.weight",
    experts="llama4",
    shared_prefix="shared_expert.",
    identify=("shared_expert.down_proj.weight",),
)
BLOCK_KEYS = (QWEN, DEEPSEEK, MIXTRAL, DEEPSEEK_V4, STEP3P7, LONGCAT, GEMMA4, GPT_OSS, LLAMA4)
