"""EP "all_to_all" over `jax.lax.ragged_all_to_all` (moejax/dispatch/ep_all_to_all.py, `transport=`).

XLA:CPU has no ragged all-to-all (jax 0.10.2: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so
on 8 CPU devices the ragged transport runs with `emulated_ragged_all_to_all` in the collective's place: a jnp
emulation written from the docstring of `jax.lax.ragged_all_to_all`, itself checked against a literal
per-element numpy model of that docstring. Through it the transport's offsets and sizes give results bit-equal to
the dense transport (whole blocks) and equal to the psum mode and the single-device forward, at routings with empty
destinations, every row on one expert and more rows than one round holds. The real collective is compiled
deviceless for TPU v5e (4 chips) and, with the cuda-compile extra, for 4 H100s: the compiled programs hold it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax import dispatch as D
from moejax.dispatch import ep_all_to_all
from moejax.sharding import shard_map, shard_params

# Read by libtpu when a TPU topology is first built (as tests/test_tpu_compile.py).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

TOL = {"rtol": 2e-5, "atol": 2e-5}
N = 8
CFG = moejax.MoEConfig.preset("qwen3_moe", num_experts=16, top_k=2, hidden_size=32, intermediate_size=16)
T = 37  # 5 rows per device, the last three padding
# Blocks of C=3 rows (`all_to_all_capacity(CFG, T, N, 0.5)`): the sizes sent vary in 0..3, and a device holding
# every row's experts gets its 5 rows from each device in two rounds (3 + 2).
CAPACITY = 0.5
IMPL = "reference"  # the transport does not depend on the plan; the reference compiles fastest


# -- the emulation and its model -----------------------------------------------------------------------------


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """`jax.lax.ragged_all_to_all` in jnp, from its docstring: slice i of this device (`operand[input_offsets[i]:
    ][:send_sizes[i]]`) goes to device i // (L/n); the receiver writes the slice it gets as its own slice j at
    `all_to_all(output_offsets, tiled)[j]`, `recv_sizes[j]` rows. Each slice travels padded to the operand's
    length in one `all_to_all`."""
    assert axis_index_groups is None
    n = jax.lax.axis_size(axis_name)
    L, rows = input_offsets.shape[0], operand.shape[0]
    data = operand.reshape(rows, -1)
    j = jnp.arange(rows)
    source = jnp.clip(input_offsets[:, None] + j, 0, rows - 1)  # [L, rows]
    slices = jnp.where((j < send_sizes[:, None])[..., None], data[source], 0)  # [L, rows, width]
    slices = jax.lax.all_to_all(slices.reshape(n, L // n, rows, -1), axis_name, 0, 0).reshape(L * rows, -1)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each received slice goes
    target = jnp.where(j < recv_sizes[:, None], at[:, None] + j, output.shape[0])  # [L, rows]; past the end: dropped
    flat = output.reshape(output.shape[0], -1)
    return flat.at[target.reshape(-1)].set(slices.astype(flat.dtype), mode="drop").reshape(output.shape)


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The docstring's pseudocode, one element at a time, over per-device lists of the arguments."""
    n = len(operands)
    results = [np.array(o, copy=True) for o in outputs]
    per = len(input_offsets[0]) // n
    for sender in range(n):
        for i in range(len(input_offsets[sender])):
            receiver, k = divmod(i, per)
            j = sender * per + k  # the slice's index on the receiver
            assert recv_sizes[receiver][j] == send_sizes[sender][i]
            for e in range(send_sizes[sender][i]):
                results[receiver][output_offsets[sender][i] + e] = operands[sender][input_offsets[sender][i] + e]
    return results


def _random_exchange(rng, n, per, rows, out_rows, width):
    """Per-device arguments of one ragged all-to-all: random slices (empty ones included) sent from random
    offsets, written into disjoint places on each receiver in a random order."""
    L = n * per
    sizes = rng.integers(0, 4, (n, L))  # [sender, slice]
    sizes[rng.random((n, L)) < 0.25] = 0
    input_offsets = np.stack([rng.integers(0, rows - s + 1) for s in sizes])
    output_offsets = np.zeros((n, L), np.int64)
    recv_sizes = np.zeros((n, L), np.int64)
    for receiver in range(n):
        incoming = [(s, receiver * per + k) for s in range(n) for k in range(per)]
        at = 0
        for idx in rng.permutation(len(incoming)):
            s, i = incoming[idx]
            at += int(rng.integers(0, 2))  # a gap, sometimes
            output_offsets[s, i] = at
            recv_sizes[receiver, (s * per) + i % per] = sizes[s, i]
            at += sizes[s, i]
        assert at <= out_rows
    operands = rng.standard_normal((n, rows, width)).astype(np.float32)
    outputs = np.full((n, out_rows, width), -1.0, np.float32)
    ints = [a.astype(np.int32) for a in (input_offsets, sizes, output_offsets, recv_sizes)]
    return operands, outputs, *ints


