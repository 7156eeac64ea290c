"""`save_layer` / `save_adapter` as transactions: killed at every file-system step, failing with ENOSPC at every
write, racing another writer, inside a Hugging Face cache snapshot, given an index that points outside, a wrong
config, or an adapter directory to merge into. After each, the directory holds the whole old or the whole new
checkpoint (moejax's `load_layer` and, where torch is installed, transformers' `from_pretrained`), and a retry
succeeds.

The checkpoint is tests/fixtures/qwen3_moe_sharded (a tiny Qwen3-MoE saved by transformers over 7 shards; each
layer's block spans two; tests/fixtures/make_qwen3_moe_sharded.py).

How the kills are placed (`Steps`): the saving process wraps the file-system calls a save makes (opening a file
for writing, writing its bytes, `os.fsync`, `os.replace` / `os.rename`, `os.unlink` / `os.remove`, safetensors'
`save_file`) and numbers them; at step N it SIGKILLs itself (`os.kill(os.getpid(), SIGKILL)`; in a write, after
half the bytes), or raises `OSError(ENOSPC)`. Kills run in one child process (`python tests/test_hf_writes.py
jobs.json`, the `children` fixture) that imports moejax once, counts the steps of a save, then forks one
grandchild per step N, each saving into its own copy of the checkpoint with numpy params (no jax backend is
started before a fork); the test process then checks every copy. The torch/transformers checks are skipped
where those are not installed; everything else runs everywhere (POSIX: fork, flock).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings

import jax
import numpy as np
import pytest

import moejax
from moejax import hf, lora

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen3_moe_sharded")
PEFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "peft")
LAYERS = (0, 1, 2)
SAVED = 1  # the layer the sweeps save
INDEX = "model.safetensors.index.json"


# -- numbered file-system steps ----------------------------------------------------------------------------------


class Steps:
    """Numbers the file-system steps of a save and acts at step `at` (1-based): "kill" (SIGKILL this process),
    "fail" (raise OSError(ENOSPC)), or "sleep" (every step waits `pause` s: widens race windows).

    `kinds` restricts which steps count: "open" (a file opened for writing), "write" (its bytes; the action comes
    after half), "fsync" (of a file), "dirsync" (of a directory), "rename", "unlink", "save_file" (safetensors'
    own writer). `where` restricts to paths containing that text."""

    ALL = ("open", "write", "fsync", "dirsync", "rename", "unlink", "save_file")
    WRITES = ("open", "write", "fsync", "rename", "save_file")

    def __init__(self, at=0, action="kill", kinds=ALL, where="", pause=0.0):
        self.at, self.action, self.kinds, self.where, self.pause = at, action, kinds, where, pause
        self.count = 0
        self.log = []

    def step(self, kind, path=""):
        if kind not in self.kinds or self.where not in str(path):
            return
        self.count += 1
        self.log.append((kind, os.path.basename(str(path))))
        if self.action == "sleep":
            time.sleep(self.pause)
        elif self.count == self.at:
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def install(self, setattr_):
        """Wrap the calls with `setattr_(owner, name, value)` (pytest's monkeypatch.setattr, or plain setattr in a
        child that dies anyway)."""
        import safetensors.numpy

        real_open, real_fsync = builtins.open, os.fsync
        real = {name: getattr(os, name) for name in ("replace", "rename", "unlink", "remove")}

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if any(c in mode for c in "wxa+"):
                self.step("open", file)
                write = f.write

                def write_(data):
                    if "write" in self.kinds and self.where in str(file) and self.count + 1 == self.at:
                        write(memoryview(data)[: len(data) // 2])  # a half-written file
                        f.flush()
                    self.step("write", file)
                    return write(data)

                with contextlib.suppress(AttributeError):
                    f.write = write_
            return f

        def fsync_(fd):
            self.step("dirsync" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync", _fd_path(fd))
            return real_fsync(fd)

        def wrap(name, kind):
            def call(path, *args, **kwargs):
                self.step(kind, path)
                return real[name](path, *args, **kwargs)

            return call

        real_save_file = safetensors.numpy.save_file

        def save_file_(tensors, filename, *args, **kwargs):
            self.step("save_file", filename)
            return real_save_file(tensors, filename, *args, **kwargs)

        setattr_(builtins, "open", open_)
        setattr_(os, "fsync", fsync_)
        for name, kind in (("replace", "rename"), ("rename", "rename"), ("unlink", "unlink"), ("remove", "unlink")):
            setattr_(os, name, wrap(name, kind))
        setattr_(safetensors.numpy, "save_file", save_file_)


def _fd_path(fd):
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}")
    return ""


# -- the child: one process, a grandchild per kill -----------------------------------------------------------------


def _run_op(op, directory):
    """What the child's grandchildren run (numpy params only: the grandchild never starts a jax backend)."""
    with open(op["params"], "rb") as f:
        payload = pickle.load(f)
    if op["kind"] == "layer":
        hf.save_layer(directory, op["layer"], payload)
    else:
        for layer, adapter, cfg in payload:
            hf.save_adapter(adapter, cfg, layer, directory, family="qwen3_moe")


