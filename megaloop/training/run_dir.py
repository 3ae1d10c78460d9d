"""The directories a run writes to (``train.out_dir`` and ``checkpoint.dir``): proven writable
before training starts, and locked against a second run.

Storage: rank 0 creates each directory and writes and removes a probe file in it, so that a path
below a file, a read-only mount or a missing permission is a one-line ConfigError before the model
is built, not a lost run at its first save. Every other rank then checks that it sees the checkpoint
directory as a writable directory: dist_checkpointing writes from every rank, so on several nodes
it must be on a filesystem they share.

Lock: rank 0 holds an exclusive ``flock`` on ``<dir>/.megaloop.lock`` in each directory for the
run's lifetime; a second run on either directory is refused with the holder's host and pid (which
the file records; ``megaloop.platform.locks``). A crashed run's lock does not block the next one:
the kernel drops a flock however its process ends. Only rank 0 locks: the other ranks of a run
start together under one launcher and write only into the checkpoint's ``.tmp`` directory, which
rank 0 owns. A filesystem without lock support (Lustre mounted ``noflock``) gets a warning and no
lock.

A set-up that does not complete (a refused dataset, tokenizer or checkpoint, a stop signal) leaves
the directories as it found them: ``RunDirs.undo`` removes the files set-up created in them and
noted with ``RunDirs.created`` (the ALRS log) and the lock files this run created, while still
holding them, then every directory it created that is still empty; whatever existed before or
holds anything else stays. A run that had opened a lock file just before its removal notices, once
it holds the lock, that the path names another file or none, and locks afresh.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from megaloop.cli import decided_on_every_rank
from megaloop.config import ConfigError
from megaloop.platform import mounts
from megaloop.platform.files import remove_tree
from megaloop.platform.locks import take_flock, warn_unguarded
from megaloop.training.collective import first_error, is_rank0

log = logging.getLogger("megaloop.train")

LOCK_FILE = ".megaloop.lock"


class RunLock:
    """An exclusive, non-blocking flock on ``<directory>/.megaloop.lock``; ConfigError naming
    ``field`` and the holder when another live process has it. ``created``: whether this lock made
    the file."""

    def __init__(self, directory: Path, field: str):
        self.path = directory / LOCK_FILE
        def refuse(holder: str) -> None:
            self.release()
            raise ConfigError(f"{field}={str(directory)!r}: in use by another run ({holder}); "
                              "wait for it to end or choose another directory") from None

        unguarded = warn_unguarded(log, str(self.path),
                                   "a second run on this directory will not be detected")
        while True:
            self.created, self._file = _open_or_create(self.path)
            if not take_flock(self._file, refuse, unguarded) or self._holds_the_file_at_path():
                break
            self._file.close()  # removed by a run that gave up as this one opened it

    def _holds_the_file_at_path(self) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(self._file.fileno())
        return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)

    def release(self, remove_created: bool = False) -> None:
        """Closing the file drops the lock. The file stays, unless ``remove_created`` and this
        lock made it: then it is removed first, while still held (see the module docstring)."""
        if self._file is None:
            return
        if remove_created and self.created and self._holds_the_file_at_path():
            self.path.unlink()
        self._file.close()
        self._file = None


def _open_or_create(path: Path):
    """(whether this call created ``path``, the file open for reading and appending)."""
    try:
        return True, os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "a+")
    except FileExistsError:
        return False, open(path, "a+")


def _prepare(directory: Path, field: str) -> None:
    """Creates ``directory`` and writes a probe file in it; ConfigError naming the field."""
    _check_mounted(directory, field)
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


def _check_mounted(directory: Path, field: str) -> None:
    """ConfigError when the job runs in a container (slurm/common.sh with IMAGE lists the mount
    points it asks for, colon-separated, in MEGALOOP_CONTAINER_MOUNTS) and ``directory``
    (resolved) would be made in the container's own root file system or in memory (a tmpfs: the
    /tmp enroot gives every container, a host's /dev/shm), and be lost with it, so that every
    requeued job started over. The mount that holds it says which (megaloop.platform.mounts).
    Accepted: a directory under one of the job's mount points, unless in memory, and one on
    another mount, which the site's enroot/pyxis configuration adds to every container (/lustre,
    a home directory) without the job knowing. Where the mounts cannot be read, only the job's
    mount points are known. The job script checks the paths it sets; this one catches those of a
    --config file or an override too."""
    listed = os.environ.get("MEGALOOP_CONTAINER_MOUNTS")
    if not listed:
        return
    points = [Path(point or "/").resolve() for point in listed.split(":")]
    on_a_job_mount = any(point == directory or point in directory.parents for point in points)
    try:
        mount = mounts.mount_of(directory, mounts.read_mounts(mounts.MOUNTINFO))
    except OSError as e:
        if on_a_job_mount:
            return
        where = f"the container's mounts are unknown ({e.filename}: {e.strerror})"
    else:
        if mount is not None and mount.fstype in mounts.MEMORY_FILE_SYSTEMS:
            where = f"it is in memory ({mount.fstype} at {mount.point})"
        elif on_a_job_mount:
            return
        elif mount is None or mount.point == Path("/"):
            where = "it is on the container's own root file system" + (
                f" ({mount.fstype} at /)" if mount else "")
        else:
            return
    raise ConfigError(f"{field}={str(directory)!r}: not on a file system mounted from the host: "
                      f"{where}; it would be lost with the container, and a requeued job would "
                      "start over: choose a directory on a mounted file system (the job mounts "
                      f"{', '.join(map(str, points))}; slurm/ scripts: add one to MOUNTS)")


class RunDirs:
    """``train.out_dir``, ``checkpoint.dir`` and ``data.cache_dir`` (when set) of one run.
    Construct it before anything is created: on rank 0 it notes which of these directories and of
    their parents do not exist yet."""

    def __init__(self, out_dir: Path, checkpoint_dir: Path, cache_dir: str | None = None):
        self.fields = {out_dir.resolve(): "train.out_dir",
                       checkpoint_dir.resolve(): "checkpoint.dir"}
        self.checkpoint_dir = checkpoint_dir
        self.locks: list[RunLock] = []
        self._new_entries: list[Path] = []
        missing = set()
        if is_rank0():
            for target in [*self.fields, *([Path(cache_dir).resolve()] if cache_dir else [])]:
                missing.update(d for d in (target, *target.parents) if not d.exists())
        self._new_dirs = sorted(missing, key=lambda d: len(d.parts), reverse=True)  # deepest first

    def prepare(self) -> None:
        """Collective: checks both run directories and takes rank 0's locks; after a ConfigError
        the caller calls ``undo()``."""
        error = None
        if is_rank0():
            try:
                for directory, field in self.fields.items():
                    _prepare(directory, field)
                    self.locks.append(RunLock(directory, field))
            except ConfigError as e:
                error = str(e)
        error = first_error(error)
        if error is None:
            directory = self.checkpoint_dir
            seen = directory.is_dir() and os.access(directory, os.W_OK)
            error = first_error(None if seen else (
                f"checkpoint.dir={str(directory)!r}: not a writable directory on "
                f"{socket.gethostname()}; every node must see it on a shared filesystem"))
        if error is not None:
            raise decided_on_every_rank(ConfigError(error))

    def created(self, path: Path) -> None:
        """Rank 0, during set-up: notes that this run is about to create ``path`` (a file or
        directory that does not exist yet) in a run directory, so that ``undo`` removes it."""
        assert not path.exists(), f"{path} existed before this run"
        self._new_entries.append(path)

    def release(self) -> None:
        """Drops the locks at the end of the run (idempotent)."""
        for lock in self.locks:
            lock.release()
        self.locks = []

    def undo(self) -> None:
        """After a set-up that did not complete: removes what ``created`` noted, the lock files
        this run created and the directories it created that are empty (or hold only empty
        directories), and drops the locks. Anything that existed before, or that holds another
        file, stays."""
        for path in self._new_entries:  # while the locks keep any other run out
            if path.is_dir() and not path.is_symlink():
                remove_tree(path, "made by this run's set-up, which did not complete", log)
            else:
                path.unlink(missing_ok=True)
        self._new_entries = []
        for lock in self.locks:
            lock.release(remove_created=True)
        self.locks = []
        for directory in self._new_dirs:
            if not directory.is_dir():
                continue
            for inner, _, _ in os.walk(directory, topdown=False):  # all made by this run
                try:
                    os.rmdir(inner)
                except OSError:  # not empty
                    pass
