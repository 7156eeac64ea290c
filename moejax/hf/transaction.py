"""A directory update as a transaction: what `save_layer` and `save_adapter` write into a user's directory.

Readers (moejax, transformers, peft) open files by name, so a directory is consistent when every name points at
a complete file. The discipline is git's and SQLite's: write new, then rename.

1. `Transaction(path)` takes an exclusive lock (`fcntl.flock` on `.moejax.lock` in the directory; a second writer
   waits up to `LOCK_TIMEOUT_S`, then `TimeoutError` naming the lock file), finishes or undoes what a killed
   writer left (`recover`) and removes stale temporary files.
2. `create(name, data)` (a new file, e.g. a shard under a name no reader knows yet) and `replace(name, data)` (a
   file readers know: an index, a config) write `data` to a temporary file in the same directory and fsync it.
   Nothing a reader sees has changed yet: callers stage only after every validation.
3. `commit()`: a journal (`.moejax-journal.json`) names the files being created and the files that become
   obsolete (shards only: `.safetensors` names), and the SHA-256 of the index before and after the commit;
   the created files are renamed into place (unreferenced: readers do not see them), the directory fsynced;
   then each replaced name is swapped in with `os.replace`, in the order staged (the swap of the index is the
   moment readers switch from the old files to the new ones), the directory fsynced; then the obsolete files
   are removed and the journal last.

A crash at any point leaves temporary files and maybe the journal; the next transaction's `recover` keeps the
created / obsolete files the current index references and removes the others, so the directory holds exactly
the old checkpoint or exactly the new one. A journal is trusted only as far as it is provably its own: its
fields are lists of shard names inside the directory, and the index on disk is one of the two it recorded. Any
other journal (stale, from another tool, edited, or one without the digests) deletes nothing: it
is refused with a ValueError naming it, since a wrong guess would delete live files.

`os.replace` and `os.unlink` act on a name, never through it: a name that is a symlink (a Hugging Face cache
snapshot points into `blobs/`) is replaced by a regular file, and the blob it pointed to, shared with other
revisions, is never written or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import time
from typing import Any

LOCK = ".moejax.lock"
JOURNAL = ".moejax-journal.json"
SHARD_SUFFIX = ".safetensors"  # the only files a transaction creates under new names or makes obsolete
TEMP_MARK = ".moejax-tmp-"  # temporary names: f".{name}{TEMP_MARK}{random}", never a name a reader looks for
LOCK_TIMEOUT_S = 600.0
_POLL_S = 0.05


def inside(directory: str, entry: str, source: str) -> str:
    """The path of `entry` (a file name read from `source`, e.g. an index) joined to `directory`, or ValueError
    when it leaves the directory (an absolute path, `..`, a subdirectory that is a symlink to elsewhere).

    The file itself may be a symlink (cache snapshots): it is only ever read, replaced or unlinked by name."""
    path = os.path.join(directory, entry)
    base = os.path.realpath(directory)
    parent = os.path.realpath(os.path.dirname(path))
    if os.path.isabs(entry) or os.path.commonpath([base, parent]) != base or os.path.basename(path) in ("", ".", ".."):
        raise ValueError(f"{source}: entry {entry!r} points outside the directory {directory}; refusing to write there")
    return path


def _fsync_dir(path: str) -> None:
    """Make renames and deletions in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):  # file systems that do not sync directories
            raise
    finally:
        os.close(fd)


def _temporary(path: str, name: str) -> str:
    return os.path.join(path, f".{name}{TEMP_MARK}{secrets.token_hex(4)}")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _referenced(path: str, index: str | None) -> set[str]:
    """The file names the index in `path` references (none when it has no index)."""
    if index is None or not os.path.exists(os.path.join(path, index)):
        return set()
    with open(os.path.join(path, index)) as f:
        try:
            weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{os.path.join(path, index)} is not a valid index ({e}); fix or remove it") from None
    return {os.path.normpath(file) for file in weight_map.values()}


def _digest(path: str) -> str | None:
    """SHA-256 (hex) of the file `path`, None when there is none."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        return None


def _names(record: dict[str, Any], field: str, path: str, journal: str) -> list[str]:
    """The journal's `field`: a list of shard names inside `path`, else ValueError (`_foreign`)."""
    names = record.get(field)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _foreign(journal, f"{field!r} is {names!r:.200}, not a list of file names")
    for name in names:
        if not name.endswith(SHARD_SUFFIX):
            raise _foreign(journal, f"{field!r} names {name!r}, not a {SHARD_SUFFIX} shard")
        _inside(path, name, journal)
    return names


def _inside(path: str, name: str, journal: str) -> None:
    try:
        inside(path, name, journal)
    except ValueError:
        raise _foreign(journal, f"{name!r} is not a name inside {path}") from None


def _foreign(journal: str, problem: str) -> ValueError:
    return ValueError(
        f"{journal} was not written by a moejax save of this directory ({problem}), so no file it names is "
        "removed. Check that no save of this directory was interrupted (else restore its files), then delete "
        f"{journal} and retry"
    )


def _journal(path: str) -> tuple[list[str], str] | None:
    """(the shard names, the index) of the journal in `path` (None when there is none), after checking that a
    transaction of this module wrote it for the index now on disk (module docstring); ValueError otherwise."""
    journal = os.path.join(path, JOURNAL)
    if not os.path.lexists(journal):
        return None
    with open(journal, "rb") as f:
        raw = f.read()
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _foreign(journal, f"not a JSON object: {e}") from None
    if not isinstance(record, dict):
        raise _foreign(journal, f"a JSON {type(record).__name__}, not an object")
    index, digests = record.get("index"), record.get("index_sha256")
    if not isinstance(index, str):
        raise _foreign(journal, f"'index' is {index!r:.200}, not the name of an index file")
    _inside(path, index, journal)
    names = [*_names(record, "created", path, journal), *_names(record, "obsolete", path, journal)]
    if not isinstance(digests, list) or len(digests) != 2 or not all(d is None or isinstance(d, str) for d in digests):
        raise _foreign(journal, f"'index_sha256' is {digests!r:.200}, not the digests [before, after] of {index}")
    now = _digest(os.path.join(path, index))
    if now not in digests:
        raise _foreign(journal, f"{index} is neither the index it replaced nor the one it wrote")
    return names, index


