"""The "reference" backend: every expert on every row in float32, masked by the slots. The oracle every other
backend is tested against, and the backward of all of them (`moejax.backends.run_routed`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.lora import LoRAExpert
from moejax.quantized import QuantizedExperts
from moejax.quantized.activations import Int8Inputs
from moejax.slots import Slots
from moejax.weights import Experts
from pallas_kernels.activations import GatedActivation

Array = jax.Array


def reference_routed(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """Dense float32 reference of `Σ_k w_k · E_{idx_k}(s_k · x)` `[T, H]`: every expert on every token, masked.

    A scan over experts dequantizes one expert at a time to float32 (`ExpertFormat.dequantize`), so memory
    stays O(T·H + one expert's weights) at any E. A row that picks an expert in two slots (hash routing) sums
    their input scales, as the models do. Experts that read per-row ids (`row_ids`) get them with every row.
    Differentiable (the backward of every other backend). `block_rows` is ignored. Quantized experts with int8
    activations (`Scheme.activations`) quantize each projection's input as `moejax.quantized.activations` defines.
    """
    del block_rows
    ids = experts.row_ids(slots)
    extra = () if ids is None else (ids,)
    experts = experts.stacked()
    E = experts.num_experts
    chosen = jax.nn.one_hot(slots.indices, E, dtype=jnp.float32)  # [T, K, E]; skipped ids have no column
    out_w = jnp.einsum("tk,tke->et", slots.out_weight, chosen)  # [E, T]
    in_scale = jnp.ones_like(slots.out_weight) if slots.in_scale is None else slots.in_scale
    scale = jnp.einsum("tk,tke->et", in_scale.astype(jnp.float32), chosen)  # [E, T]
    selected = chosen.sum(1).T > 0  # [E, T]
    x32 = x.astype(jnp.float32)

    def one_expert(acc: Array, e: Array) -> tuple[Array, None]:
        rows = x32 if slots.in_scale is None else x32 * scale[e][:, None]
        y = dequantized(experts.expert(e)).ffn(rows, act, *extra)  # [T, H]
        return acc + jnp.where(selected[e][:, None], out_w[e][:, None] * y, 0.0), None

    out, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), jnp.arange(E))
    return out


def dequantized(one):
    """One expert as the reference computes it: float32 dense weights (`dequantize()`), wrapped in
    `Int8Inputs` when its scheme quantizes the activations (adapters' deltas stay float32: `LoRAExpert`)."""
    if isinstance(one, LoRAExpert):
        return LoRAExpert(dequantized(one.base), one.lora)
    if isinstance(one, QuantizedExperts) and one.scheme.activations == "int8":
        return Int8Inputs(one.dequantize(), one.scheme.activation_group)
    return one.dequantize()
