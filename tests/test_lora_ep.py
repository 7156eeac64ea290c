"""LoRA adapters under expert parallelism (8 simulated CPU devices) against the single-device `moe_forward`.

One jitted program per mesh runs both modes ("replicated" on a decode batch, "all_to_all" on a prefill batch) with a
mixed batch of adapter ids (0, both adapters, and an out-of-range id that counts as 0) on a config with a sigmoid-
gated shared expert, every target adapted (router, routed experts, shared expert and its gate).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from multihost_worker import numpy_params

import moejax
from moejax import parallel, sharding
from moejax.lora import ExpertLoRA, LoRAPair, LoRAParams, SharedLoRA, stack
from moejax.placement import balance

TOL = {"rtol": 2e-5, "atol": 2e-5}
CFG = moejax.MoEConfig.preset("qwen3_next", hidden_size=32, intermediate_size=16, shared_intermediate_size=16)


def random_adapter(cfg: moejax.MoEConfig, rank: int, seed: int) -> LoRAParams:
    """One adapter on every target of `cfg` (router, routed experts, shared expert and its gate), A and B random."""
    rng = np.random.default_rng(seed)
    H, I, E, Is = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.shared_intermediate_size

    def pair(lead, n_in, n_out):
        a = rng.standard_normal((*lead, rank, n_in)) / np.sqrt(n_in)
        b = rng.standard_normal((*lead, n_out, rank)) / np.sqrt(rank)
        return LoRAPair(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.float32(2.0 / rank))

    return LoRAParams(
        router=pair((), H, cfg.num_selectable),
        experts=ExpertLoRA(gate=pair((E,), H, I), up=pair((E,), H, I), down=pair((E,), I, H)),
        shared=SharedLoRA(gate=pair((), H, Is), up=pair((), H, Is), down=pair((), Is, H), gate_kernel=pair((), H, 1)),
    )


@functools.cache
def _case(t_replicated: int, t_all_to_all: int):
    """(params, lora, xd, xf, ids_d, ids_f) and the single-device outputs."""
    params = numpy_params(CFG, 0)
    lora = stack([random_adapter(CFG, 2, 1), random_adapter(CFG, 4, 2)])
    rng = np.random.default_rng(3)
    xd, xf = (jnp.asarray(rng.standard_normal((t, CFG.hidden_size)), jnp.float32) for t in (t_replicated, t_all_to_all))
    pattern = np.array([0, 1, 2, 7])  # 0: none; 7 is outside the stack (ids 0..2): counts as 0
    ids_d, ids_f = (jnp.asarray(pattern[np.arange(t) % 4], jnp.int32) for t in (t_replicated, t_all_to_all))
    inputs = (params, lora, xd, xf, ids_d, ids_f)
    return inputs, _reference(*inputs)


@jax.jit
def _reference(params, lora, xd, xf, ids_d, ids_f):
    fwd = functools.partial(moejax.moe_forward, cfg=CFG, lora=lora)
    return fwd(params, xd, adapter_ids=ids_d), fwd(params, xf, adapter_ids=ids_f)


@functools.cache
def _both_modes(mesh: Mesh, tensor_axis: str | None = None):
    def run(params, lora, xd, xf, ids_d, ids_f):
        ep = functools.partial(parallel.moe_forward_ep, cfg=CFG, mesh=mesh, tensor_axis=tensor_axis, lora=lora)
        yd = ep(params, xd, mode="replicated", adapter_ids=ids_d)
        return yd, ep(params, xf, mode="all_to_all", adapter_ids=ids_f)

    return jax.jit(run)


@pytest.mark.parametrize(
    ("shape", "tensor_axis", "tokens"),
    [((8,), None, (8, 7)), ((2, 4), "tensor", (12, 13))],
    ids=["expert8", "expert2xtensor4"],
)
def test_ep_with_adapters_equals_single_device(shape, tensor_axis, tokens):
    (params, lora, xd, xf, ids_d, ids_f), (ref_d, ref_f) = _case(*tokens)
    axes = ("expert",) if tensor_axis is None else ("expert", "tensor")
    mesh = Mesh(np.array(jax.devices()[: np.prod(shape)]).reshape(shape), axes)
    sharded = sharding.shard_params(params, CFG, mesh, tensor_axis=tensor_axis)
    placed = sharding.shard_lora(lora, CFG, mesh, tensor_axis=tensor_axis)
    # each expert's adapters live with the expert; the intermediate axes split where the weights split them
    n_e = mesh.shape["expert"]
    assert placed.experts.gate.a.sharding.spec == P(None, "expert", None, None)
    assert placed.experts.gate.b.sharding.spec == P(None, "expert", tensor_axis, None)
    assert placed.experts.down.a.sharding.spec == P(None, "expert", None, tensor_axis)
    assert placed.experts.down.a.sharding.shard_shape(placed.experts.down.a.shape)[1] == CFG.num_experts // n_e
    assert placed.shared.up.b.sharding.spec == P(None, tensor_axis, None)
    assert placed.router.a.sharding.spec == P() and placed.shared.gate_kernel.b.sharding.spec == P()
    run = _both_modes(mesh, tensor_axis)
    yd, yf = run(sharded, placed, xd, xf, ids_d, ids_f)
    np.testing.assert_allclose(yd, ref_d, **TOL)
    np.testing.assert_allclose(yf, ref_f, **TOL)
    # the adapters changed the rows that have one (ids 1, 2), and only those: against the same program with ids 0
    base_d, base_f = run(sharded, placed, xd, xf, jnp.zeros_like(ids_d), jnp.zeros_like(ids_f))
    for y, base, ids in ((yd, base_d, ids_d), (yf, base_f, ids_f)):
        changed = np.abs(np.asarray(y) - np.asarray(base)).max(-1) > 1e-4
        np.testing.assert_array_equal(changed, np.isin(ids, [1, 2]))


def test_adapter_checks_name_the_argument():
    (params, lora, xd, _, ids_d, _), _ = _case(8, 7)
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    ep = functools.partial(parallel.moe_forward_ep, cfg=CFG, mesh=mesh)
    with pytest.raises(ValueError, match="adapter_ids"):
        ep(params, xd, lora=lora)
    with pytest.raises(ValueError, match="adapter_ids"):
        ep(params, xd, lora=lora, adapter_ids=ids_d[:3])
    with pytest.raises(ValueError, match="lora"):
        ep(params, xd, adapter_ids=ids_d)


def test_adapters_follow_a_placement():
    """With hot experts replicated (`placement`), each slot holds its expert's adapters: same output as one device."""
    (params, lora, xd, _, ids_d, _), (ref_d, _) = _case(8, 7)
    n = 2
    mesh = Mesh(np.array(jax.devices()[:n]), ("expert",))
    load = np.arange(CFG.num_experts, dtype=np.float64) ** 2
    placement = balance(load, num_devices=n, num_slots=CFG.num_experts + 2 * n)
    placed = sharding.shard_lora(lora, CFG, mesh, placement=placement)
    np.testing.assert_array_equal(placed.experts.up.b, lora.experts.up.b[:, np.asarray(placement.slot_expert)])
    with pytest.raises(ValueError, match="num_slots"):
        parallel.moe_forward_ep(params, xd, CFG, mesh=mesh, placement=placement, lora=lora, adapter_ids=ids_d)
    run = jax.jit(functools.partial(parallel.moe_forward_ep, cfg=CFG, mesh=mesh, placement=placement))
    sharded = sharding.shard_params(params, CFG, mesh, placement=placement)
    np.testing.assert_allclose(run(sharded, xd, lora=placed, adapter_ids=ids_d), ref_d, **TOL)
