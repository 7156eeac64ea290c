"""The "ragged" backend: grouped prefill on `jax.lax.ragged_dot`, XLA's own grouped matmul (a native kernel on TPU
and GPU).

Same contract as the other backends (`moejax.backends`): float32 `[T, H]` `Σ_k w_k · E_k(s_k · x)`, skipped ids
(outside [0, E)) contribute nothing, Llama-4's input scaling through `Slots.in_scale`.

1. Stable argsort of the T·K (token, slot) pairs by expert id; skipped ids sort last. `group_sizes[e]` counts
   expert e's pairs; rows past `Σ group_sizes` (the skipped pairs) belong to no group, and `ragged_dot` leaves
   them zero.
2. `ragged_dot(rows [M, H], gate [E, H, I], group_sizes)` and likewise up: every row multiplied by its own
   expert's weights, float32 accumulation; biases gathered per sorted row; the activation in float32; h cast
   to the weight dtype; `ragged_dot(h, down)`.
3. Un-sort to `[T, K, H]` and sum each row's slots with its weights in slot order.

Where it runs: `impl="ragged"` anywhere; `impl="auto"` only in programs lowered for TPU or GPU (decided while
lowering, `on_accelerators`), never on CPU: XLA:CPU expands `ragged_dot` into a dense product over all E experts
(E times the FLOPs), which is correct (the tests run it there) but slow.

Weights: stacked dense `ExpertWeights`. Quantized formats raise `NotImplementedError` (ragged_dot takes a dense
right operand: dequantizing would materialise every expert's weights on each call; the Pallas kernels read the
codes instead), and so do wrappers of a format (the XLA plans run them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.backends.xla import computed_slots
from moejax.slots import Slots
from moejax.weights import Experts, ExpertWeights
from pallas_kernels.activations import GatedActivation
from pallas_kernels.platform import choose_at_lowering

Array = jax.Array

ACCELERATORS = ("cuda", "rocm", "tpu")


def ragged_grouped(experts: Experts, x: Array, slots: Slots, act: GatedActivation, *, block_rows=None) -> Array:
    """Routed output `[T, H]` float32 by three `ragged_dot`s over pairs sorted by expert (module docstring).

    Args:
      experts: stacked `ExpertWeights` `[E, H, I]` / `[E, I, H]` (bf16, f16 or f32), biases optional.
      x: `[T, H]` rows. slots: `[T, K]` ids, output weights and optional input scales. act: the activation.
      block_rows: ignored (ragged_dot takes the groups as they are).

    Raises:
      NotImplementedError: other weight formats, layouts or wrappers.
    """
    del block_rows
    if type(experts) is not ExpertWeights:
        raise NotImplementedError(
            f"ragged_grouped: reads stacked dense ExpertWeights, got {type(experts).__name__} (ragged_dot takes a "
            "dense right operand)"
        )
    T, K = slots.indices.shape
    E = experts.num_experts
    M = T * K
    dtype = experts.dtype

    valid = computed_slots(slots.indices, E)  # [T, K]
    expert_of_pair = jnp.where(valid, slots.indices, E).reshape(-1)  # [M]; skipped ids -> E, sorted last
    order = jnp.argsort(expert_of_pair, stable=True)  # [M] the pair at each sorted row
    sorted_expert = jnp.minimum(expert_of_pair[order], E - 1)  # [M] (clamped: for bias gathers only)
    group_sizes = jnp.bincount(expert_of_pair, length=E + 1)[:E].astype(jnp.int32)  # [E]
    rows = x[order // K].astype(jnp.float32)  # [M, H]
    if slots.in_scale is not None:
        rows = rows * slots.in_scale.reshape(-1)[order][:, None]
    rows = rows.astype(dtype)

    def grouped_dot(lhs: Array, rhs: Array, bias: Array | None) -> Array:
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        return out if bias is None else out + bias.astype(jnp.float32)[sorted_expert]

    gate = grouped_dot(rows, experts.gate, experts.gate_bias)  # [M, I]
    up = grouped_dot(rows, experts.up, experts.up_bias)  # [M, I]
    h = act(gate, up).astype(dtype)  # [M, I]
    y = grouped_dot(h, experts.down, experts.down_bias)  # [M, H]
    # Un-sort by a gather (XLA:TPU compiles a [M, H] scatter far more slowly); skipped pairs' rows are zero.
    sorted_row = jnp.zeros(M, jnp.int32).at[order].set(jnp.arange(M, dtype=jnp.int32))  # [M] each pair's row
    per_pair = y[sorted_row].reshape(T, K, -1)  # [T, K, H]
    # Masked by the id, not the weight (as the reference): a chosen expert of weight 0 adds nothing but has a
    # weight gradient, which `combine_slots`' mask by weight would cut, as ragged is differentiated as it is.
    return jnp.where(valid[..., None], slots.out_weight[..., None] * per_pair, 0.0).sum(1)


def on_accelerators(run, fallback, *operands) -> Array:
    """`run(*operands)` in a program lowered for TPU or GPU, `fallback(*operands)` elsewhere (CPU, or several
    platforms at once), decided while lowering by the platform alone (`pallas_kernels.platform.choose_at_lowering`
    with `by_platform`: the program need not hold one mesh, so an expert-parallel call on the Auto view of an
    Explicit mesh may take it, `moejax.dispatch.ep`)."""
    choose = lambda platform, device_kinds: 0 if platform in ACCELERATORS else 1
    return choose_at_lowering(choose, (run, fallback), *operands, by_platform=True)
