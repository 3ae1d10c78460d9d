"""The processes of a checkpoint save, under what the machine does to them: a writer that cannot
be started on one rank fails the save on every rank at once, and a trainer killed with
``kill -9`` mid-save leaves no process of the run behind."""

import contextlib
import errno
import io
import os
import signal
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from megaloop.cli import print_error
from megaloop.training import checkpoint as ckpt
from megaloop.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run
from tests.training.process_groups import (end_group, processes_in_group, start_in_own_session,
                                          wait_for_log)


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


def _forks(process: psutil.Process) -> list[str]:
    """The children of ``process`` forked from it (a writer), not spawned (the results-queue
    manager), each as its pid and command line: what a rank can send back (a psutil.Process
    holds a lock, which does not pickle). Not told apart by their command lines: a spawned
    child's names its descriptors, which can be the numbers in its parent's own."""
    import multiprocessing.context

    spawned = {child.pid for child in multiprocessing.active_children()
               if isinstance(child, multiprocessing.context.SpawnProcess)}
    return [f"{child.pid}: {' '.join(child.cmdline())}" for child in process.children()
            if child.status() != psutil.STATUS_ZOMBIE and child.pid not in spawned]


def _fork_refused_on_rank_1(rank, world_size, data_prefix, out_dir, async_save):
    trainer = Trainer(tiny_run(data_prefix, Path(out_dir) / "run", train={"train_steps": 8},
                               checkpoint={"save_interval": 2, "async_save": async_save}))
    with pytest.MonkeyPatch.context() as monkeypatch:
        if rank == 1:
            _refuse_the_second_fork(monkeypatch)
        try:
            trainer.train()
        except ckpt.CheckpointError as e:
            with contextlib.redirect_stderr(io.StringIO()) as printed:
                print_error(e)
            return str(e), printed.getvalue(), trainer.step, _forks(psutil.Process())
        finally:
            trainer.close()
    return None, "", trainer.step, []


@pytest.mark.timeout(120, method="thread")  # the old code: rank 0 waited in the finalize's
# all-reduce, which rank 1 never joined, until the process-group timeout (30 minutes)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_writer_that_cannot_start_on_one_rank_fails_the_save_on_every_rank(
        mcore, pattern_data, tmp_path, async_save):
    started = time.monotonic()
    results = run_distributed(_fork_refused_on_rank_1, world_size=2, data_prefix=pattern_data,
                              out_dir=str(tmp_path), async_save=async_save)
    checkpoints = tmp_path / "run" / "checkpoints"
    (error0, printed0, step0, writers0), (error1, printed1, step1, writers1) = results
    assert error0 == error1, "the same line on every rank"
    assert (printed0, printed1) == (f"error: {error0}\n", ""), "said by rank 0 alone"
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


SLOW_WRITE_OF_STEP_4 = textwrap.dedent("""
    import sys, time
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data


    def slow(*args, **kwargs):  # in a worker of the forked writer
        if "iter_0000004.tmp" in kwargs["write_bucket"][0]:
            print("writing step 4", flush=True)
            time.sleep(120)
        return write(*args, **kwargs)


    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)
    if __name__ == "__main__":
        from megaloop.train import cli

        sys.argv = ["megaloop-train", "--config", sys.argv[1]]
        cli()
""")


@pytest.mark.timeout(300)
def test_no_process_of_a_run_survives_a_kill_9_of_its_trainer(mcore, pattern_data, tmp_path):
    """kill -9 of the trainer alone (no cgroup, no process group kill) while step 4's write is in
    flight: its writer, the writer's workers and megatron-core's results-queue manager (spawned
    by the first save) die with it. The old code left the manager orphaned for good, and the
    writer writing on (holding the run directory's lock, a fork's copy)."""
    from megaloop.config import save_yaml

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 8},
                   checkpoint={"save_interval": 2, "async_save": True})
    save_yaml(cfg, tmp_path / "run.yaml")
    (tmp_path / "slow.py").write_text(SLOW_WRITE_OF_STEP_4)
    log = tmp_path / "train.log"
    # A session of its own, only to find (and end, whatever the test's outcome) its processes.
    proc = start_in_own_session([str(tmp_path / "slow.py"), str(tmp_path / "run.yaml")],
                                tmp_path, log)
    try:
        wait_for_log(proc, log, lambda text: "writing step 4" in text, timeout_s=240)
        assert len(processes_in_group(proc.pid)) >= 4, "trainer, manager, writer, worker"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while (left := processes_in_group(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, "left alive: " + " | ".join(left)
    finally:
        end_group(proc.pid)