def recover(path: str) -> None:
    """Finish or undo a transaction a crash interrupted in `path` (the caller holds the lock): the shards its
    journal names are kept where the current index references them and removed otherwise; stale temporary
    files go. ValueError naming the journal when it is not one this module wrote for the index on disk."""
    found = _journal(path)
    if found is not None:
        names, index = found
        referenced = _referenced(path, index)
        for name in names:
            if os.path.normpath(name) not in referenced:
                _unlink(os.path.join(path, name))
        _fsync_dir(path)
        _unlink(os.path.join(path, JOURNAL))
    for name in os.listdir(path):
        if TEMP_MARK in name and name.startswith("."):
            _unlink(os.path.join(path, name))


class Transaction:
    """An update of the files of one directory, seen by readers all at once (module docstring).

    Use as a context manager: entering locks the directory and recovers; leaving unlocks, and on an exception
    before `commit` removes what was staged (the directory is as before).

    Args:
      path: the directory (created if missing).
      index: the file whose references decide, after a crash, which created / obsolete files are kept
        (`model.safetensors.index.json`); None where nothing is created under a new name or made obsolete.
      timeout: seconds to wait for another writer's lock (default `LOCK_TIMEOUT_S`).
    """

    def __init__(self, path: str, *, index: str | None = None, timeout: float | None = None):
        self.path = path
        self.index = index
        self.timeout = LOCK_TIMEOUT_S if timeout is None else timeout
        self._created: list[tuple[str, str]] = []  # (temporary, name)
        self._replaced: list[tuple[str, str]] = []
        self._obsolete: list[str] = []
        self._lock_fd: int | None = None

    # -- locking ------------------------------------------------------------------------------------------------

    def __enter__(self) -> Transaction:
        os.makedirs(self.path, exist_ok=True)
        lock = os.path.join(self.path, LOCK)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise TimeoutError(
                        f"{lock} is held by another writer of {self.path} (a save_layer / save_adapter in another "
                        f"process) after waiting {self.timeout:g} s; retry when it has finished"
                    ) from None
                time.sleep(_POLL_S)
        self._lock_fd = fd
        try:
            recover(self.path)
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        try:
            for temporary, _ in [*self._created, *self._replaced]:  # what a failed commit did not place
                _unlink(temporary)
            if kind is not None:
                recover(self.path)  # created files the index does not reference
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # -- staging --------------------------------------------------------------------------------------------------

    def _stage(self, name: str, data: bytes | memoryview) -> str:
        temporary = _temporary(self.path, name)
        with open(temporary, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return temporary

    def create(self, name: str, data: bytes | memoryview) -> None:
        """Stage a new shard `name` (ValueError if one exists: new files never overwrite)."""
        self._check_shard(name)
        if os.path.lexists(os.path.join(self.path, name)):
            raise ValueError(f"{os.path.join(self.path, name)} exists; a transaction creates new names only")
        self._created.append((self._stage(name, data), name))

    def replace(self, name: str, data: bytes | memoryview) -> None:
        """Stage the new content of `name` (swapped in by `commit`, in the order staged)."""
        self._replaced.append((self._stage(name, data), name))

    def replace_json(self, name: str, obj: Any, **dump: Any) -> None:
        self.replace(name, (json.dumps(obj, **dump) + "\n").encode())

    def obsolete(self, name: str) -> None:
        """Remove the shard `name` after the swap (a file the new index no longer references)."""
        self._check_shard(name)
        self._obsolete.append(name)

    def _check_shard(self, name: str) -> None:
        """Only shards under an index may be created or made obsolete: `recover` removes nothing else."""
        if self.index is None or not name.endswith(SHARD_SUFFIX):
            raise ValueError(
                f"{os.path.join(self.path, name)}: a transaction creates or removes {SHARD_SUFFIX} shards under an "
                f"index only (index={self.index!r})"
            )

    # -- committing ---------------------------------------------------------------------------------------------

    def commit(self) -> None:
        """Place the created files, swap the replaced ones in, remove the obsolete ones (module docstring)."""
        if self._created or self._obsolete:
            staged = [temporary for temporary, name in self._replaced if name == self.index]
            before = _digest(os.path.join(self.path, self.index))
            after = _digest(staged[-1]) if staged else before
            record = {
                "index": self.index,
                "index_sha256": [before, after],
                "created": [n for _, n in self._created],
                "obsolete": self._obsolete,
            }
            journal = self._stage(JOURNAL, json.dumps(record).encode())
            os.replace(journal, os.path.join(self.path, JOURNAL))
        for temporary, name in self._created:
            os.replace(temporary, os.path.join(self.path, name))
        _fsync_dir(self.path)
        for temporary, name in self._replaced:
            os.replace(temporary, os.path.join(self.path, name))
        _fsync_dir(self.path)
        for name in self._obsolete:
            _unlink(os.path.join(self.path, name))
        if self._created or self._obsolete:
            _fsync_dir(self.path)
            _unlink(os.path.join(self.path, JOURNAL))
            _fsync_dir(self.path)
        self._created, self._replaced, self._obsolete = [], [], []  # a transaction may commit again