def test_the_emulation_follows_the_docstring_element_by_element():
    """The docstring's example on 2 devices (the model gives its stated result), then random exchanges on 8
    devices with 1 and 2 slices per device: the emulation equals the model, element for element."""
    example = (
        np.array([[1, 2, 2], [3, 4, 0]], np.float32)[..., None],
        np.zeros((2, 4, 1), np.float32),
        np.array([[0, 1], [0, 1]], np.int32),
        np.array([[1, 2], [1, 1]], np.int32),
        np.array([[0, 0], [1, 2]], np.int32),
        np.array([[1, 1], [2, 1]], np.int32),
    )
    np.testing.assert_array_equal(np.stack(numpy_ragged_all_to_all(*example))[..., 0], [[1, 3, 0, 0], [2, 2, 4, 0]])
    rng = np.random.default_rng(0)
    cases = [(2, example)]
    cases += [(N, _random_exchange(rng, N, per, rows=12, out_rows=N * per * 4, width=3)) for per in (1, 2)]
    emulated = lambda *args: emulated_ragged_all_to_all(*(a[0] for a in args), axis_name="x")[None]
    for n, args in cases:
        mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
        got = jax.jit(shard_map(emulated, mesh, P("x"), P("x")))(*args)
        np.testing.assert_array_equal(np.asarray(got), np.stack(numpy_ragged_all_to_all(*args)))


# -- the transport on 8 CPU devices --------------------------------------------------------------------------


def _routing(kind: str, rng) -> moejax.Routing:
    """A replayed routing of T rows: random; only the experts of devices 0, 3 and 7 (the others get nothing);
    every row's two slots on expert 5 (device 2 gets every row, every other device none)."""
    E, K = CFG.num_experts, CFG.top_k
    if kind == "random":
        indices = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    elif kind == "empty_destinations":
        indices = np.stack([rng.choice([0, 1, 6, 7, 14, 15], K, replace=False) for _ in range(T)])
    else:
        indices = np.full((T, K), 5)
    weights = rng.random((T, K)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    return moejax.Routing(jnp.asarray(indices, jnp.int32), jnp.asarray(weights), jnp.asarray(logits))


@functools.cache
def _program(mesh: Mesh):
    """One program: all_to_all with the ragged transport (emulated) and the dense one, the psum mode, and the
    single-device forward."""
    forward = functools.partial(moejax.moe_forward, cfg=CFG, impl=IMPL, return_stats=True)

    def run(params, sharded, x, routing):
        ep = {t: D.EPAllToAll(mesh, capacity_factor=CAPACITY, transport=t) for t in ("ragged", "dense")}
        return {
            **{t: forward(sharded, x, dispatch=d, routing=routing) for t, d in ep.items()},
            "psum": forward(sharded, x, dispatch=D.EPPsum(mesh), routing=routing),
            "local": forward(params, x, routing=routing),
        }

    return jax.jit(run)


def test_ragged_transport_equals_the_dense_one_and_the_psum_mode(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return emulated_ragged_all_to_all(*args, **kwargs)

    monkeypatch.setattr(ep_all_to_all, "ragged_all_to_all", counted)
    assert ep_all_to_all.all_to_all_capacity(CFG, T, N, CAPACITY)[0] == 3
    mesh = jax.make_mesh((N,), ("expert",), devices=jax.devices()[:N])
    params = moejax.init_params(CFG, jax.random.key(0))
    sharded = shard_params(params, CFG, mesh)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, CFG.hidden_size), np.float32))
    program = _program(mesh)
    for kind in ("random", "empty_destinations", "one_expert"):
        out = program(params, sharded, x, _routing(kind, rng))
        y, stats = out["ragged"].y, out["ragged"].stats
        y_dense, stats_dense = out["dense"].y, out["dense"].stats
        np.testing.assert_array_equal(y, y_dense, err_msg=kind)  # bit for bit
        jax.tree.map(np.testing.assert_array_equal, stats, stats_dense)
        np.testing.assert_allclose(y, out["psum"].y, **TOL, err_msg=kind)
        np.testing.assert_allclose(y, out["local"].y, **TOL, err_msg=kind)
        assert np.all(np.any(np.asarray(y)[:T] != 0, axis=-1)), kind  # every row got its experts' sum
        if kind == "one_expert":
            np.testing.assert_array_equal(stats.device_load, [0, 0, 2 * T, 0, 0, 0, 0, 0])
    # Dispatch (rows; ids; weights) and the way back: the emulation is what the program ran.
    assert len(calls) == 4


