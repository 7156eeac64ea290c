"""Expert parallelism (EP) and tensor parallelism (TP) of the MoE block: `moe_forward_ep` (a thin alias of
`moejax.moe_forward` with an EP dispatch, `moejax.dispatch`) and the communication volume of the two EP modes.
The placement of the parameters on a mesh is `moejax.sharding` (`shard_params`, `shard_lora`, `partition_specs`);
the modes and their buffers are `moejax.dispatch` (`EP_MODES`, `all_to_all_capacity`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from moejax.config import MoEConfig, SharedExpert
from moejax.dispatch import CAPACITY_FACTOR, EP_MODES, EPMode, all_to_all_capacity, expert_parallel
from moejax.forward import ExpertStep, MoEOutput, add_once_terms, moe_forward
from moejax.lora import ExpertLoRA, LoRAParams
from moejax.placement import Placement
from moejax.routing import Routing

Array = jax.Array

__all__ = ["add_once", "communication_bytes", "moe_forward_ep", "partial_routed_sum"]


def moe_forward_ep(
    params,
    x: Array,
    cfg: MoEConfig,
    *,
    mesh: Mesh,
    expert_axis: str = "expert",
    tensor_axis: str | None = None,
    mode: EPMode = "replicated",
    token_ids: Array | None = None,
    impl: str = "auto",
    return_stats: bool = False,
    placement: Placement | None = None,
    capacity_factor: float = CAPACITY_FACTOR,
    lora: LoRAParams | None = None,
    adapter_ids: Array | None = None,
    routing: Routing | None = None,
    return_routing: bool = False,
) -> Array | MoEOutput:
    """`moejax.moe_forward` with the routed experts split over `expert_axis` of `mesh`. Jit-able.

    The same as `moe_forward(params, x, cfg, token_ids, impl, dispatch=moejax.dispatch.expert_parallel(mode,
    mesh, ...), ...)`.

    Args:
      params: `MoEParams`, best placed by `shard_params` (other placements are resharded by XLA, and per-expert
        experts are stacked on every call).
      x: `[..., H]` block input.
      cfg: the block's math (static).
      mesh: a mesh with `expert_axis` (and `tensor_axis`); may span several processes.
      expert_axis: the axis the experts (and, in "all_to_all" mode, the tokens) are split over.
      tensor_axis: optional axis the intermediate dims I and Is are split over.
      mode: "replicated" (tokens on every device, one psum: `moejax.dispatch.EPPsum`) or "all_to_all" (tokens
        split, dispatch/combine: `moejax.dispatch.EPAllToAll`).
      token_ids: `[...]` integer token ids (hash routing).
      impl: routed implementation as in `moe_forward` ("auto" picks the decode plan for at most 8 rows).
      return_stats: also return the call's routing statistics, `moejax.stats.MoEStats` (per-device fields over
        the expert axis), computed on device.
      routing: a `moejax.Routing` to replay instead of routing (as in `moe_forward`).
      return_routing: also return the `moejax.Routing` used.
      placement: a `moejax.placement.Placement` over the expert axis; `params` then hold the experts in its slot
        order (`shard_params(..., placement=placement)`, which records it in `params.placement`; another one
        raises), and each pair runs on one replica of its expert. Static (hashable): a new placement compiles a
        new program.
      capacity_factor: "all_to_all" mode: the dispatch and compute buffers hold this many times the load of uniform
        routing (`all_to_all_capacity`); a heavier load is still computed exactly, in more rounds or chunks.
      lora: an adapter stack (`moejax.lora.stack`), best placed by `shard_lora` (each expert's adapters with the
        expert; with a `placement`, in its slot order); as in `moe_forward`.
      adapter_ids: `[...]` int32 adapter id of each row (0: none; ids outside [0, n] count as 0), with `lora`. In
        "all_to_all" mode each dispatched row carries its id.
    Returns:
      `y [..., H]` in x's dtype, with x's sharding type (on a mesh with Explicit axes, x made without a mesh
      gives y without one); with `return_stats` and/or `return_routing`, a `moejax.MoEOutput` (`.y`, `.stats`,
      `.routing`) as `moe_forward` returns it.

    Raises:
      ValueError: unknown mode or impl, a mesh axis missing, E not divisible by the expert-axis size (without a
        placement), a placement that does not fit or is not the one `params` were laid out by, a capacity_factor
        that is not > 0, or the shape errors of `moe_forward`.
      NotImplementedError: an impl that runs the Pallas kernels on a CPU mesh of more than one device
        (`check_kernels_can_run`).
    """
    dispatch = expert_parallel(
        mode,
        mesh,
        expert_axis=expert_axis,
        tensor_axis=tensor_axis,
        placement=placement,
        capacity_factor=capacity_factor,
    )
    return moe_forward(
        params,
        x,
        cfg,
        token_ids,
        impl,
        lora=lora,
        adapter_ids=adapter_ids,
        return_stats=return_stats,
        routing=routing,
        return_routing=return_routing,
        dispatch=dispatch,
    )


def partial_routed_sum(
    experts,
    x_e: Array,
    slots,
    cfg: MoEConfig,
    *,
    impl: str,
    num_pairs: int,
    lora: ExpertLoRA | None = None,
) -> Array:
    """This device's share of `Σ_k w_k·E_k(x_e)` `[R, H]` float32 over its local experts `[E/n, ...]`, the slots
    in local ids (`moejax.dispatch.localize`): the pipeline's expert step (`moejax.forward.ExpertStep`)."""
    return ExpertStep(impl, experts, cfg, lora)(x_e, slots, num_pairs=num_pairs)


