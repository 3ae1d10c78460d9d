"""Checkpoints that survive what the disk and the machine do: every file and directory of a
checkpoint is on disk before ``latest`` names it, and a write killed mid-way (the OOM killer),
synchronous or in the background, ends the run in one line instead of hanging it; a checkpoint
pruned (keep_last) is gone whole for its readers, even when its deletion is killed or fails."""

import errno
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from megaloop.config import RunConfig
from megaloop.training import checkpoint as ckpt
from megaloop.training import checkpoint_save
from megaloop.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.conftest import one_line, tiny_run, train_losses, unlink_refused


def _record_syncs_and_renames(monkeypatch, log_path):
    """Appends "fsync <path>" and "replace <src> <dst>" to ``log_path`` for every os.fsync and
    os.replace, in this process and in those it forks (megatron-core's writers): one append per
    event, so that their order is kept."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        os.write(log, f"fsync {os.readlink(f'/proc/self/fd/{fd}')}\n".encode())
        return fsync(fd)

    def recording_replace(src, dst, **kwargs):
        os.write(log, f"replace {os.fspath(src)} {os.fspath(dst)}\n".encode())
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpoint_is_on_disk_before_latest_names_it(mcore, pattern_data, tmp_path,
                                                        monkeypatch, async_save):
    events = tmp_path / "events"
    cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 2},
                   checkpoint={"save_interval": 2, "async_save": async_save})
    with Trainer(cfg) as trainer:
        _record_syncs_and_renames(monkeypatch, events)
        trainer.train()
    monkeypatch.undo()
    checkpoints = tmp_path / "run" / "checkpoints"
    final = ckpt.latest_checkpoint(checkpoints)
    tmp = final.with_name(final.name + ".tmp")
    lines = events.read_text().splitlines()
    moved = lines.index(f"replace {tmp} {final}")
    pointed = next(i for i, line in enumerate(lines)
                   if line.startswith("replace ") and line.endswith(f" {checkpoints / 'latest'}"))
    synced_before = {line.split(" ", 1)[1] for line in lines[:pointed] if line.startswith("fsync ")}
    files = sorted(p.name for p in final.iterdir())
    assert {"common.pt", "metadata.json", "config.yaml", ".metadata"} <= set(files), files
    assert [name for name in files if str(tmp / name) not in synced_before] == []
    assert str(tmp) in synced_before, "the checkpoint directory (its entries)"
    parent = f"fsync {checkpoints}"
    assert parent in lines[moved:pointed], "the rename of iter_N.tmp, before latest moves"
    assert parent in lines[pointed:], "the move of latest"
    # megatron-core's writers sync the shards; they are not read back to be synced again.
    shards = [line for line in lines if line.startswith("fsync ") and line.endswith(".distcp")]
    assert len(shards) == len(set(shards)) == len(list(final.glob("*.distcp"))), shards


def _slow_workers_naming_themselves(monkeypatch, pids_file, seconds: float) -> None:
    """Each worker of a save's write (forked by its writer process, forked from this one)
    appends "<writer pid> <worker pid> <file it writes>" to ``pids_file``, then waits
    ``seconds`` and writes."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    write = FileSystemWriterAsync.write_preloaded_data

    def slow(*args, **kwargs):
        with open(pids_file, "a") as f:
            f.write(f"{os.getppid()} {os.getpid()} {kwargs['write_bucket'][0]}\n")
        time.sleep(seconds)
        return write(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(slow))


def _step_4s_write(pids_file) -> list[tuple[int, int]]:
    """(writer pid, worker pid) of each worker of step 4's write named so far."""
    lines = pids_file.read_text().splitlines() if pids_file.exists() else []
    return [(int(writer), int(worker)) for writer, worker, path in map(str.split, lines)
            if "iter_0000004.tmp" in path]


