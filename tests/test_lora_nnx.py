"""`moejax.MoE` with LoRA adapters: held as `moejax.LoRAParam`, trained alone by an optimizer over that type, and the
same output on an expert-parallel mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import moejax
from moejax.lora import ExpertLoRA, LoRAPair, LoRAParams, stack

CFG = moejax.MoEConfig.preset("qwen3_moe", hidden_size=16, num_experts=8, top_k=2, intermediate_size=8)


def adapter(rank: int, seed: int) -> LoRAParams:
    """Router and routed-expert adapter with random A and B."""
    rng = np.random.default_rng(seed)
    H, I, E = CFG.hidden_size, CFG.intermediate_size, CFG.num_experts

    def pair(lead, n_in, n_out):
        a = rng.standard_normal((*lead, rank, n_in)) / np.sqrt(n_in)
        b = 0.1 * rng.standard_normal((*lead, n_out, rank))
        return LoRAPair(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.float32(1.0))

    experts = ExpertLoRA(gate=pair((E,), H, I), up=pair((E,), H, I), down=pair((E,), I, H))
    return LoRAParams(router=pair((), H, E), experts=experts)


def test_optimizer_over_lora_params_trains_only_the_adapters():
    layer = moejax.MoE(CFG, rngs=nnx.Rngs(0), lora=stack([adapter(2, 1), adapter(4, 2)]))
    assert isinstance(layer.lora.experts.gate.a, moejax.LoRAParam)
    optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=moejax.LoRAParam)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, CFG.hidden_size)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((8, CFG.hidden_size)), jnp.float32)
    ids = jnp.asarray([0, 1, 2, 1, 2, 1, 2, 1], jnp.int32)

    def loss_fn(layer):
        return jnp.mean((layer(x, adapter_ids=ids) - target) ** 2)

    @nnx.jit
    def step(layer, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, moejax.LoRAParam))(layer)
        optimizer.update(layer, grads)
        return loss

    before = {kind: nnx.clone(nnx.state(layer, kind)) for kind in (nnx.Param, moejax.LoRAParam)}
    losses = [float(step(layer, optimizer)) for _ in range(6)]
    assert losses[-1] < losses[0]
    unchanged = jax.tree.map(np.array_equal, before[nnx.Param], nnx.state(layer, nnx.Param))
    assert all(jax.tree.leaves(unchanged)), "an optimizer over LoRAParam moved a base weight"
    after = nnx.state(layer, moejax.LoRAParam)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before[moejax.LoRAParam], after)
    assert any(jax.tree.leaves(changed))
    np.testing.assert_array_equal(layer.lora_params.router.scale, [0.0, 1.0, 1.0])  # scales are buffers


def test_layer_on_an_expert_mesh_applies_the_adapters_like_one_device():
    lora = stack([adapter(2, 1), adapter(4, 2)])
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    sharded = moejax.MoE(CFG, rngs=nnx.Rngs(0), mesh=mesh, lora=lora)
    assert sharded.lora.experts.up.b.sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, None)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, CFG.hidden_size)), jnp.float32)
    ids = jnp.asarray([1, 0, 2, 1], jnp.int32)
    y = nnx.jit(lambda layer, x, ids: layer(x, adapter_ids=ids))(sharded, x, ids)
    params = jax.tree.map(jnp.asarray, jax.device_get(sharded.params))  # one device
    forward = jax.jit(lambda p, x, l, i: moejax.moe_forward(p, x, CFG, lora=l, adapter_ids=i))
    expected = forward(params, x, lora, ids)
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5)


def test_set_lora_errors():
    layer = moejax.MoE(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no adapters"):
        layer(jnp.zeros((1, CFG.hidden_size)), adapter_ids=jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="stack"):
        layer.set_lora(adapter(2, 0))
    layer.set_lora(stack([adapter(2, 0)]))
    layer.set_lora(None)
    assert layer.lora is None and layer.lora_params is None
