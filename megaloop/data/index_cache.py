"""The cache of megatron-core's dataset indices, made safe to share between jobs.

megatron-core's GPTDataset and BlendedDataset keep their shuffle/sample indices as .npy files in
``path_to_cache``, named by a hash of the settings that make them, and take a file's existence as
a cache hit. Left as it is, that is unsafe where jobs share a cache directory (normal on a
cluster), in three ways this module closes:

- ``atomic_npy_writes``: megatron-core ``numpy.save``s in place, so a job killed mid-write, or a
  job loading while another writes, meets a truncated .npy that looks whole;
- ``exclusive_build``: two jobs missing the same index both build it; with an exclusive lock
  on the cache directory, taken only by a job that misses an index, the second waits, then
  loads the finished files;
- ``sequence_lengths_md5``: the hash covers the dataset's path, not its contents, so data
  re-tokenized under the same prefix (or another dataset reached by the same relative path)
  would reuse indices built for other documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os

import numpy

from megaloop.data.indexed import IndexedSummary, sequence_lengths
from megaloop.platform.files import atomic_open, temporaries_in
from megaloop.platform.locks import take_flock, warn_unguarded

log = logging.getLogger("megaloop.data")

BUILD_LOCK = ".megaloop-build.lock"


def sequence_lengths_md5(summary: IndexedSummary) -> str:
    """A digest of what a GPTDataset's indices are made from: the token count of every sequence
    (a sample spans sequences by their lengths; the tokens are read only when a sample is)."""
    return hashlib.md5(sequence_lengths(summary), usedforsecurity=False).hexdigest()


class _BuildLock:
    """The build lock of one cache directory, taken at the first index this process builds."""

    def __init__(self, cache_dir: str):
        self.cache_dir, self.file, self.taken = cache_dir, None, False

    def take(self) -> None:
        if self.taken:
            return
        self.taken = True
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            self.file = open(os.path.join(self.cache_dir, BUILD_LOCK), "a+")
        except OSError:  # a cache this process cannot write to: it can only load from it
            return

        def wait(holder: str) -> None:
            log.info("%s: waiting for %s, which is building dataset indices there",
                     self.cache_dir, holder)

        unguarded = warn_unguarded(log, self.cache_dir, "jobs sharing this cache directory may "
                                                        "build the same dataset indices at once")
        if take_flock(self.file, wait, unguarded):
            _remove_partial_files(self.cache_dir)

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # drops the lock


_building: _BuildLock | None = None  # the exclusive_build in progress in this process


@contextlib.contextmanager
def exclusive_build(cache_dir: str):
    """Within the block, the first index missing from ``cache_dir`` (``before_building``) takes
    an exclusive ``flock`` on ``<cache_dir>/.megaloop-build.lock``, held to the end of the block:
    while another job holds it, this one waits (with a log line naming the holder), then loads
    what that job built; once it holds the lock, it removes the temporary files of builds that
    were killed. A job whose indices are all cached never takes the lock, so it loads them while
    another job builds others. A cache directory this process cannot write to is used unlocked:
    it can only load from it. A filesystem without locks gets a warning and no lock."""
    global _building
    lock = _building = _BuildLock(cache_dir)
    try:
        yield
    finally:
        _building = None
        lock.release()


def before_building() -> None:
    """Called before building a missing index (by ``atomic_npy_writes`` at each save, and by the
    dataset before computing one): takes ``exclusive_build``'s lock, waiting while another job
    builds, so the caller must look for the index again afterwards. Nothing outside the block."""
    if _building is not None:
        _building.take()


def _remove_partial_files(cache_dir: str) -> None:
    """Every writer holds the lock, so a temporary .npy found under it is a killed build's."""
    for leftover in temporaries_in(cache_dir, ".npy"):
        leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_npy_writes():
    """Make ``numpy.save`` to a path write a temporary file and rename it into place.

    megatron-core caches indices with plain ``numpy.save(path, ...)``, and judges a cache hit by
    the files existing. Routing its saves through a rename means a killed run never leaves a
    truncated .npy behind. Only saves made while building datasets are affected.
    """
    original = numpy.save

    def atomic_save(file, arr, *args, **kwargs):
        if not isinstance(file, (str, os.PathLike)):
            return original(file, arr, *args, **kwargs)
        path = os.fspath(file)
        path = path if path.endswith(".npy") else path + ".npy"
        before_building()  # BlendedDataset computes its indices unannounced: locked from its save
        with atomic_open(path, "wb") as f:
            original(f, arr, *args, **kwargs)

    numpy.save = atomic_save
    try:
        yield
    finally:
        numpy.save = original