def _kill_in_step_4s_write(pids_file, victim: str) -> dict:
    """A thread SIGKILLs the writer process (``victim`` "writer") or a worker ("worker") of step
    4's write once its first worker has named itself (``_slow_workers_naming_themselves``); the
    dict returned gets the pids of both, once known."""
    import threading

    killed = {}

    def kill() -> None:
        deadline = time.monotonic() + 60
        while not _step_4s_write(pids_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _step_4s_write(pids_file):
            killed["writer"], killed["worker"] = _step_4s_write(pids_file)[0]
            if killed[victim] != os.getpid():  # a write without a writer process: not us
                os.kill(killed[victim], signal.SIGKILL)

    threading.Thread(target=kill, name="test-killer", daemon=True).start()
    return killed


def _ended(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _failed_in(async_save: bool) -> str:
    """What a failed write of a save, with or without checkpoint.async_save, says it failed in."""
    return " in its background write" if async_save else ""


@pytest.mark.timeout(120, method="thread")  # the old code waited for ever (for the report
# of the killed worker), deaf to signals: the main thread sat in waitpid() or, saving
# synchronously, in the JoinableQueue of the workers it forked itself
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("victim", ["writer", "worker"])
def test_a_writer_killed_mid_write_fails_the_save_in_one_line(
        mcore, pattern_data, tmp_path, monkeypatch, victim, async_save):
    """The OOM killer's SIGKILL to the writer process of step 4's write, or to one of the
    workers it forked: the run ends at once (with async_save within a step, not at the next save,
    nor ever), naming the checkpoint and the signal, the save is not finalized, and no process of
    the write is left (megaloop-train exits 2 on a CheckpointError)."""
    pids_file = tmp_path / "pids"
    cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 8},
                   checkpoint={"save_interval": 2, "async_save": async_save})
    trainer = Trainer(cfg)
    _slow_workers_naming_themselves(monkeypatch, pids_file, 1.5)
    killed = _kill_in_step_4s_write(pids_file, victim)
    with pytest.raises(ckpt.CheckpointError) as error:
        trainer.train()
    monkeypatch.undo()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert one_line(error) == (f"{checkpoints}/iter_0000004.tmp: saving step 4 failed"
                               f"{_failed_in(async_save)} (its writer process died of SIGKILL, "
                               f"out of memory?; {one_line(error).split('; ')[1]}; latest is "
                               "still iter_0000002")
    assert max(train_losses(tmp_path / "run")) <= (6 if async_save else 4), \
        "found by the next polls, or by the save itself"
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000002"
    assert not (checkpoints / "iter_0000004").exists()
    workers = [worker for writer, worker in _step_4s_write(pids_file)]
    deadline = time.monotonic() + 5  # a worker orphaned by its writer's death is killed with it
    while not all(map(_ended, [killed["writer"], *workers])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_ended, [killed["writer"], *workers]))


def _run_script(tmp_path, code: str):
    import subprocess
    import sys

    from tests.training.process_groups import script_env

    script = tmp_path / "user_script.py"
    script.write_text(code)
    return script, subprocess.run([sys.executable, str(script)], env=script_env(), cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)


def test_a_script_that_trains_outside_a_main_guard_is_refused_before_the_run(pattern_data,
                                                                              tmp_path):
    """megatron-core's first save spawns a process, which imports the script again: the
    unguarded Trainer would be made (and trained) twice, and the save fail with a bare EOFError
    from the copy's death."""
    script, run = _run_script(tmp_path, (
        "from pathlib import PosixPath\n"
        "from tests.training.conftest import tiny_run\n"
        "from megaloop.training.trainer import Trainer\n"
        f"cfg = tiny_run({pattern_data!r}, {tmp_path / 'run'!r}, train={{'train_steps': 2}})\n"
        "Trainer(cfg).train()\n"))
    assert run.returncode != 0
    assert run.stderr.splitlines()[-1].endswith(  # torch prefixes "[rank0]: "
        f"megaloop.training.checkpoint_files.CheckpointError: {script}: line 5 runs outside "
        "'if __name__ == \"__main__\":'; put the script's code under it: checkpoint saves start "
        "a process with the spawn method, which imports the script again and would run that "
        "code twice"), run.stderr[-3000:]
    assert "EOFError" not in run.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before the first step"


