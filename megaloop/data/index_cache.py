"""The cache of megatron-core's dataset indices, made safe to share between jobs.

megatron-core's GPTDataset and BlendedDataset keep their shuffle/sample indices as .npy files in
``path_to_cache``, named by a hash of the settings that make them, and take a file's existence as
a cache hit. Left as it is, that is unsafe where jobs share a cache directory (normal on a
cluster), in three ways this module closes:

- ``atomic_npy_writes``: megatron-core ``numpy.save``s in place, so a job killed mid-write, or a
  job loading while another writes, meets a truncated .npy that looks whole;
- ``exclusive_build``: two jobs missing the same index both build it; with an exclusive lock
  on the cache directory the second waits, then loads the finished files;
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


@contextlib.contextmanager
def exclusive_build(cache_dir: str):
    """Hold an exclusive ``flock`` on ``<cache_dir>/.megaloop-build.lock``, waiting (with a log
    line naming the holder) while another process holds it; then remove the temporary files of
    builds that were killed. The kernel drops a flock however its process ends, so a killed
    job never blocks the next. A cache directory this process cannot write to is used unlocked:
    it can only load from it. A filesystem without locks gets a warning and no lock."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock_file = open(os.path.join(cache_dir, BUILD_LOCK), "a+")
    except OSError:
        lock_file = None
    if lock_file is None:
        yield
        return

    def wait(holder: str) -> None:
        log.info("%s: waiting for %s, which is building dataset indices there", cache_dir, holder)

    unguarded = warn_unguarded(log, cache_dir, "jobs sharing this cache directory may build the "
                                               "same dataset indices at once")
    with lock_file:
        if take_flock(lock_file, wait, unguarded):
            _remove_partial_files(cache_dir)
        yield


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
        with atomic_open(path, "wb") as f:
            original(f, arr, *args, **kwargs)

    numpy.save = atomic_save
    try:
        yield
    finally:
        numpy.save = original
