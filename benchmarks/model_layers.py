"""Real MoE layer shapes, the one table the benchmarks and the lowering tests size themselves from."""

from __future__ import annotations

import dataclasses

from moejax.config import MoEConfig


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    cfg: MoEConfig


MODEL_LAYERS: dict[str, MoEConfig] = {
    "qwen3-30b-a3b": MoEConfig.preset("qwen3_moe", hidden_size=2048, num_experts=128, top_k=8, intermediate_size=768),
    "mixtral-8x7b": MoEConfig.preset("mixtral", hidden_size=4096, num_experts=8, top_k=2, intermediate_size=14336),
    "deepseek-v3": MoEConfig.preset(
        "deepseek_v3",
        hidden_size=7168,
        num_experts=256,
        top_k=8,
        intermediate_size=2048,
        n_group=8,
        topk_group=4,
        shared_intermediate_size=2048,
    ),
}
