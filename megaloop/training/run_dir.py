"""The directories a run writes to (``train.out_dir`` and ``checkpoint.dir``): proven writable
before training starts, and locked against a second run.

Storage: rank 0 creates each directory and writes and removes a probe file in it, so that a path
below a file, a read-only mount or a missing permission is a one-line ConfigError before the model
is built, not a lost run at its first save. Every other rank then checks that it sees the checkpoint
directory as a writable directory: dist_checkpointing writes from every rank, so on several nodes
it must be on a filesystem they share.

Lock: rank 0 holds an exclusive ``flock`` on ``<dir>/.megaloop.lock`` in each directory for the
run's lifetime; a second run on either directory is refused with the holder's host and pid (which
the file records). The kernel releases a flock when its process ends, however it ends (kill -9,
OOM); on a network filesystem the server releases a dead client's locks when its lease expires or
it is evicted (NFSv4: about 90 s). So a crashed run's lock does not block the next one, and there
is no stale-lock cleanup to get wrong. Only rank 0
locks: the other ranks of a run start together under one launcher and write only into the
checkpoint's ``.tmp`` directory, which rank 0 owns. A filesystem without lock support (Lustre
mounted ``noflock``) gets a warning and no lock.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

from megaloop.config import ConfigError
from megaloop.training.collective import first_error, is_rank0

log = logging.getLogger("megaloop.train")

LOCK_FILE = ".megaloop.lock"
_NO_LOCK_SUPPORT = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLock:
    """An exclusive, non-blocking flock on ``<directory>/.megaloop.lock``; ConfigError naming
    ``field`` and the holder when another live process has it."""

    def __init__(self, directory: Path, field: str):
        self.path = directory / LOCK_FILE
        self._file = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self.release()
            raise ConfigError(f"{field}={str(directory)!r}: in use by another run ({holder}); "
                              "wait for it to end or choose another directory") from None
        except OSError as e:
            if e.errno not in _NO_LOCK_SUPPORT:
                raise
            log.warning("%s: the filesystem does not support file locks (%s); a second run on "
                        "this directory will not be detected", self.path, e.strerror)
        self._file.seek(0)
        self._file.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        self._file.flush()

    def release(self) -> None:
        """Closing the file drops the lock; the file itself stays (removing it would race with
        a run that opened it meanwhile)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _prepare(directory: Path, field: str) -> None:
    """Creates ``directory`` and writes a probe file in it; ConfigError naming the field."""
    blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()),
                   None)
    if blocker is not None:
        raise ConfigError(f"{field}={str(directory)!r}: {blocker} is a file, not a directory")
    probe = directory / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{field}={str(directory)!r}: not writable ({e.strerror or e}: "
                          f"{e.filename})") from None


def prepare_run_dirs(out_dir: Path, checkpoint_dir: Path) -> list[RunLock]:
    """Collective: checks both directories and returns rank 0's locks (none on other ranks); the
    caller releases them when the run ends."""
    fields = {out_dir.resolve(): "train.out_dir", checkpoint_dir.resolve(): "checkpoint.dir"}
    locks: list[RunLock] = []
    error = None
    if is_rank0():
        try:
            for directory, field in fields.items():
                _prepare(directory, field)
                locks.append(RunLock(directory, field))
        except ConfigError as e:
            error = str(e)
    error = first_error(error)
    if error is None:
        seen = checkpoint_dir.is_dir() and os.access(checkpoint_dir, os.W_OK)
        error = first_error(None if seen else (
            f"checkpoint.dir={str(checkpoint_dir)!r}: not a writable directory on "
            f"{socket.gethostname()}; every node must see it on a shared filesystem"))
    if error is not None:
        for lock in locks:
            lock.release()
        raise ConfigError(error)
    return locks