def test_auto_and_dense_programs_for_cpu_hold_no_ragged_all_to_all():
    """What the equality test cannot see: the program "auto" builds for CPU moves whole blocks (XLA:CPU could not
    run a ragged all-to-all), also its gradient (the choice is differentiable), and an explicit "ragged" holds
    one; an unknown transport is refused."""
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    params = shard_params(moejax.init_params(CFG, jax.random.key(0)), CFG, mesh)
    x = jax.device_put(jnp.zeros((4, CFG.hidden_size)), NamedSharding(mesh, P()))  # typed on the mesh: a backward
    texts = {}
    for transport in ("auto", "ragged", "dense"):
        dispatch = D.expert_parallel("all_to_all", mesh, transport=transport)
        fn = jax.jit(lambda p, x, d=dispatch: moejax.moe_forward(p, x, CFG, impl=IMPL, dispatch=d))
        texts[transport] = fn.lower(params, x).as_text()
        if transport == "auto":
            grad = jax.jit(jax.grad(lambda p, x, f=fn: f(p, x).sum(), argnums=1))
            texts["grad"] = grad.lower(params, x).as_text()
    for name in ("auto", "dense", "grad"):
        assert "ragged_all_to_all" not in texts[name] and "all_to_all" in texts[name], name
    assert "ragged_all_to_all" in texts["ragged"]
    with pytest.raises(ValueError, match="transport='nccl'"):
        D.EPAllToAll(mesh, transport="nccl")


# -- the real collective, compiled deviceless ------------------------------------------------------------------
# A small layer: the transport does not depend on its size (benchmarks/tpu_compile.py runs Qwen3-30B-A3B's).
LAYER = moejax.MoEConfig.preset("qwen3_moe", hidden_size=256, num_experts=8, top_k=2, intermediate_size=128)


def compile_ep(devices, platform: str, cfg=LAYER, tokens: int = 8, impl: str = "reference", transport="auto") -> dict:
    """Compile `moe_forward` in all_to_all mode over `devices` for `platform`, bf16 weights and x split over the
    expert axis: compile seconds, ragged all-to-alls in the compiled HLO (TPU: synchronous ops, CUDA: start/done
    pairs), and `memory_analysis` per device."""
    mesh = Mesh(np.array(devices), ("expert",))
    params = jax.eval_shape(lambda k: moejax.init_params(cfg, k, jnp.bfloat16, layout="stacked"), jax.random.key(0))
    place = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
    params = jax.tree.map(place, params, moejax.sharding.partition_specs(cfg))
    x = jax.ShapeDtypeStruct((tokens, cfg.hidden_size), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert")))
    dispatch = D.EPAllToAll(mesh, transport=transport)
    fn = jax.jit(lambda p, x: moejax.moe_forward(p, x, cfg, impl=impl, dispatch=dispatch))
    start = time.perf_counter()
    compiled = fn.trace(params, x).lower(lowering_platforms=(platform,)).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {
        "compile_s": round(seconds, 2),
        "ragged_all_to_all": len(re.findall(r"ragged-all-to-all(?:-start)?\(", compiled.as_text())),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
    }


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu-compile]"')
def test_compiled_for_tpu_v5e_the_program_holds_ragged_all_to_all():
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    row = compile_ep(devices, "tpu")
    print("\nTPU v5e x4 all_to_all:", row)
    assert row["ragged_all_to_all"] == 4, row  # the rows, their ids, their weights, the partial sums back
    assert 0 < row["argument_bytes"] + row["temp_bytes"] < 16 << 30, row  # within a v5e chip's HBM


def test_compiled_for_four_h100s_the_program_holds_ragged_all_to_all(monkeypatch):
    """The CUDA PJRT plugin's compile-only topology (tests/test_cuda_compile.py's route, here 4 GPUs in-process)."""
    import test_cuda_compile as cuda

    if reason := cuda._missing_extra():
        pytest.skip(reason)
    from jax.experimental import topologies

    monkeypatch.setenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA runtime here
    monkeypatch.setenv("PATH", f"{cuda._nvcc_bin()}{os.pathsep}{os.environ.get('PATH', '')}")  # XLA's ptxas
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x4", target_config=cuda.H100_TARGET_CONFIG)
    row = compile_ep(topology.devices, "cuda")
    print("\nH100 x4 all_to_all:", row)
    assert row["ragged_all_to_all"] == 4, row
