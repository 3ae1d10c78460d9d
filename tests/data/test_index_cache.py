import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from megaloop.data.datasets import DatasetTokenizer, build_gpt_datasets
from megaloop.data.index_cache import BUILD_LOCK, atomic_npy_writes
from megaloop.data.preprocess import PreprocessOptions, output_prefix, preprocess, whole_files
from megaloop.platform.files import temporaries_in
from megaloop.platform.locks import take_flock

REPO = Path(__file__).parents[2]
CHILD = Path(__file__).with_name("index_cache_child.py")
TOKENIZER = DatasetTokenizer(vocab_size=32000, eod=2, name="llama2_tokenizer.model")
INDICES = ("document_index", "sample_index", "shuffle_index")


def _indices(prefix: str, cache_dir: Path) -> dict:
    """The train split's indices as the child jobs build them (same settings)."""
    train = build_gpt_datasets([prefix], TOKENIZER, 64, (300, None, None), split="100,0,0",
                               cache_dir=str(cache_dir))[0]
    return {name: numpy.array(getattr(train, name)) for name in INDICES}


def _assert_same(found, expected):
    for name in INDICES:
        assert numpy.array_equal(found[name], expected[name]), name


def _start(tmp_path, prefix, name, mode):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    stderr = open(tmp_path / f"{name}.log", "w")
    args = [prefix, str(tmp_path / "cache"), str(tmp_path / f"{name}.npz"), str(tmp_path), name, mode]
    return subprocess.Popen([sys.executable, str(CHILD), *args], env=env, stderr=stderr)


def _wait_until(condition, job) -> None:
    deadline = time.monotonic() + 120  # a broken lock fails the test instead of hanging it
    while not condition():
        assert job.poll() is None, f"the job ended early (exit {job.returncode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_second_job_waits_for_the_first_to_build_then_loads_its_indices(tmp_path, tokenized_articles):
    first = _start(tmp_path, tokenized_articles, "first", "hold")
    _wait_until(lambda: (tmp_path / "first-building").exists(), first)
    second = _start(tmp_path, tokenized_articles, "second", "hold")
    # Before: the second job missed the cache too and built the same files at the same time.
    waiting = f"waiting for pid {first.pid} on "
    _wait_until(lambda: (waiting in (tmp_path / "second.log").read_text()
                         or (tmp_path / "second-building").exists()), second)
    assert not (tmp_path / "second-building").exists()
    (tmp_path / "release").touch()
    assert first.wait(120) == 0 and second.wait(120) == 0, (tmp_path / "second.log").read_text()
    first_out, second_out = numpy.load(tmp_path / "first.npz"), numpy.load(tmp_path / "second.npz")
    assert first_out["built"] and not second_out["built"]
    expected = _indices(tokenized_articles, tmp_path / "fresh-cache")
    _assert_same(first_out, expected)
    _assert_same(second_out, expected)


def test_a_job_whose_indices_are_cached_loads_them_while_another_holds_the_lock(
        tmp_path, tokenized_articles, caplog):
    import logging
    import threading

    cache = tmp_path / "cache"
    built = _indices(tokenized_articles, cache)
    files = sorted(os.listdir(cache))

    def fail(_):
        raise AssertionError("the lock was not free")

    with open(cache / BUILD_LOCK, "a+") as holder:  # another job, building other indices there
        assert take_flock(holder, fail, fail)
        threading.Timer(10, holder.close).start()  # so that the test fails rather than hangs
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="megaloop.data"):
            loaded = _indices(tokenized_articles, cache)
        # Before: it waited for the holder to end (here 10 s) for files it only reads.
        assert time.monotonic() - start < 5 and "waiting for" not in caplog.text
    _assert_same(loaded, built)
    assert sorted(os.listdir(cache)) == files