def _fork(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return pid


def _sweep(job):
    """Count the steps of the job's op on a copy of its base, then kill a grandchild at each step."""
    count_file = os.path.join(job["work"], "count")

    def dry():
        steps = Steps(at=0)
        steps.install(setattr)
        _run_op(job["op"], os.path.join(job["work"], "dry"))
        total = steps.count  # before the count file's own open
        with open(count_file, "w") as f:
            f.write(str(total))

    shutil.copytree(job["base"], os.path.join(job["work"], "dry"), symlinks=True)
    os.waitpid(_fork(dry), 0)
    with open(count_file) as f:
        total = int(f.read())
    results = []
    for at in range(1, total + 1):
        directory = os.path.join(job["work"], f"kill{at:03d}")
        shutil.copytree(job["base"], directory, symlinks=True)

        def killed(at=at, directory=directory):
            Steps(at=at).install(setattr)
            _run_op(job["op"], directory)

        _, status = os.waitpid(_fork(killed), 0)
        results.append({"at": at, "dir": directory, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0})
    return {"total": total, "results": results}


def _concurrent(job):
    """The job's ops in two grandchildren started together, each step of each slowed down (overlapping saves)."""
    read_end, write_end = os.pipe()
    pids = []
    for op in job["ops"]:

        def writer(op=op):
            Steps(action="sleep", pause=0.02).install(setattr)
            os.read(read_end, 1)  # start together
            _run_op(op, job["dir"])

        pids.append(_fork(writer))
    os.write(write_end, b"go")
    return {"status": [os.waitpid(pid, 0)[1] for pid in pids]}


def _child(spec_path):
    with open(spec_path) as f:
        jobs = json.load(f)
    out = {name: (_sweep if job["mode"] == "sweep" else _concurrent)(job) for name, job in jobs.items()}
    print(json.dumps(out))


# -- checking a directory ------------------------------------------------------------------------------------------


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _same(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=False)
    )


@pytest.fixture(scope="module")
def blocks():
    """{layer: numpy params of the fixture} and the new params of SAVED (every float doubled)."""
    old = {layer: _numpy(hf.load_layer(FIXTURE, layer, layout="stacked")[1]) for layer in LAYERS}
    new = jax.tree.map(lambda w: w * 2 if w.dtype.kind == "f" else w, old[SAVED])
    return old, new