_REFUSE = "from megaloop.training.checkpoint_writer import refuse_unguarded_main\n"


@pytest.mark.parametrize("code", [
    _REFUSE + "def main():\n"
    "    refuse_unguarded_main()\n"
    "if '__main__' == __name__:\n"
    "    refuse_unguarded_main()\n"
    "    main()\n"
    "    print('not refused')\n",
    # A guard with a further condition: the spawned copy never enters it either.
    "import os\n" + _REFUSE + "if __name__ == '__main__' and not os.environ.get('DRY_RUN'):\n"
    "    refuse_unguarded_main()\n"
    "    print('not refused')\n",
    # A guarded launcher exec'ing a training script: the line is the exec'd code's, not the
    # launcher's (the copy imports the launcher, whose guard keeps the exec from running).
    "import os\n\nif __name__ == '__main__':\n"
    "    exec(" + repr("\n\n\n" + _REFUSE + "refuse_unguarded_main()\nprint('not refused')\n")
    + ")\n",
], ids=["guard", "guard_and_condition", "exec_under_guard"])
def test_code_under_a_main_guard_is_not_refused(tmp_path, code):
    script, run = _run_script(tmp_path, code)
    assert run.returncode == 0 and run.stdout == "not refused\n", run.stderr[-3000:]


def _kill_rank_1s_worker(rank, world_size, data_prefix, out_dir, async_save):
    from pathlib import Path

    out = Path(out_dir)
    with pytest.MonkeyPatch.context() as monkeypatch:
        pids_file = out / f"pids.{rank}"
        _slow_workers_naming_themselves(monkeypatch, pids_file, 1.5)
        trainer = Trainer(tiny_run(data_prefix, out / "run", train={"train_steps": 8},
                                   checkpoint={"save_interval": 2, "async_save": async_save}))
        if rank == 1:
            _kill_in_step_4s_write(pids_file, "worker")
        try:
            trainer.train()
        except ckpt.CheckpointError as e:
            return str(e), trainer.step
        return None, trainer.step


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_writer_killed_on_one_rank_fails_the_save_on_every_rank(mcore, pattern_data,
                                                                  tmp_path, async_save):
    """Two gloo ranks: rank 1's writer dies; megatron-core's collective finalize fails step 4's
    save on both at the same step, rank 1 naming the signal (no rank waits for a peer until the
    process-group timeout)."""
    started = time.monotonic()
    (rank0, step0), (rank1, step1) = run_distributed(
        _kill_rank_1s_worker, world_size=2, data_prefix=pattern_data, out_dir=str(tmp_path),
        async_save=async_save)
    tmp = tmp_path / "run" / "checkpoints" / "iter_0000004.tmp"
    failed = f"{tmp}: saving step 4 failed{_failed_in(async_save)} ("
    assert rank1.startswith(failed + "its writer process died of SIGKILL, out of memory?"), rank1
    assert rank0.startswith(failed), rank0
    assert rank0.endswith("latest is still iter_0000002")
    assert step0 == step1 <= (6 if async_save else 4)
    assert ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "iter_0000002"
    assert time.monotonic() - started < 120


# ----------------------------------------------------------------------- pruning (keep_last)

def _state() -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "n": 3}


