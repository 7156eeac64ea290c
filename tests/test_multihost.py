"""Multi-host EP: two processes on localhost (2 CPU devices each, gloo collectives) run `moe_forward_ep` over the
4 global devices; both must return the single-process `moe_forward` result."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import multihost_worker as worker
import numpy as np

import moejax

TIMEOUT_S = 120
WORKER = Path(worker.__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_single_process(tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        # The suite's cheap pipeline (conftest.py): compiles several times faster; the results are checked to the
        # same tolerance.
        "XLA_FLAGS": " ".join(
            [
                "--xla_force_host_platform_device_count=2",
                "--xla_backend_optimization_level=0",
                "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false",
            ]
        ),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(WORKER.parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    outs = [tmp_path / f"process{i}.npz" for i in range(worker.NUM_PROCESSES)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outs)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:  # one failed or hung process would leave the other waiting on the coordinator
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]

    cfg = worker.config()
    params, x_decode, x_prefill = worker.make_inputs(cfg)
    forward = jax.jit(moejax.moe_forward, static_argnums=2)
    expected = {"replicated": forward(params, x_decode, cfg), "all_to_all": forward(params, x_prefill, cfg)}
    for out in outs:
        got = np.load(out)
        assert int(got["global_devices"]) == 4 and int(got["local_devices"]) == 2
        for mode, ref in expected.items():
            np.testing.assert_allclose(got[mode], ref, rtol=2e-5, atol=2e-5, err_msg=f"{out.name} {mode}")