@pytest.fixture(scope="module")
def children(tmp_path_factory, blocks):
    """One child process runs the kill sweeps of save_layer and save_adapter and the concurrent writers (a child
    imports moejax once: each kill is a forked grandchild); {job: its results} and what the tests compare with."""
    old, new = blocks
    tmp = tmp_path_factory.mktemp("children")
    jobs, context = {}, {}

    (tmp / "layer").mkdir()
    (tmp / "layer.pkl").write_bytes(pickle.dumps(new))
    op = {"kind": "layer", "layer": SAVED, "params": str(tmp / "layer.pkl")}
    jobs["layer"] = {"mode": "sweep", "base": FIXTURE, "work": str(tmp / "layer"), "op": op}

    (tmp / "adapter").mkdir()
    v0 = _adapter(_cfg(0), 1, 2.0)
    hf.save_adapter(v0, _cfg(0), 0, tmp / "adapter" / "base", family="qwen3_moe")
    saves = [(1, _adapter(_cfg(1), 2, 0.5, rank=3), _cfg(1)), (0, _adapter(_cfg(0), 3, 8.0), _cfg(0))]
    (tmp / "adapter.pkl").write_bytes(pickle.dumps(saves))
    op = {"kind": "adapter", "params": str(tmp / "adapter.pkl")}
    jobs["adapter"] = {"mode": "sweep", "base": str(tmp / "adapter" / "base"), "work": str(tmp / "adapter"), "op": op}
    context |= {"adapter_v0": v0, "adapter_saves": saves}

    directory = tmp / "concurrent"
    shutil.copytree(FIXTURE, directory)
    ops, want = [], {}
    for layer in (0, 2):
        want[layer] = jax.tree.map(lambda w: w * 3 if w.dtype.kind == "f" else w, old[layer])
        (tmp / f"concurrent{layer}.pkl").write_bytes(pickle.dumps(want[layer]))
        ops.append({"kind": "layer", "layer": layer, "params": str(tmp / f"concurrent{layer}.pkl")})
    jobs["concurrent"] = {"mode": "concurrent", "dir": str(directory), "ops": ops}
    context |= {"concurrent_dir": directory, "concurrent_want": want}

    (tmp / "jobs.json").write_text(json.dumps(jobs))
    root = os.path.dirname(os.path.dirname(os.path.abspath(moejax.__file__)))  # the moejax this process runs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(tmp / "jobs.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | context


def _state(directory, old, new, saved=SAVED):
    """ "old" or "new" for layer `saved` (every other layer must be old); AssertionError when a layer is neither
    or fails to load."""
    which = None
    for layer in LAYERS:
        got = _numpy(hf.load_layer(directory, layer, layout="stacked")[1])
        if layer != saved:
            assert _same(got, old[layer]), f"{directory}: layer {layer} changed"
            continue
        which = "old" if _same(got, old[layer]) else "new" if _same(got, new) else None
        assert which, f"{directory}: layer {layer} is neither the old block nor the new one"
    return which


def _referenced(directory):
    with open(os.path.join(directory, INDEX)) as f:
        return set(json.load(f)["weight_map"].values())


def _assert_clean(directory):
    """Only the checkpoint's files: config, index, the shards the index names (and the lock file)."""
    files = set(os.listdir(directory)) - {".moejax.lock"}
    assert files == {"config.json", INDEX} | _referenced(directory), sorted(files)


def _assert_leftovers(directory):
    """What a killed save may leave beside the checkpoint: temporary files, and the journal with the files it
    names (unreferenced new shards, or old ones the index no longer names), which the next save removes."""
    journal = os.path.join(directory, ".moejax-journal.json")
    named = set()
    if os.path.exists(journal):
        with open(journal) as f:
            record = json.load(f)
        named = {*record["created"], *record["obsolete"]}
    allowed = {"config.json", INDEX, ".moejax.lock", ".moejax-journal.json"} | _referenced(directory) | named
    extra = [f for f in os.listdir(directory) if f not in allowed and ".moejax-tmp-" not in f]
    assert not extra, (directory, extra)


def _transformers_state(directory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
            directory, output_loading_info=True, local_files_only=True
        )
    assert not info["missing_keys"] and not info["mismatched_keys"], (directory, info)
    return {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}