def add_once(routed: Array, x_e: Array, routing, shared, cfg: MoEConfig, *, tensor_axis: str | None = None, **kw):
    """`moejax.forward.add_once_terms` with the shared expert's partial sums reduced over `tensor_axis`."""
    reduce = None if tensor_axis is None else functools.partial(jax.lax.psum, axis_name=tensor_axis)
    return add_once_terms(routed, x_e, routing, shared, cfg, reduce_shared=reduce, **kw)


def communication_bytes(
    cfg: MoEConfig,
    num_tokens: int,
    *,
    mode: EPMode,
    expert_size: int,
    tensor_size: int = 1,
    dtype: jnp.dtype = jnp.float32,
    capacity_factor: float = CAPACITY_FACTOR,
    adapters: bool = False,
) -> dict[str, int]:
    """Bytes one device sends per `moe_forward_ep` call, from the shapes (the static buffers, whatever the routing).

    A psum over g devices is counted as a ring all-reduce, `2·(g-1)/g` of the buffer; an all-to-all over n devices
    sends `(n-1)/n` of its buffer (the block for the device itself stays). Inputs are taken as already placed
    (replicated for "replicated", split for "all_to_all"). "all_to_all" is counted for one round, which holds the
    load of uniform routing times `capacity_factor` (`all_to_all_capacity`); a call whose routing overflows a
    block runs more rounds, each sending as much again. With `adapters` (a call with LoRA), each "all_to_all" row
    carries its int32 adapter id too.

    Returns:
      {"dispatch": tokens and slot metadata sent, "combine": partial results sent back, "reduce": psums, "total"}.
    """
    n, tp, H, K = expert_size, tensor_size, cfg.hidden_size, cfg.top_k
    itemsize, f32 = jnp.dtype(dtype).itemsize, 4

    def all_reduce(group: int, nbytes: int) -> int:
        return 2 * (group - 1) * nbytes // group

    shared = cfg.shared_expert is not SharedExpert.NONE and tp > 1
    if mode == "replicated":
        reduce = all_reduce(n * tp, num_tokens * H * f32) + shared * all_reduce(tp, num_tokens * H * f32)
        sizes = {"dispatch": 0, "combine": 0, "reduce": reduce}
    elif mode == "all_to_all":
        rows_per_block, _ = all_to_all_capacity(cfg, num_tokens, n, capacity_factor)
        sent_rows = (n - 1) * rows_per_block  # [n, rows] minus this device's own block
        sizes = {
            # token row + int32 ids and weights per slot (+ the row's adapter id)
            "dispatch": sent_rows * (H * itemsize + (2 * K + adapters) * 4),
            "combine": sent_rows * H * f32,
            "reduce": (1 + shared) * all_reduce(tp, -(-num_tokens // n) * H * f32),
        }
    else:
        raise ValueError(f"mode={mode!r} is not one of {EP_MODES}")
    return {**sizes, "total": sum(sizes.values())}
