"""The processes of a checkpoint save, under what the machine does to them: a writer that cannot
be started on one rank fails the save on every rank at once, and a trainer killed with
``kill -9`` mid-save leaves no process of the run behind."""

import errno
import os
import time
from pathlib import Path

import psutil
import pytest

from megaloop.training import checkpoint as ckpt
from megaloop.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run


def _refuse_the_second_fork(monkeypatch) -> None:
    """This process's second os.fork (step 4's writer, after step 2's) fails as at a pids
    cgroup's limit; forks in its children are not counted."""
    fork, trainer, forks = os.fork, os.getpid(), []

    def refused():
        if os.getpid() == trainer:
            forks.append(None)
            if len(forks) == 2:
                raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return fork()

    monkeypatch.setattr(os, "fork", refused)


def _forks(process: psutil.Process) -> list[psutil.Process]:
    """The children of ``process`` forked from it (a writer), not spawned (the results-queue
    manager runs another command line)."""
    return [child for child in process.children()
            if child.status() != psutil.STATUS_ZOMBIE and child.cmdline() == process.cmdline()]


def _fork_refused_on_rank_1(rank, world_size, data_prefix, out_dir, async_save):
    trainer = Trainer(tiny_run(data_prefix, Path(out_dir) / "run", train={"train_steps": 8},
                               checkpoint={"save_interval": 2, "async_save": async_save}))
    with pytest.MonkeyPatch.context() as monkeypatch:
        if rank == 1:
            _refuse_the_second_fork(monkeypatch)
        try:
            trainer.train()
        except ckpt.CheckpointError as e:
            return str(e), trainer.step, _forks(psutil.Process())
        finally:
            trainer.close()
    return None, trainer.step, []


@pytest.mark.timeout(120, method="thread")  # the old code: rank 0 waited in the finalize's
# all-reduce, which rank 1 never joined, until the process-group timeout (30 minutes)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_writer_that_cannot_start_on_one_rank_fails_the_save_on_every_rank(
        mcore, pattern_data, tmp_path, async_save):
    started = time.monotonic()
    results = run_distributed(_fork_refused_on_rank_1, world_size=2, data_prefix=pattern_data,
                              out_dir=str(tmp_path), async_save=async_save)
    checkpoints = tmp_path / "run" / "checkpoints"
    (error0, step0, writers0), (error1, step1, writers1) = results
    assert error0 == error1, "the same line on every rank"
    assert error0.startswith(f"{checkpoints}/iter_0000004.tmp: saving step 4 failed (rank 1: "
                             "its writer process did not start: [Errno 11] Resource temporarily "
                             "unavailable; "), error0
    assert error0.endswith(" free on its filesystem); latest is still iter_0000002")
    assert step0 == step1 == 4
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000002"
    assert not (checkpoints / "iter_0000004.tmp").exists()
    assert not (checkpoints / "iter_0000004").exists()
    assert writers0 == writers1 == [], "rank 0's write, started, is killed"
    assert time.monotonic() - started < 60