def _checkpoints_saved_pruning_step_1(directory, monkeypatch, delete) -> None:
    """Checkpoint 1, then checkpoint 2 with keep_last=1, whose deletion of checkpoint 1 runs
    ``delete(path, shutil.rmtree, ...)`` in place of shutil.rmtree(path, ...)."""
    ckpt.save_checkpoint(directory, 1, _state(), RunConfig(), keep_last=1)
    rmtree = shutil.rmtree

    def deleting(path, *args, **kwargs):
        if Path(path).name.endswith("iter_0000001"):
            return delete(Path(path), rmtree, *args, **kwargs)
        return rmtree(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(shutil, "rmtree", deleting)
        ckpt.save_checkpoint(directory, 2, _state(), RunConfig(), keep_last=1)


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(mcore, tmp_path, monkeypatch):
    """Before the fix the deletion ran on ``iter_0000001`` itself: a kill mid-way left it
    without common.pt, a checkpoint for every reader (a lost ``latest`` resumes from the newest,
    fallback_to_previous goes back to it, tools list them) that fails to load."""
    directory = tmp_path / "checkpoints"

    def killed(path, rmtree, *args, **kwargs):  # one file gone, then the process is
        (path / "common.pt").unlink()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _checkpoints_saved_pruning_step_1(directory, monkeypatch, killed)
    assert ckpt.complete_checkpoints(directory) == [directory / "iter_0000002"]
    assert ckpt.latest_checkpoint(directory) == directory / "iter_0000002"
    remains = directory / ".pruned-iter_0000001"
    assert remains.is_dir()
    checkpoint_save.CheckpointSaver(directory, RunConfig())  # a run's start removes them
    assert sorted(p.name for p in directory.iterdir()) == ["iter_0000002", "latest"]


def test_a_failed_deletion_while_pruning_is_one_warning_naming_the_path(mcore, tmp_path,
                                                                        monkeypatch, caplog):
    """Before the fix: ignored without a word (shutil.rmtree(ignore_errors=True)), whatever
    space the checkpoint held staying taken."""
    directory = tmp_path / "checkpoints"
    remains = directory / ".pruned-iter_0000001"

    def refused(path, rmtree, *args, **kwargs):  # common.pt will not go (a busy NFS file)
        with monkeypatch.context() as patched:
            unlink_refused(patched, "common.pt")
            return rmtree(path, *args, **kwargs)

    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        _checkpoints_saved_pruning_step_1(directory, monkeypatch, refused)
    assert [r.getMessage() for r in caplog.records] == [
        f"{remains}: a checkpoint beyond checkpoint.keep_last that no run reads, not wholly "
        f"deleted ({remains / 'common.pt'}: Permission denied); removed at the next start, or "
        "remove it by hand"]
    assert ckpt.complete_checkpoints(directory) == [directory / "iter_0000002"]


@pytest.mark.parametrize("left_by", ["a killed save", "a failed save"])
def test_a_part_written_that_cannot_be_deleted_is_one_warning_naming_the_path(
        mcore, tmp_path, monkeypatch, caplog, left_by):
    """Before the fix: shutil.rmtree(ignore_errors=True), without a word, its space staying
    taken (of a failed save: what a full disk needed back)."""
    directory = tmp_path / "checkpoints"
    unlink_refused(monkeypatch, "held")
    if left_by == "a killed save":
        part = directory / "iter_0000007.tmp"
        part.mkdir(parents=True)
        (part / "held").write_text("x")
        with caplog.at_level(logging.WARNING, logger="megaloop.train"):
            ckpt.save_checkpoint(directory, 1, _state(), RunConfig(), keep_last=1)
    else:
        part = directory / "iter_0000002.tmp"

        def no_space(*args, **kwargs):
            (part / "held").write_text("x")
            raise OSError(errno.ENOSPC, "No space left on device", "common.pt")

        monkeypatch.setattr(checkpoint_save, "sync_tree", no_space)
        with caplog.at_level(logging.WARNING, logger="megaloop.train"), \
                pytest.raises(ckpt.CheckpointError, match="No space left on device"):
            ckpt.save_checkpoint(directory, 2, _state(), RunConfig(), keep_last=1)
    what = left_by.replace("a ", "", 1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{part}: the part of a checkpoint a {what} had written, not wholly deleted "
        f"({part / 'held'}: Permission denied); remove it by hand"]
