"""Files written whole or not at all: every writer puts a temporary file beside the target, syncs
it to disk and renames it over the target (one atomic step on POSIX), so a reader or a crash sees
the old file or the new one, never half of one; on any error (Ctrl-C included) the temporary is
removed and the target left as it was.

A temporary is named ``.<target name>-<pid>-<8 hex digits>``: hidden, unique to its writer, and
recognisable (``atomic_write_leftovers``) when a killed process left it behind. It gets the
permissions a plain ``open`` gives (0666 less the umask: 0644 under umask 022), not
``tempfile.mkstemp``'s 0600, so that teammates can read a shared run.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import IO, Callable, Iterator

_TOKEN_BYTES = 4  # of the temporary name's random part
_TEMPORARY = re.compile(rf"\.(?P<target>.+)-\d+-[0-9a-f]{{{2 * _TOKEN_BYTES}}}")
# A writer holds its temporary file only from the open to the rename (milliseconds; seconds with a
# slow fsync), so one last modified this long ago belongs to a process killed in between. The age,
# not the pid, decides: the writer may be on another node of a shared filesystem, where a pid
# means nothing here, and a dead writer's pid may have been reused.
STALE_TEMPORARY_SECONDS = 15 * 60
# What fsync of a directory says on a filesystem that has none for directories (CIFS, 9p; POSIX
# allows it): there the server makes names durable, or nothing can, and a save that failed on it
# would lose the checkpoint rather than make it safer (PostgreSQL's fsync_fname does the same).
_NO_DIRECTORY_SYNC = (errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a fresh path beside ``path`` for the block to write one file at (with any writer:
    numpy, matplotlib, ...). When the block ends without an exception the file is synced and
    renamed over ``path``, and stale temporaries of earlier writes of ``path`` are removed; on
    any exception the temporary is removed and ``path`` is untouched. A symbolic link is written
    through, as a plain ``open`` writes: its target is replaced (the temporary beside the target,
    for the rename to stay on its filesystem), the link kept."""
    given, path = path, Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}-{os.getpid()}-{secrets.token_hex(_TOKEN_BYTES)}")
    try:
        yield tmp
        sync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _remove_stale_temporaries(given)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w",
                encoding: str | None = None) -> Iterator[IO]:
    """``open(path, mode)`` for writing (``mode`` "w" or "wb"; text is UTF-8 unless ``encoding``
    says otherwise) through ``atomic_path``: ``path`` changes only when the block completes."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r} (must be 'w' or 'wb')")
    if mode == "w":
        encoding = encoding or "utf-8"
    with atomic_path(path) as tmp, open(tmp, mode.replace("w", "x"), encoding=encoding) as f:
        yield f


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` through ``atomic_path``."""
    with atomic_open(path) as f:
        f.write(text)


def sync_file(path: str | os.PathLike) -> None:
    """Makes the data of file ``path`` durable (fsync syncs the file whichever descriptor of it
    is synced, so one opened for reading does)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sync_directory(path: str | os.PathLike) -> None:
    """Makes the names in directory ``path`` durable: a file created, renamed into it or replaced
    there (``atomic_path``'s rename included) is on disk only once its directory is synced; a
    crash before leaves the old name, or none. A filesystem without directory syncs is left to
    its own (``_NO_DIRECTORY_SYNC``)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(fd)


def sync_tree(directory: str | os.PathLike,
              durable: Callable[[Path], bool] = lambda path: False) -> None:
    """Syncs every file below ``directory`` but those ``durable`` says are synced already, then
    every directory, the deepest first: after a crash, none of them is found empty or missing
    once a later rename has made the tree visible. Another writer's data, on another host of a
    shared filesystem, is synced only where it wrote it: ``durable`` must cover it."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            path = Path(root) / name
            if not durable(path):
                sync_file(path)
        sync_directory(root)


def remove_tree(path: str | os.PathLike, what: str, log: logging.Logger,
                remedy: str = "remove it by hand") -> None:
    """Deletes directory ``path`` (``what`` it holds, for the message) as far as it can. A
    failure is one warning line on ``log`` naming ``path`` and the first file or directory that
    would not go (its path: rmtree's error may name a file relative to its directory; the
    directories above it fail after it, not being empty), then ``remedy``: the space stays
    taken until the user frees it, or a later try (that caller's wording says when). What is
    gone already (removed meanwhile, or never made) is no failure."""
    failures = []

    def failed(function, failed_path, info) -> None:
        if not isinstance(info[1], FileNotFoundError):
            failures.append((failed_path, info[1]))

    shutil.rmtree(path, onerror=failed)
    if failures:
        failed_path, error = failures[0]
        log.warning("%s: %s, not wholly deleted (%s: %s); %s", path, what, failed_path,
                    getattr(error, "strerror", None) or error, remedy)


def _remove_stale_temporaries(path: str | os.PathLike) -> None:
    """Best effort: the write itself succeeded, so a leftover that cannot be removed stays."""
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    for leftover in atomic_write_leftovers(path):
        try:
            if leftover.stat().st_mtime < cutoff:
                leftover.unlink()
        except OSError:  # renamed or removed meanwhile by its writer or another cleaner
            pass


def atomic_write_leftovers(path: str | os.PathLike) -> list[Path]:
    """The temporary files that atomic writes of ``path`` left when their process was killed
    between the write and the rename: beside ``path`` and, where ``path`` is a symbolic link,
    beside its target, where ``atomic_path`` writes them. All are stale only where no other
    process is writing ``path`` (a run's ``latest``, under its lock); every write removes those
    older than ``STALE_TEMPORARY_SECONDS`` itself."""
    path = Path(path)
    found = _temporaries_of(path)
    if path.is_symlink():
        found += _temporaries_of(Path(os.path.realpath(path)))
    return found


def _temporaries_of(path: Path) -> list[Path]:
    return [p for p in temporaries_in(path.parent) if _TEMPORARY.fullmatch(p.name)["target"]
            == path.name]


def temporaries_in(directory: str | os.PathLike, suffix: str = "") -> list[Path]:
    """The temporaries of atomic writes in ``directory`` whose target's name ends with ``suffix``
    (every one, live or left by a killed writer), sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if (m := _TEMPORARY.fullmatch(p.name)) and m["target"].endswith(suffix))
