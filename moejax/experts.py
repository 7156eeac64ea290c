"""Expert math: the gated activations, one expert's FFN, the shared expert, and the dense float32 reference.

`reference_routed` is the oracle every plan and kernel is tested against: every expert on every token in
float32, masked by the routing, obviously correct and slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import Activation, ClampOrder, MoEConfig
from moejax.params import ExpertWeights, SharedParams
from moejax.routing import Routing

Array = jax.Array


def gated_activation(gate: Array, up: Array, cfg: MoEConfig, limit: float | None) -> Array:
    """`h = f(gate, up)` in float32 for the config's activation and clamp (`limit=None`: no clamp)."""
    gate = gate.astype(jnp.float32)
    up = up.astype(jnp.float32)
    if cfg.activation is Activation.GPT_OSS:
        g = jnp.minimum(gate, limit)
        u = jnp.clip(up, -limit, limit)
        return (u + 1.0) * (g * jax.nn.sigmoid(cfg.swiglu_alpha * g))
    act = jax.nn.silu if cfg.activation is Activation.SILU else _gelu_tanh
    if limit is None:
        return act(gate) * up
    up = jnp.clip(up, -limit, limit)
    if cfg.clamp_order is ClampOrder.BEFORE_ACTIVATION:
        return act(jnp.minimum(gate, limit)) * up
    return jnp.minimum(act(gate), limit) * up


def _gelu_tanh(z: Array) -> Array:
    return jax.nn.gelu(z, approximate=True)


def expert_ffn(x: Array, w: ExpertWeights, cfg: MoEConfig) -> Array:
    """One expert on rows `x [R, H]` -> `[R, H]` float32.

    Matmuls take their inputs in the weight dtype and accumulate in float32; the activation runs in
    float32 and is rounded to the weight dtype before the down projection (what a bf16 model does).
    `w` holds one expert (no leading E axis), as returned by `ExpertWeights.expert(e)`.
    """
    dtype = w.gate.dtype
    xw = x.astype(dtype)
    gate = jnp.dot(xw, w.gate, preferred_element_type=jnp.float32)  # [R, I]
    up = jnp.dot(xw, w.up, preferred_element_type=jnp.float32)  # [R, I]
    if w.gate_bias is not None:
        gate = gate + w.gate_bias.astype(jnp.float32)
        up = up + w.up_bias.astype(jnp.float32)
    h = gated_activation(gate, up, cfg, cfg.swiglu_limit)
    y = jnp.dot(h.astype(dtype), w.down, preferred_element_type=jnp.float32)  # [R, H]
    if w.down_bias is not None:
        y = y + w.down_bias.astype(jnp.float32)
    return y


def shared_expert_ffn(x: Array, shared: SharedParams, cfg: MoEConfig) -> Array:
    """The shared expert on all rows `x [T, H]` -> `[T, H]` float32, its sigmoid gate applied if it has one."""
    dtype = shared.gate.dtype
    xw = x.astype(dtype)
    gate = jnp.dot(xw, shared.gate, preferred_element_type=jnp.float32)
    up = jnp.dot(xw, shared.up, preferred_element_type=jnp.float32)
    h = gated_activation(gate, up, cfg, cfg.shared_swiglu_limit)
    y = jnp.dot(h.astype(dtype), shared.down, preferred_element_type=jnp.float32)
    if shared.gate_kernel is not None:
        g = jnp.dot(xw, shared.gate_kernel.astype(dtype), preferred_element_type=jnp.float32)  # [T, 1]
        y = jax.nn.sigmoid(g.astype(dtype).astype(jnp.float32)) * y
    return y


def slot_scales(routing: Routing, cfg: MoEConfig) -> tuple[Array, Array]:
    """Per slot `[T, K]`: the scale of the expert's input and the weight of its output.

    Normally the input is unscaled and the output weighted by the routing weight; Llama-4 scales the input
    and sums the outputs unweighted. Zero-computation experts get output weight 0 here (their identity term
    is added by the combine).
    """
    real = routing.indices < cfg.num_experts
    ones = jnp.ones_like(routing.weights)
    if cfg.weights_on_input:
        return routing.weights, jnp.where(real, ones, 0.0)
    return ones, jnp.where(real, routing.weights, 0.0)


def reference_routed(experts: ExpertWeights, x: Array, routing: Routing, cfg: MoEConfig) -> Array:
    """Dense float32 reference of `Σ_k w_k · E_{idx_k}(x)`: every expert on every token, masked. `[T, H]`."""
    E = cfg.num_experts
    experts32 = jax.tree.map(lambda w: w.astype(jnp.float32), experts)
    x32 = x.astype(jnp.float32)
    in_scale, out_weight = slot_scales(routing, cfg)
    # Dense [T, E] matrices from the slots (a zero-expert id has no column here: one_hot(.., E) drops it).
    chosen = jax.nn.one_hot(routing.indices, E, dtype=jnp.float32)  # [T, K, E]
    dense_in = jnp.einsum("tk,tke->te", in_scale, chosen)
    dense_out = jnp.einsum("tk,tke->te", out_weight, chosen)
    selected = chosen.sum(1) > 0  # [T, E]

    def one_expert(w: ExpertWeights, scale: Array, weight: Array, mask: Array) -> Array:
        inputs = x32 * scale[:, None] if cfg.weights_on_input else x32
        y = expert_ffn(inputs, w, cfg)  # [T, H]
        return jnp.where(mask[:, None], weight[:, None] * y, 0.0)

    per_expert = jax.vmap(one_expert)(experts32, dense_in.T, dense_out.T, selected.T)  # [E, T, H]
    return per_expert.sum(0)