def _check_transformers(directory, original):
    """from_pretrained loads every key; layer SAVED's block is wholly the original or wholly doubled."""
    state = _transformers_state(directory)
    block = [k for k in state if k.startswith(f"model.layers.{SAVED}.mlp.")]
    assert block
    for key, value in state.items():
        if key not in block:
            np.testing.assert_array_equal(value, original[key], err_msg=key)
    doubled = [np.array_equal(state[k], 2 * original[k]) for k in block]
    same = [np.array_equal(state[k], original[k]) for k in block]
    assert all(doubled) or all(same), f"{directory}: {sum(doubled)} of {len(block)} tensors new, {sum(same)} old"


def _have_transformers():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# -- save_layer -------------------------------------------------------------------------------------------------


def test_kill_sweep_save_layer(children, blocks):
    """SIGKILL at every step of a save: each copy is the whole old or the whole new checkpoint for moejax and
    transformers, holds at most what the next save removes, and a retry succeeds."""
    old, new = blocks
    out = children["layer"]
    original = _transformers_state(FIXTURE) if _have_transformers() else None
    seen = []
    for result in out["results"]:
        directory = result["dir"]
        assert result["signal"] == signal.SIGKILL, result
        seen.append(_state(directory, old, new))
        _assert_leftovers(directory)
        if original is not None:
            _check_transformers(directory, original)
        hf.save_layer(directory, SAVED, new)  # the retry
        assert _state(directory, old, new) == "new"
        _assert_clean(directory)
    assert out["total"] >= 10 and "old" in seen and "new" in seen, (out["total"], seen)


def _write_steps(directory, new):
    """The number of write steps of saving `new` into a copy of the fixture (a dry run in this process)."""
    steps = Steps(action="none", kinds=Steps.WRITES)
    with pytest.MonkeyPatch.context() as mp:
        steps.install(mp.setattr)
        hf.save_layer(directory, SAVED, new)
    return steps.count


def test_enospc_at_every_write_step(tmp_path, blocks):
    """OSError(ENOSPC) at each write step: the save raises, the checkpoint is the old one with nothing left over,
    and a retry succeeds."""
    old, new = blocks
    shutil.copytree(FIXTURE, tmp_path / "dry")
    total = _write_steps(tmp_path / "dry", new)
    assert total >= 5
    for at in range(1, total + 1):
        directory = tmp_path / f"fail{at}"
        shutil.copytree(FIXTURE, directory)
        with pytest.MonkeyPatch.context() as mp:
            Steps(at=at, action="fail", kinds=Steps.WRITES).install(mp.setattr)
            with pytest.raises(OSError) as error:
                hf.save_layer(directory, SAVED, new)
        assert error.value.errno == errno.ENOSPC
        assert _state(directory, old, new) == "old", at
        _assert_clean(directory)
        hf.save_layer(directory, SAVED, new)
        assert _state(directory, old, new) == "new", at
        _assert_clean(directory)


def test_concurrent_writers(children, blocks):
    """Two processes save layers 0 and 2 of one checkpoint at once: both blocks are saved and load."""
    old, _ = blocks
    out, directory, want = children["concurrent"], children["concurrent_dir"], children["concurrent_want"]
    assert out["status"] == [0, 0]
    for layer in LAYERS:
        got = _numpy(hf.load_layer(directory, layer, layout="stacked")[1])
        assert _same(got, want.get(layer, old[layer])), layer
    _assert_clean(directory)


def test_a_second_writer_waits_for_the_lock(tmp_path, blocks):
    old, new = blocks
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    held = open(tmp_path / "ckpt" / ".moejax.lock", "w")  # noqa: SIM115 (closed by the timer)
    fcntl.flock(held, fcntl.LOCK_EX)
    timer = threading.Timer(0.5, held.close)
    timer.start()
    start = time.monotonic()
    hf.save_layer(tmp_path / "ckpt", SAVED, new)
    assert time.monotonic() - start >= 0.5
    timer.join()
    assert _state(tmp_path / "ckpt", old, new) == "new"


