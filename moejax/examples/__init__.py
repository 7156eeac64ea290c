"""Whole models written in plain JAX around moejax's MoE layer: what a model builder writes, tested and benchmarked.

* `qwen3_moe`: a Qwen3-MoE decoder (embedding, RMSNorm, rotary attention with a KV cache, `moejax.moe_forward` for
  every MoE layer, lm_head) loaded from a Hugging Face checkpoint directory, with greedy generation as one jitted
  program, on one device or with the MoE layers under expert parallelism.

Examples are not part of moejax's API: read them, copy them, change them.
"""
