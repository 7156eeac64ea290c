"""One of the two processes of tests/test_multihost.py: `moe_forward_ep` over a mesh that spans both processes.

Usage: `python tests/multihost_worker.py PROCESS_ID PORT OUT.npz` (the test sets XLA_FLAGS for 2 CPU devices per
process). Each process builds the same inputs from the same seed, runs both EP modes over the 4 global devices
and writes the full results. jax is imported inside the functions, so the test can import `config` and
`make_inputs` without touching its own jax set-up.
"""

import os
import sys

NUM_PROCESSES = 2
T_DECODE = 8  # replicated mode: tokens on every device
T_PREFILL = 12  # all_to_all mode: 3 tokens per device, sharded over the 4 global devices


def config():
    from moejax import MoEConfig

    # Gated shared expert (added once, after the psum) and zero-computation experts (LongCat's identity term).
    return MoEConfig.preset(
        "longcat_flash",
        hidden_size=32,
        intermediate_size=16,
        num_experts=8,
        num_zero_experts=4,
        shared_expert="sigmoid_gated",
        shared_intermediate_size=16,
    )


def numpy_params(cfg, seed: int):
    """Random `MoEParams` for `cfg` drawn with numpy (the distributions of `moejax.init_params`): the same values
    in every process, and no random-number program to compile."""
    import jax.numpy as jnp
    import numpy as np

    from moejax.params import expected_shapes, unflatten

    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "router.tid2eid":
            flat[name] = jnp.asarray(rng.integers(0, cfg.num_selectable, shape, dtype=np.int32))
            continue
        if name.endswith("bias"):
            value = 0.1 * rng.standard_normal(shape)
        elif name in ("router.scale", "router.per_expert_scale", "expert_norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-2])
        flat[name] = jnp.asarray(value, jnp.float32)
    return unflatten(flat)


def make_inputs(cfg, seed: int = 0):
    """params, x_decode [T_DECODE, H], x_prefill [T_PREFILL, H] (numpy float32), the same in every process."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    x_decode = rng.standard_normal((T_DECODE, cfg.hidden_size), np.float32)
    x_prefill = rng.standard_normal((T_PREFILL, cfg.hidden_size), np.float32)
    return numpy_params(cfg, seed), x_decode, x_prefill


def main(process_id: int, port: int, out_path: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process_id
    )
    import functools

    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moejax.parallel import moe_forward_ep
    from moejax.sharding import shard_params

    cfg = config()
    params, x_decode, x_prefill = make_inputs(cfg)
    mesh = jax.make_mesh((jax.device_count(),), ("expert",))  # the global devices of both processes

    def place(host, spec):
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])

    sharded = shard_params(params, cfg, mesh)
    ep = functools.partial(moe_forward_ep, cfg=cfg, mesh=mesh)
    y_replicated = jax.jit(functools.partial(ep, mode="replicated"))(sharded, place(x_decode, P()))
    y_all_to_all = jax.jit(functools.partial(ep, mode="all_to_all"))(sharded, place(x_prefill, P("expert")))
    np.savez(
        out_path,
        replicated=multihost_utils.process_allgather(y_replicated, tiled=True),
        all_to_all=multihost_utils.process_allgather(y_all_to_all, tiled=True),
        global_devices=jax.device_count(),
        local_devices=jax.local_device_count(),
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
