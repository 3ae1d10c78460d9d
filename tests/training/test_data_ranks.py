"""A data, tokenizer or fine-tuning records file that one rank cannot read (a node whose mount
lacks it, or denies it) is one line naming the file and the rank, raised on every rank within
seconds: megatron-core's dataset build raised that rank's PermissionError with a traceback, the
tokenizer's load or the records' reading that rank's error alone, while the other ranks waited in
their next collective until the process-group timeout."""

import builtins
import errno
import os
import time
from pathlib import Path

import pytest

from tests.distributed import collective_timeout, run_distributed, workers_discarded_on_failure

# The process-group timeout in the test: the old code's waiting ranks failed then (far above the
# seconds the build takes), not after run_distributed's 10 minutes.
_TIMEOUT_S = 30


def _deny(monkeypatch, unreadable: str) -> None:
    """This process may not open ``unreadable`` (as root, a chmod would not stop it)."""
    opened = builtins.open

    def denied(file, *args, **kwargs):
        if str(file) == unreadable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return opened(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)  # numpy.memmap opens with it too


def _build_unreadable_on_rank1(rank, world_size, data, out, unreadable, tokenizer):
    from megaloop.config import ConfigError
    from megaloop.data import DataError
    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    cfg = tiny_run(data, Path(out), model={"vocab_size": 32128})
    cfg.data.tokenizer_model = tokenizer
    with pytest.MonkeyPatch.context() as monkeypatch, collective_timeout(_TIMEOUT_S):
        if rank == 1:
            _deny(monkeypatch, unreadable)
        started = time.monotonic()
        try:
            build_datasets(cfg)
        except (ConfigError, DataError) as e:
            return str(e), time.monotonic() - started
    return None, time.monotonic() - started


@pytest.mark.parametrize("what", [".bin", ".idx", "tokenizer"])
def test_a_data_file_one_rank_cannot_read_fails_every_rank_in_one_line(tmp_path, pattern_data,
                                                                       what):
    from tests.data.conftest import SP_MODEL

    if not SP_MODEL.is_file():
        pytest.skip(f"{SP_MODEL} not available")
    unreadable = str(SP_MODEL) if what == "tokenizer" else pattern_data + what
    with workers_discarded_on_failure():
        (error0, took0), (error1, took1) = run_distributed(
            _build_unreadable_on_rank1, world_size=2, data=pattern_data,
            out=str(tmp_path / "run"), unreadable=unreadable, tokenizer=str(SP_MODEL))
    says = (f"data.tokenizer_model={unreadable!r}: {unreadable}: tokenizer file unreadable "
            "(Permission denied)" if what == "tokenizer" else f"{unreadable}: Permission denied")
    assert error0 == error1 == f"rank 1: {says}", (error0, error1)
    assert max(took0, took1) < _TIMEOUT_S / 3, (took0, took1)


