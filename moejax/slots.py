"""What the expert backends read besides the weights: the `Slots` of the routing, the activations; and the shared
expert.

The backends (`moejax.backends`) never see the config: they take the routed experts (any format,
`moejax.weights`), the expert input `x [T, H]`, the `Slots` (expert id, input scale and output weight of each
(token, slot) pair) and the `GatedActivation`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import Activation, MoEConfig
from moejax.lora import LoRAExpert, SharedLoRA, add_delta, pair_delta
from moejax.params import SharedParams
from moejax.routing import Routing
from moejax.weights import ExpertWeights
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
    adapter: `[T]` int32 adapter id of each row (already clamped into the stack's ids; 0 = none), or None
      without adapters. Read only by experts that adapt rows (their `row_ids`).
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
    `adapter`: the rows' adapter ids `[T]` (clamped), or None."""
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
    ops=None,
) -> Array:
    """The shared expert on all rows `x [T, H]` -> `[T, H]` float32, its sigmoid gate applied if it has one.

    `float32=True` computes in float32 whatever the weight dtype (the reference). `lora` (a stack's shared
    targets) and `adapter [T]` (the rows' ids) wrap the weights in a `moejax.lora.LoRAExpert` and add the rows'
    deltas to the sigmoid gate's logit before it is rounded and squashed. `ops`: the layer's native matmuls
    (`moejax.backends.native_ops.LayerOps`: its `shared_ffn` runs the FFN, the adapters' deltas included, its
    `matmul` the gate's `x @ w`), or None for `ExpertWeights.ffn` (`LoRAExpert.ffn`) and `jnp.dot`."""
    if float32:
        shared = jax.tree.map(lambda w: w.astype(jnp.float32), shared)
    w = ExpertWeights(shared.gate, shared.up, shared.down)
    if ops is not None:
        y = ops.shared_ffn(w, x, shared_activation(cfg), lora, adapter)
    elif lora is not None:
        y = LoRAExpert(w, lora).ffn(x, shared_activation(cfg), adapter)
    else:
        y = w.ffn(x, shared_activation(cfg))
    if shared.gate_kernel is not None:
        dtype = shared.gate.dtype
        if ops is None:
            g = jnp.dot(x.astype(dtype), shared.gate_kernel.astype(dtype), preferred_element_type=jnp.float32)
        else:
            g = ops.matmul(x.astype(dtype), shared.gate_kernel.astype(dtype))  # [T, 1]
        if lora is not None and lora.gate_kernel is not None:
            delta = pair_delta if ops is None else ops.lora_delta
            g = add_delta(g, delta(lora.gate_kernel, x, adapter), adapter)
        g = g.astype(dtype).astype(jnp.float32)
        y = (jax.nn.sigmoid(g) if ops is None else ops.scores("sigmoid", g)) * y
    return y