def test_a_job_killed_mid_write_leaves_nothing_the_next_job_loads(tmp_path, tokenized_articles):
    killed = _start(tmp_path, tokenized_articles, "killed", "die")
    _wait_until(lambda: (tmp_path / "killed-mid-write").exists(), killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(120)
    cache = tmp_path / "cache"
    # Before: the truncated shuffle index, beside the whole document and sample indices, was a
    # cache hit; loading it failed or read garbage.
    _assert_same(_indices(tokenized_articles, cache), _indices(tokenized_articles, tmp_path / "fresh"))
    assert temporaries_in(cache) == []  # the killed job's partial file went


def test_a_corrupt_cached_index_is_one_line_naming_it_and_is_built_again_once_deleted(
        tmp_path, tokenized_articles):
    """A .npy truncated by a writer other than megaloop's (Megatron-LM killed mid-save, a full
    disk). Before: numpy's ValueError, "mmap length is greater than file size", naming no file."""
    from megaloop.data import DataError

    cache = tmp_path / "cache"
    expected = _indices(tokenized_articles, cache)
    [shuffle] = cache.glob("*-train-shuffle_index.npy")
    os.truncate(shuffle, shuffle.stat().st_size // 2)
    with pytest.raises(DataError) as error:
        _indices(tokenized_articles, cache)
    assert str(error.value) == (f"{shuffle}: corrupt (mmap length is greater than file size); "
                                "delete it, and the next run builds it again")
    shuffle.unlink()
    _assert_same(_indices(tokenized_articles, cache), expected)


class _MakesDirectoryWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_pickle_under_a_cached_index_name_is_refused_unopened(tmp_path, tokenized_articles):
    """megatron-core loads cached indices with allow_pickle=True: a pickle planted under an
    index's name in a shared cache directory ran its code (here: making a directory)."""
    import pickle

    from megaloop.data import DataError

    cache = tmp_path / "cache"
    expected = _indices(tokenized_articles, cache)
    [sample] = cache.glob("*-train-sample_index.npy")
    ran = tmp_path / "the pickle ran"
    sample.write_bytes(pickle.dumps(_MakesDirectoryWhenUnpickled(str(ran))))
    with pytest.raises(DataError) as error:
        _indices(tokenized_articles, cache)
    assert not ran.exists()
    assert str(error.value) == (f"{sample}: a pickle, not a numpy index; not loaded, since "
                                "unpickling runs code: delete it, and the next run builds it again")
    sample.unlink()
    _assert_same(_indices(tokenized_articles, cache), expected)


def test_indices_of_data_rewritten_under_the_same_prefix_are_rebuilt(tmp_path, sp_model, articles):
    # Before: the cache key held the prefix, not the data, so re-tokenized data under the same
    # prefix reused indices made for other documents.
    def tokenize(records, where):
        corpus = tmp_path / f"{where}.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        options = PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=True, workers=0)
        preprocess(whole_files([str(corpus)]), str(tmp_path / where), options)
        return output_prefix(str(tmp_path / where), "text")

    prefix = tokenize(articles, "data")
    before = _indices(prefix, tmp_path / "cache")
    smaller = tokenize(articles[:20], "smaller")
    for suffix in (".bin", ".idx"):
        shutil.copy(smaller + suffix, prefix + suffix)
    after = _indices(prefix, tmp_path / "cache")
    _assert_same(after, _indices(prefix, tmp_path / "fresh"))
    assert not numpy.array_equal(after["document_index"], before["document_index"])


def test_cache_writes_are_atomic(tmp_path):
    path = tmp_path / "x.npy"
    with atomic_npy_writes():
        numpy.save(str(path), numpy.arange(5))
        with pytest.raises(ValueError):
            numpy.save(str(tmp_path / "y.npy"), numpy.array([object()]), allow_pickle=False)
    assert numpy.load(path).tolist() == [0, 1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path)) == ["x.npy"]  # the failed save left nothing behind
    assert numpy.save.__module__ == "numpy"  # restored