def _build_with_a_faulty_cached_index(rank, world_size, data, out, fault):
    """The datasets built on every rank once their indices are cached, then again with the
    train split's shuffle index truncated (on every rank: one shared cache) or unreadable on
    rank 1; the error and the seconds each rank took to raise it."""
    import glob

    import torch.distributed as dist

    from megaloop.data import DataError
    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    cfg = tiny_run(data, Path(out))
    build_datasets(cfg)
    [shuffle] = glob.glob(f"{cfg.data.cache_dir}/*-train-shuffle_index.npy")
    if fault == "truncated" and rank == 0:
        os.truncate(shuffle, os.path.getsize(shuffle) // 2)
    dist.barrier()
    with pytest.MonkeyPatch.context() as monkeypatch, collective_timeout(_TIMEOUT_S):
        if fault == "unreadable" and rank == 1:
            _deny(monkeypatch, shuffle)
        started = time.monotonic()
        try:
            build_datasets(cfg)
            dist.barrier()  # the trainer's next collective
        except DataError as e:
            return str(e), time.monotonic() - started, shuffle
    return None, time.monotonic() - started, shuffle


@pytest.mark.parametrize("fault", ["truncated", "unreadable"])
def test_a_cached_index_that_is_corrupt_or_one_rank_cannot_read_fails_every_rank_in_one_line(
        tmp_path, pattern_data, fault):
    """Before: rank 0 raised numpy's ValueError naming no file ("mmap length is greater than
    file size"), or rank 1 its PermissionError, with a traceback, while the other rank waited in
    megatron-core's next barrier, or the trainer's next collective, until the process-group
    timeout."""
    with workers_discarded_on_failure():
        (error0, took0, shuffle), (error1, took1, _) = run_distributed(
            _build_with_a_faulty_cached_index, world_size=2, data=pattern_data,
            out=str(tmp_path / "run"), fault=fault)
    says = {"truncated": f"rank 0: {shuffle}: corrupt (mmap length is greater than file size); "
                         "delete it, and the next run builds it again",
            "unreadable": f"rank 1: {shuffle}: Permission denied"}[fault]
    assert error0 == error1 == says, (error0, error1)
    assert max(took0, took1) < _TIMEOUT_S / 3, (took0, took1)


def _build_failing_in_megatron_on_rank1(rank, world_size, data, out):
    """Builds the datasets, rank 1's megatron-core build failing with an I/O error opening the
    data (after megaloop's checks passed: a node losing its mount); what each rank raised, and
    the seconds it took."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    def lost(dataset_path, config):
        raise OSError(errno.EIO, os.strerror(errno.EIO), dataset_path + ".idx")

    cfg = tiny_run(data, Path(out))
    with pytest.MonkeyPatch.context() as monkeypatch, collective_timeout(_QUICK_TIMEOUT_S):
        if rank == 1:
            monkeypatch.setattr(GPTDataset, "build_low_level_dataset", staticmethod(lost))
        started = time.monotonic()
        try:
            build_datasets(cfg)
        except Exception as e:  # what each rank raised is the outcome
            return type(e).__name__, time.monotonic() - started
    return None, time.monotonic() - started


_QUICK_TIMEOUT_S = 10


def test_a_rank_whose_dataset_build_fails_inside_megatron_core_leaves_at_once(tmp_path,
                                                                             pattern_data):
    """megatron-core's build holds barriers, which rank 0 waits in while rank 1 builds: an error
    of rank 1's there (an OSError, other than the index cache's) is raised at once, for the
    launcher to end the other ranks. Before: rank 1 entered the agreement on the build's errors
    (an all-gather) while rank 0 waited in the build's next barrier, both until the
    process-group timeout."""
    from tests.distributed import close_all

    try:  # rank 0 is left in megatron-core's barrier until the (short) timeout
        (_, took0), (error1, took1) = run_distributed(
            _build_failing_in_megatron_on_rank1, world_size=2, data=pattern_data,
            out=str(tmp_path / "run"))
    finally:
        close_all()  # gloo closes a group whose collective timed out
    assert error1 == "OSError", error1
    assert took1 < _QUICK_TIMEOUT_S / 3 < took0, (took0, took1)


def _build_sft_unreadable_on_rank1(rank, world_size, files, out):
    import torch.distributed as dist

    from megaloop.data import DataError
    from megaloop.training.data import build_datasets
    from tests.training.test_sft import sft_run

    with pytest.MonkeyPatch.context() as monkeypatch, collective_timeout(_TIMEOUT_S):
        if rank == 1:
            _deny(monkeypatch, files[0])
        started = time.monotonic()
        try:
            build_datasets(sft_run(files, Path(out)))
            dist.barrier()  # the trainer's next collective
        except DataError as e:
            return str(e), time.monotonic() - started
    return None, time.monotonic() - started


def test_fine_tuning_records_one_rank_cannot_read_fail_every_rank_in_one_line(tmp_path):
    """Every rank reads the records itself (no collective in the build): the failing rank raised
    alone, and the others waited in training's next collective."""
    from tests.sft import arithmetic_records, train_tokenizer, write_jsonl

    records = arithmetic_records(24)
    files = (str(write_jsonl(tmp_path / "train.jsonl", records)),
             str(train_tokenizer(tmp_path / "tok.model", records)))
    with workers_discarded_on_failure():
        (error0, took0), (error1, took1) = run_distributed(
            _build_sft_unreadable_on_rank1, world_size=2, files=files, out=str(tmp_path / "run"))
    assert error0 == error1 and error0.startswith(f"rank 1: {files[0]}: "), (error0, error1)
    assert "Permission denied" in error0 and "\n" not in error0, error0
    assert max(took0, took1) < _TIMEOUT_S / 3, (took0, took1)


def _printed_by_each_rank(rank, world_size, data, out, split, eval_interval):
    """What megaloop-train prints on this rank (print_error) of build_datasets' refusal of
    ``data.split``."""
    import contextlib
    import io

    from megaloop import cli
    from megaloop.config import ConfigError
    from megaloop.data import DataError
    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    cfg = tiny_run(data, Path(out), train={"eval_interval": eval_interval})
    cfg.data.split = split
    with pytest.MonkeyPatch.context() as monkeypatch, collective_timeout(_TIMEOUT_S):
        monkeypatch.setattr(cli, "RANK0_GRACE_S", 0)
        try:
            build_datasets(cfg)
        except (ConfigError, DataError) as e:
            with contextlib.redirect_stderr(io.StringIO()) as printed:
                cli.print_error(e)
            return printed.getvalue()
    return None


@pytest.mark.parametrize("split, eval_interval, says", [
    # The pattern data's 400 documents: 1 in 1000 rounds to none (build_gpt_datasets' check).
    ("999,1,0", 0, "{data}: split '999,1,0' gives the valid split 0 of its 400 documents and no "
                   "tokens, which megatron-core cannot build; use more data or a split such as "
                   "'1000,0,0'"),
    ("100,0,0", 5, "data.split='100,0,0': gives the validation split no data, but "
                   "train.eval_interval=5 asks for evaluations; give it a weight, or train "
                   "without evaluation (train.eval_interval=0, train.eval_depths=[])")])
def test_a_split_refused_alike_on_every_rank_is_said_once_without_a_rank(tmp_path, pattern_data,
                                                                        split, eval_interval,
                                                                        says):
    """Every rank decides these from the config and the data's summaries, which rank 0 read and
    every rank received: before, the first was said as rank 0's own ("error: rank 0: ..."), and
    the second by every rank."""
    with workers_discarded_on_failure():
        printed = run_distributed(_printed_by_each_rank, world_size=2, data=pattern_data,
                                  out=str(tmp_path / "run"), split=split,
                                  eval_interval=eval_interval)
    assert printed == [f"error: {says.format(data=pattern_data)}\n", ""], printed