def test_a_held_lock_times_out_naming_it(tmp_path, blocks, monkeypatch):
    from moejax.hf import transaction

    _, new = blocks
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    before = {f: (tmp_path / "ckpt" / f).read_bytes() for f in os.listdir(tmp_path / "ckpt")}
    monkeypatch.setattr(transaction, "LOCK_TIMEOUT_S", 0.2)
    with open(tmp_path / "ckpt" / ".moejax.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match=r"\.moejax\.lock is held by another writer"):
            hf.save_layer(tmp_path / "ckpt", SAVED, new)
    assert {f: (tmp_path / "ckpt" / f).read_bytes() for f in before} == before


def _snapshot(tmp_path):
    """A Hugging Face cache: blobs/<sha256> and snapshots/rev1, rev2 whose files are symlinks into blobs."""
    cache = tmp_path / "models--tiny"
    (cache / "blobs").mkdir(parents=True)
    for rev in ("rev1", "rev2"):
        (cache / "snapshots" / rev).mkdir(parents=True)
    for name in os.listdir(FIXTURE):
        with open(os.path.join(FIXTURE, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        (cache / "blobs" / blob).write_bytes(data)
        for rev in ("rev1", "rev2"):
            os.symlink(f"../../blobs/{blob}", cache / "snapshots" / rev / name)
    return cache


def _tree(path):
    """{relative path: bytes or link target} of everything under `path`."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            key = os.path.relpath(full, path)
            if os.path.islink(full):
                out[key] = ("link", os.readlink(full))
            else:
                with open(full, "rb") as f:
                    out[key] = f.read()
    return out


def test_saving_into_a_cache_snapshot_leaves_blobs_and_other_revisions(tmp_path, blocks):
    old, new = blocks
    cache = _snapshot(tmp_path)
    blobs, rev2 = _tree(cache / "blobs"), _tree(cache / "snapshots" / "rev2")
    rev1 = cache / "snapshots" / "rev1"
    hf.save_layer(rev1, SAVED, new)
    assert _tree(cache / "blobs") == blobs
    assert _tree(cache / "snapshots" / "rev2") == rev2
    assert _state(cache / "snapshots" / "rev2", old, new) == "old"
    assert _state(rev1, old, new) == "new"
    assert not os.path.islink(rev1 / INDEX)
    _assert_clean(rev1)


def test_an_index_entry_outside_the_directory_is_refused(tmp_path, blocks):
    _, new = blocks
    directory, other = tmp_path / "ckpt", tmp_path / "other"
    shutil.copytree(FIXTURE, directory)
    other.mkdir()
    index = json.loads((directory / INDEX).read_text())
    shard = index["weight_map"][f"model.layers.{SAVED}.mlp.gate.weight"]  # holds part of the block saved
    shutil.move(directory / shard, other / "x.safetensors")
    index["weight_map"] = {k: "../other/x.safetensors" if v == shard else v for k, v in index["weight_map"].items()}
    (directory / INDEX).write_text(json.dumps(index))
    outside, inside = (other / "x.safetensors").read_bytes(), _tree(directory)
    with pytest.raises(ValueError, match=r"\.\./other/x\.safetensors"):
        hf.save_layer(directory, SAVED, new)
    assert (other / "x.safetensors").read_bytes() == outside
    assert {k: v for k, v in _tree(directory).items() if k != ".moejax.lock"} == inside


def test_a_wrong_hf_config_raises_before_anything_is_written(tmp_path, blocks):
    _, new = blocks
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    before = _tree(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    with pytest.raises(ValueError):
        hf.save_layer(tmp_path / "ckpt", SAVED, new, hf_config={**config, "hidden_size": 32})
    assert {k: v for k, v in _tree(tmp_path / "ckpt").items() if k != ".moejax.lock"} == before


# -- journals a save did not write -----------------------------------------------------------------------------

JOURNAL = ".moejax-journal.json"
_SHA = "sha"  # stands for the SHA-256 of the directory's index in a journal below


# name -> the journal (a JSON value, or raw bytes) left in the directory; "live" stands for a shard the index uses.
_FOREIGN_JOURNALS = {
    "index null": {"index": None, "created": ["config.json", "generation_config.json", "live"], "obsolete": []},
    "another index": {
        "index": INDEX,
        "index_sha256": ["0" * 64, "1" * 64],
        "created": ["spare.safetensors"],
        "obsolete": ["live"],
    },
    "no digests": {"index": INDEX, "created": ["spare.safetensors"], "obsolete": ["config.json"]},
    "not a shard": {"index": INDEX, "index_sha256": [_SHA, _SHA], "created": [], "obsolete": ["tokenizer.json"]},
    "non-string entry": {"index": INDEX, "index_sha256": [_SHA, _SHA], "created": [1], "obsolete": []},
    "a string for a list": {"index": INDEX, "index_sha256": [_SHA, _SHA], "created": "config.json", "obsolete": []},
    "outside": {"index": INDEX, "index_sha256": [_SHA, _SHA], "created": ["../ckpt2/x.safetensors"], "obsolete": []},
    "not JSON": b'{"index": "model.safetensors.index.json", "created": ["spare.safetensors"',
}


@pytest.mark.parametrize("case", list(_FOREIGN_JOURNALS))
def test_a_journal_not_its_own_deletes_nothing(tmp_path, blocks, case):
    """A stale, foreign or malformed journal is refused, naming it and what to do, and no file goes (config,
    generation config, tokenizer, a live shard, an unreferenced shard of the user's); once it is deleted, the
    save succeeds."""
    old, new = blocks
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, directory)
    (directory / "generation_config.json").write_text('{"do_sample": true}')
    (directory / "tokenizer.json").write_text("{}")
    shutil.copy(directory / sorted(_referenced(directory))[0], directory / "spare.safetensors")
    live = json.loads((directory / INDEX).read_text())["weight_map"][f"model.layers.{SAVED}.mlp.gate.weight"]
    journal = _FOREIGN_JOURNALS[case]
    if not isinstance(journal, bytes):
        sha = hashlib.sha256((directory / INDEX).read_bytes()).hexdigest()
        journal = json.dumps(journal).replace('"live"', json.dumps(live)).replace(f'"{_SHA}"', json.dumps(sha))
        journal = journal.encode()
    (directory / JOURNAL).write_bytes(journal)
    before = _tree(directory)
    with pytest.raises(ValueError, match=rf"{re.escape(str(directory / JOURNAL))} was not written by .*delete"):
        hf.save_layer(directory, SAVED, new)
    assert {k: v for k, v in _tree(directory).items() if k != ".moejax.lock"} == before
    assert _state(directory, old, new) == "old"
    os.unlink(directory / JOURNAL)
    hf.save_layer(directory, SAVED, new)
    assert _state(directory, old, new) == "new"
    assert {"generation_config.json", "tokenizer.json", "spare.safetensors"} <= set(os.listdir(directory))


def test_its_own_journal_removes_only_unreferenced_shards(tmp_path, blocks):
    """A journal whose recorded index is the one on disk: the shards it names that the index does not reference
    go, the ones it references stay."""
    old, new = blocks
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, directory)
    live = sorted(_referenced(directory))[0]
    shutil.copy(directory / live, directory / "model-moejax-layer-00001.safetensors")
    sha = hashlib.sha256((directory / INDEX).read_bytes()).hexdigest()
    record = {"index": INDEX, "index_sha256": [sha, "0" * 64], "created": ["model-moejax-layer-00001.safetensors"]}
    (directory / JOURNAL).write_text(json.dumps(record | {"obsolete": [live]}))
    hf.save_layer(directory, SAVED, new)
    assert _state(directory, old, new) == "new"
    _assert_clean(directory)


# -- save_adapter -----------------------------------------------------------------------------------------------


def _cfg(layer):
    return hf.config_from_hf(json.loads(open(os.path.join(FIXTURE, "config.json")).read()), layer)


def _adapter(cfg, seed, scale, rank=2):
    """A numpy LoRA adapter of the router and the routed experts (gate and up share A: one gate_up target)."""
    rng = np.random.default_rng(seed)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    s = np.float32(scale)
    a = f(E, rank, H)
    return lora.LoRAParams(
        router=lora.LoRAPair(f(rank, H), f(E, rank), s),
        experts=lora.ExpertLoRA(
            gate=lora.LoRAPair(a, f(E, I, rank), s),
            up=lora.LoRAPair(a, f(E, I, rank), s),
            down=lora.LoRAPair(f(E, rank, I), f(E, H, rank), s),
        ),
    )


def _deltas(adapter):
    return {
        name: float(p.scale) * np.einsum("...or,...ri->...oi", np.asarray(p.b, np.float64), np.asarray(p.a))
        for name, p in adapter.pairs().items()
    }


def _assert_deltas(got, want, what):
    a, b = _deltas(got), _deltas(want)
    assert set(a) == set(b), what
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {name}")


def _which(directory, layer, versions):
    """The version (index into `versions`, None: the layer has no weights) the adapter of `layer` is."""
    try:
        got = hf.load_adapter(directory, _cfg(layer), layer)
    except ValueError as e:
        assert f"no weights for layer {layer}" in str(e), e
        return None
    for i, want in enumerate(versions):
        a, b = _deltas(got), _deltas(want)
        if set(a) == set(b) and all(np.allclose(a[n], b[n], rtol=1e-5, atol=1e-6) for n in a):
            return i
    raise AssertionError(f"{directory}: layer {layer}'s adapter is none of its versions")


def test_save_adapter_merges_layers(tmp_path):
    first, second = _adapter(_cfg(0), 1, 2.0), _adapter(_cfg(1), 2, 0.5, rank=3)
    hf.save_adapter(first, _cfg(0), 0, tmp_path, family="qwen3_moe")
    hf.save_adapter(second, _cfg(1), 1, tmp_path, family="qwen3_moe")
    _assert_deltas(hf.load_adapter(tmp_path, _cfg(0), 0), first, "layer 0")
    _assert_deltas(hf.load_adapter(tmp_path, _cfg(1), 1), second, "layer 1")
    again = _adapter(_cfg(0), 3, 8.0)  # re-saved with another scale: the config keeps layer 0's alpha
    config = (tmp_path / "adapter_config.json").read_text()
    hf.save_adapter(again, _cfg(0), 0, tmp_path, family="qwen3_moe")
    assert (tmp_path / "adapter_config.json").read_text() == config
    _assert_deltas(hf.load_adapter(tmp_path, _cfg(0), 0), again, "layer 0 again")
    _assert_deltas(hf.load_adapter(tmp_path, _cfg(1), 1), second, "layer 1 kept")
    assert sorted(os.listdir(tmp_path)) == [".moejax.lock", "adapter_config.json", "adapter_model.safetensors"]


def test_save_adapter_into_a_peft_adapter_keeps_its_other_tensors(tmp_path):
    case = os.path.join(PEFT, "qwen3_moe_all")
    directory = tmp_path / "adapter"
    shutil.copytree(case, directory)
    with open(os.path.join(case, "config.json")) as f:
        cfg = hf.config_from_hf(json.load(f), 1)
    head = hf.files.header(str(directory / "adapter_model.safetensors"))[1]
    keys = sorted(k for k in head if k != "__metadata__")
    original = hf.files.read_file(str(directory / "adapter_model.safetensors"), keys)
    layer0 = hf.load_adapter(directory, cfg, 0)
    loaded = hf.load_adapter(directory, cfg, 1)
    edited = lora.LoRAParams(
        router=lora.LoRAPair(loaded.router.a, loaded.router.b * 3, loaded.router.scale * 2),
        experts=loaded.experts,
    )
    hf.save_adapter(edited, cfg, 1, directory, family="qwen3_moe")
    after = hf.files.read_file(str(directory / "adapter_model.safetensors"), keys)  # every key still there
    for key in keys:
        if ".layers.1.mlp.gate." not in key:
            np.testing.assert_array_equal(after[key], original[key], err_msg=key)
    _assert_deltas(hf.load_adapter(directory, cfg, 1), edited, "layer 1")
    _assert_deltas(hf.load_adapter(directory, cfg, 0), layer0, "layer 0")


def test_save_adapter_refuses_a_conflicting_config(tmp_path):
    directory = tmp_path / "adapter"
    shutil.copytree(os.path.join(PEFT, "qwen3_moe_down"), directory)  # use_rslora: true
    before = _tree(directory)
    with pytest.raises(ValueError, match="use_rslora"):
        hf.save_adapter(_adapter(_cfg(1), 1, 1.0), _cfg(1), 1, directory, family="qwen3_moe")
    with pytest.raises(ValueError, match="auto_mapping"):
        hf.save_adapter(_adapter(_cfg(1), 1, 1.0), _cfg(1), 1, directory, family="mixtral", use_rslora=True)
    assert {k: v for k, v in _tree(directory).items() if k != ".moejax.lock"} == before


def test_a_failed_adapter_weights_write_leaves_the_old_adapter(tmp_path, monkeypatch):
    """ENOSPC while the weights are written, saving another alpha at the same rank (the config is kept, B
    rescaled) and at another rank (the config changes): the old adapter loads with the alphas of its own
    weights."""
    old = _adapter(_cfg(0), 1, 2.0)
    hf.save_adapter(old, _cfg(0), 0, tmp_path, family="qwen3_moe")
    for rank in (2, 4):
        with monkeypatch.context() as mp:
            Steps(at=1, action="fail", kinds=("write", "save_file"), where="adapter_model").install(mp.setattr)
            with pytest.raises(OSError):
                hf.save_adapter(_adapter(_cfg(0), 2, 8.0, rank=rank), _cfg(0), 0, tmp_path, family="qwen3_moe")
        _assert_deltas(hf.load_adapter(tmp_path, _cfg(0), 0), old, f"the old adapter (rank {rank} failed)")
        assert sorted(os.listdir(tmp_path)) == [".moejax.lock", "adapter_config.json", "adapter_model.safetensors"]


def test_kill_sweep_save_adapter(children):
    """SIGKILL at every step of two saves into an adapter holding layer 0 (layer 1 added at another rank, then
    layer 0 re-saved with another scale): each layer loads as one whole version, and a retry succeeds."""
    out, v0, saves = children["adapter"], children["adapter_v0"], children["adapter_saves"]
    seen = set()
    for result in out["results"]:
        directory = result["dir"]
        assert result["signal"] == signal.SIGKILL, result
        one, zero = _which(directory, 1, [saves[0][1]]), _which(directory, 0, [v0, saves[1][1]])
        assert zero is not None
        assert zero == 0 or one == 0  # layer 0 is re-saved after layer 1
        seen.add((one, zero))
        for layer, adapter, cfg in saves:  # the retry
            hf.save_adapter(adapter, cfg, layer, directory, family="qwen3_moe")
        assert (_which(directory, 1, [saves[0][1]]), _which(directory, 0, [v0, saves[1][1]])) == (0, 1)
        assert sorted(os.listdir(directory)) == [".moejax.lock", "adapter_config.json", "adapter_model.safetensors"]
    assert out["total"] >= 10 and seen == {(None, 0), (0, 0), (0, 1)}, (out["total"], seen)


if __name__ == "__main__":
    _child(sys.argv[1])
