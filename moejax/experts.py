"""Expert math over a weight format's operations: the slots the plans consume, the shared expert, the reference.

The plans never see the config: they take the routed experts (any format, `moejax.weights`), the expert input
`x [T, H]`, the `Slots` (expert id, input scale and output weight of each (token, slot) pair) and the
`GatedActivation`. `reference_routed` is the oracle every plan and kernel is tested against: every expert on
every token in float32, one expert at a time (memory O(T·H) at any E), masked by the slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import Activation, MoEConfig
from moejax.lora import ExpertLoRA, SharedLoRA, add_delta, expert_ffn, pair_delta
from moejax.params import SharedParams
from moejax.routing import Routing
from moejax.weights import Experts, ExpertWeights, as_stacked
from pallas_kernels.activations import GatedActivation

Array = jax.Array

_ACTIVATION_KINDS = {Activation.SILU: "silu", Activation.GELU_TANH: "gelu_tanh", Activation.GPT_OSS: "gpt_oss"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """What the routed-expert plans read of the routing, per (token, slot) pair `[T, K]`.

    indices: int32 expert ids; ids >= the number of experts the plan holds (zero-computation experts, experts on
      another device) are skipped: never computed, their weights never read.
    out_weight: float32 weight of the slot's output (0 for skipped slots).
    in_scale: float32 scale of the slot's input (Llama-4), or None for unscaled inputs.
    adapter: `[T]` int32 LoRA adapter id of each row (already clamped into the stack's ids; 0 = none), or None
      without adapters. Read only when the plan is given `lora=`.
    """

    indices: Array
    out_weight: Array
    in_scale: Array | None = None
    adapter: Array | None = None

    @property
    def num_rows(self) -> int:
        return self.indices.shape[0]


def expert_activation(cfg: MoEConfig) -> GatedActivation:
    """The routed experts' gated activation of `cfg`."""
    return GatedActivation(_ACTIVATION_KINDS[cfg.activation], cfg.swiglu_limit, cfg.clamp_order.value, cfg.swiglu_alpha)


def shared_activation(cfg: MoEConfig) -> GatedActivation:
    """The shared expert's gated activation (its own clamp)."""
    return dataclasses.replace(expert_activation(cfg), limit=cfg.shared_swiglu_limit)


def slots_from_routing(routing: Routing, cfg: MoEConfig, adapter: Array | None = None) -> Slots:
    """The slots of `routing`: normally the output weighted by the routing weight; Llama-4 scales the input and
    sums the outputs unweighted. Zero-computation experts get output weight 0 (the combine adds their term).
    `adapter`: the rows' LoRA adapter ids `[T]` (clamped), or None."""
    real = routing.indices < cfg.num_experts
    if cfg.weights_on_input:
        return Slots(routing.indices, jnp.where(real, 1.0, 0.0).astype(jnp.float32), routing.weights, adapter)
    return Slots(routing.indices, jnp.where(real, routing.weights, 0.0), None, adapter)


def combine_slots(per_slot: Array, out_weight: Array) -> Array:
    """`Σ_k w[t, k] · y[t, k]` `[T, K, H] -> [T, H]` in slot order; slots with weight 0 contribute exactly 0 (even
    if y is not finite: those are unvisited or skipped slots)."""
    weighted = jnp.where(out_weight[..., None] != 0, out_weight[..., None] * per_slot, 0.0)
    return weighted.sum(1)


def shared_expert_ffn(
    x: Array,
    shared: SharedParams,
    cfg: MoEConfig,
    *,
    float32: bool = False,
    lora: SharedLoRA | None = None,
    adapter: Array | None = None,
) -> Array:
    """The shared expert on all rows `x [T, H]` -> `[T, H]` float32, its sigmoid gate applied if it has one.

    `float32=True` computes in float32 whatever the weight dtype (the reference). `lora` (a stack's shared
    targets) and `adapter [T]` (the rows' ids) add the rows' deltas to gate/up/down (`moejax.lora.expert_ffn`) and
    to the sigmoid gate's logit before it is rounded and squashed."""
    if float32:
        shared = jax.tree.map(lambda w: w.astype(jnp.float32), shared)
    y = expert_ffn(ExpertWeights(shared.gate, shared.up, shared.down), x, shared_activation(cfg), lora, adapter)
    if shared.gate_kernel is not None:
        dtype = shared.gate.dtype
        g = jnp.dot(x.astype(dtype), shared.gate_kernel.astype(dtype), preferred_element_type=jnp.float32)  # [T, 1]
        if lora is not None:
            g = add_delta(g, pair_delta(lora.gate_kernel, x, adapter), adapter)
        y = jax.nn.sigmoid(g.astype(dtype).astype(jnp.float32)) * y
    return y


def reference_routed(
    experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, lora: ExpertLoRA | None = None
) -> Array:
    """Dense float32 reference of `Σ_k w_k · E_{idx_k}(s_k · x)` `[T, H]`: every expert on every token, masked.

    A scan over experts dequantizes one expert at a time to float32 (`ExpertFormat.dequantize`), so memory
    stays O(T·H + one expert's weights) at any E. A row that picks an expert in two slots (hash routing) sums
    their input scales, as the models do. With `lora` (a stack's expert targets) each row gets the deltas of its
    adapter `slots.adapter` (`moejax.lora.expert_ffn`). Differentiable (the backward of every other plan).
    """
    adapter = check_lora_slots(lora, slots)
    experts = as_stacked(experts)
    E = experts.num_experts
    chosen = jax.nn.one_hot(slots.indices, E, dtype=jnp.float32)  # [T, K, E]; skipped ids have no column
    out_w = jnp.einsum("tk,tke->et", slots.out_weight, chosen)  # [E, T]
    in_scale = jnp.ones_like(slots.out_weight) if slots.in_scale is None else slots.in_scale
    scale = jnp.einsum("tk,tke->et", in_scale.astype(jnp.float32), chosen)  # [E, T]
    selected = chosen.sum(1).T > 0  # [E, T]
    x32 = x.astype(jnp.float32)

    def one_expert(acc: Array, e: Array) -> tuple[Array, None]:
        rows = x32 if slots.in_scale is None else x32 * scale[e][:, None]
        one_lora = None if lora is None else lora.expert(e)
        y = expert_ffn(experts.expert(e).dequantize(), rows, act, one_lora, adapter)  # [T, H]
        return acc + jnp.where(selected[e][:, None], out_w[e][:, None] * y, 0.0), None

    out, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), jnp.arange(E))
    return out


def check_lora_slots(lora: ExpertLoRA | None, slots: Slots) -> Array | None:
    """The rows' adapter ids the plans use with `lora` (None without it); `ValueError` when `lora` is given and
    `slots.adapter` is missing or not `[T]`."""
    if lora is None:
        return None
    T = slots.indices.shape[0]
    if slots.adapter is None or tuple(slots.adapter.shape) != (T,):
        got = None if slots.adapter is None else tuple(slots.adapter.shape)
        raise ValueError(f"lora given: slots.adapter must be [T]=({T},) int32 adapter ids, got {got}")
    return slots.adapter
