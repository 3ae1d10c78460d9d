"""Storage faults are found before training, one directory serves one live run at a time, and a
refused set-up leaves the run directories as it found them."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaloop.config import ConfigError
from megaloop.data import DataError
from megaloop.training.checkpoint import CheckpointError
from megaloop.training.run_dir import LOCK_FILE, RunLock
from megaloop.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run, unlink_refused

REPO = Path(__file__).parents[2]


def _one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.fixture
def no_model(monkeypatch):
    import megaloop.models.model as model_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(model_module, "LoopedLM", refuse)


@pytest.mark.parametrize("field", ["train.out_dir", "checkpoint.dir"])
def test_a_directory_below_a_file_is_refused_before_the_model_is_built(
        mcore, pattern_data, tmp_path, no_model, field):
    blocker = tmp_path / "results.txt"
    blocker.write_text("not a directory")
    target = blocker / "run"
    cfg = tiny_run(pattern_data, tmp_path / "run")
    if field == "train.out_dir":
        cfg.train.out_dir = str(target)
    else:
        cfg.checkpoint.dir = str(target)
    with pytest.raises(ConfigError) as error:
        Trainer(cfg)
    assert _one_line(error) == f"{field}={str(target)!r}: {blocker} is a file, not a directory"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write to: a chmod, or for root (whom permissions do not
    stop) a read-only tmpfs mount."""
    path = tmp_path / "read_only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("running as root without permission to mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_checkpoint_dir_fails_before_step_one(mcore, pattern_data, tmp_path,
                                                          read_only_dir, no_model):
    # save_interval=0: the first save would come only after the whole run.
    cfg = tiny_run(pattern_data, tmp_path / "run", checkpoint={"dir": str(read_only_dir),
                                                                "save_interval": 0})
    with pytest.raises(ConfigError) as error:
        Trainer(cfg)
    message = _one_line(error)
    assert message.startswith(f"checkpoint.dir={str(read_only_dir)!r}: not writable"), message
    assert not (tmp_path / "run").exists(), "train.out_dir, made first, is removed again"


def test_a_second_trainer_on_a_directory_in_use_is_refused(mcore, pattern_data, tmp_path):
    first = Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 1}))
    with pytest.raises(ConfigError) as error:
        Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 1}))
    assert f"pid {os.getpid()} on " in _one_line(error) and "in use by another run" in str(
        error.value)
    # A different out_dir sharing the checkpoint directory is refused too.
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*in use by another run"):
        Trainer(tiny_run(pattern_data, tmp_path / "other", train={"train_steps": 1},
                         checkpoint={"dir": str(tmp_path / "checkpoints")}))
    first.close()
    Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 1})).close()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from megaloop.training.run_dir import RunLock
lock = RunLock(Path(sys.argv[1]), "train.out_dir")
print("locked", flush=True)
time.sleep(600)
"""


def test_a_live_run_in_another_process_blocks_and_a_killed_one_does_not(mcore, pattern_data,
                                                                        tmp_path):
    tmp_path.mkdir(exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid} on "):
            Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 1}))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    # The crashed holder's lock file is still there, stating a dead pid: it does not block.
    assert f"pid {holder.pid}" in (tmp_path / LOCK_FILE).read_text()
    start = time.perf_counter()
    Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 1})).train()
    assert time.perf_counter() - start < 120


def _refused_on_every_rank(rank, world_size, data_prefix, out_dir):
    cfg = tiny_run(data_prefix, Path(out_dir))
    try:
        Trainer(cfg)
    except ConfigError as e:
        return str(e)
    return None


def test_every_rank_raises_rank_zeros_storage_error(mcore, pattern_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    messages = run_distributed(_refused_on_every_rank, world_size=2, data_prefix=pattern_data,
                               out_dir=str(blocker / "run"))
    assert messages[0] == messages[1] and "is a file, not a directory" in messages[0]


@pytest.mark.parametrize("error", ["ENOLCK", "EOPNOTSUPP"])
def test_a_filesystem_without_locks_warns_and_runs(tmp_path, monkeypatch, caplog, error):
    """Lustre mounted noflock answers flock with ENOLCK: the run goes on, and says it is unguarded.
    Any other OSError is a real fault and propagates."""
    import errno
    import fcntl
    import logging

    from megaloop.training.run_dir import RunLock

    def no_locks(*args):
        raise OSError(getattr(errno, error), os.strerror(getattr(errno, error)))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        lock = RunLock(tmp_path, "train.out_dir")
    lock.release()
    assert f"{tmp_path / LOCK_FILE}: the filesystem does not support file locks" in caplog.text
    assert "will not be detected" in caplog.text

    def io_error(*args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", io_error)
    with pytest.raises(OSError, match="I/O error"):
        RunLock(tmp_path, "train.out_dir")


REFUSALS = {  # set-ups refused after the run directories were made: (config change, error)
    "missing data file": (lambda cfg, tmp: setattr(cfg.data, "path", [str(tmp / "absent")]),
                          DataError, "absent"),
    "token ids beyond the vocabulary": (
        lambda cfg, tmp: setattr(cfg.model, "vocab_size", 64), DataError,
        "token id 120 is outside the model's vocabulary"),
    "checkpoint.load names nothing": (
        lambda cfg, tmp: setattr(cfg.checkpoint, "load", str(tmp / "no_checkpoint")),
        ConfigError, "no checkpoint there"),
}


def _refused(cfg, tmp_path, refusal) -> None:
    change, error, message = REFUSALS[refusal]
    change(cfg, tmp_path)
    with pytest.raises(error, match=message):
        Trainer(cfg)


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_set_up_removes_the_run_directories_it_made(mcore, pattern_data, tmp_path,
                                                              refusal):
    out_dir = tmp_path / "runs" / "first"
    cfg = tiny_run(pattern_data, out_dir)
    cfg.data.cache_dir = str(tmp_path / "cache")  # shared with other runs: made, and kept
    _refused(cfg, tmp_path, refusal)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_set_up_keeps_what_the_run_directory_held(mcore, pattern_data, tmp_path,
                                                            refusal):
    out_dir = tmp_path / "run"
    (out_dir / "empty").mkdir(parents=True)
    (out_dir / "notes.txt").write_text("mine")
    (out_dir / "checkpoints").mkdir()
    (out_dir / "checkpoints" / LOCK_FILE).write_text("pid 1 on a finished run\n")
    before = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*"))
    cfg = tiny_run(pattern_data, out_dir)
    cfg.data.cache_dir = str(tmp_path / "cache")
    _refused(cfg, tmp_path, refusal)
    assert sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")) == before


def test_a_lock_file_removed_as_another_run_opens_it_is_locked_afresh(tmp_path, monkeypatch):
    """A run that gives up during set-up removes the lock file it made while holding it; a run
    that opened the file just before then locks a file no longer at the path, and must retry."""
    import fcntl

    giving_up = RunLock(tmp_path, "train.out_dir")
    assert giving_up.created
    flock = fcntl.flock

    def the_other_run_gives_up_first(file, operation):
        monkeypatch.setattr(fcntl, "flock", flock)
        giving_up.release(remove_created=True)
        return flock(file, operation)

    monkeypatch.setattr(fcntl, "flock", the_other_run_gives_up_first)
    holder = RunLock(tmp_path, "train.out_dir")
    assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
    with pytest.raises(ConfigError, match="in use by another run"):
        RunLock(tmp_path, "train.out_dir")
    holder.release()


@pytest.fixture(scope="module")
def weights_only_checkpoint(mcore, pattern_data, tmp_path_factory):
    """A checkpoint that a run starting from it with checkpoint.load_optimizer=true refuses in its
    last set-up phase, the load, after the ALRS log is opened."""
    import torch

    seed_run = tmp_path_factory.mktemp("seed")
    with Trainer(tiny_run(pattern_data, seed_run, train={"use_alrs": True})) as trainer:
        path = trainer.save()
    common = torch.load(path / "common.pt", weights_only=True)
    del common["trainer"]
    torch.save(common, path / "common.pt")
    return path


def _contents(directory: Path) -> dict:
    """Every path under ``directory`` with its bytes; a lock file's text (holder and time, which
    a run that takes the lock rewrites) is left out, not its existence."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() and p.name != LOCK_FILE
            else None for p in directory.rglob("*")}


@pytest.mark.parametrize("log_existed", [False, True])
def test_a_set_up_refused_at_the_load_removes_only_an_alrs_log_it_created(
        mcore, pattern_data, tmp_path, weights_only_checkpoint, log_existed):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    if log_existed:  # an earlier run's in this directory: kept, whatever this run opened
        Trainer(tiny_run(pattern_data, out_dir, train={"use_alrs": True})).close()
        assert (out_dir / "alrs.zarr" / "zarr.json").is_file()
    before = _contents(out_dir)
    cfg = tiny_run(pattern_data, out_dir, train={"use_alrs": True},
                   checkpoint={"load": str(weights_only_checkpoint)})
    cfg.data.cache_dir = str(tmp_path / "cache")
    with pytest.raises(CheckpointError, match="holds model weights only"):
        Trainer(cfg)
    assert _contents(out_dir) == before


@pytest.mark.parametrize("directory, refused", [
    ("/lustre/alice/run", None),  # the site's enroot configuration mounts it, not the job
    ("/data/team a/run", None),  # the kernel escapes the space
    ("/workspace/megaloop/runs/x", None),
    ("/results/run", "it is on the container's own root file system (xfs at /)"),
    ("/tmp/run", "it is in memory (tmpfs at /tmp)"),  # enroot's own tmpfs
    ("/dev/shm/run", "it is in memory (tmpfs at /dev/shm)"),
    ("/scratch/run", "it is in memory (tmpfs at /scratch)"),  # though the job mounts it
])
def test_a_run_directory_in_a_container_must_be_on_a_mount_from_the_host(
        monkeypatch, directory, refused):
    """Before: only the job's own mount points (MEGALOOP_CONTAINER_MOUNTS) counted, so a
    directory on a file system every container of the site gets (/lustre here) was refused, and
    one on a tmpfs the job mounts accepted. What holds it is now read from the container's mount
    table: its root and memory file systems are refused, any other mount accepted."""
    from megaloop.platform import mounts
    from megaloop.training.run_dir import _check_mounted

    monkeypatch.setattr(mounts, "MOUNTINFO", REPO / "tests" / "platform" / "mountinfo_enroot.txt")
    monkeypatch.setenv("MEGALOOP_CONTAINER_MOUNTS", "/workspace/megaloop:/data/team a:/scratch")
    if refused is None:
        _check_mounted(Path(directory), "checkpoint.dir")
        return
    with pytest.raises(ConfigError) as error:
        _check_mounted(Path(directory), "checkpoint.dir")
    assert _one_line(error) == (
        f"checkpoint.dir={directory!r}: not on a file system mounted from the host: {refused}; it "
        "would be lost with the container, and a requeued job would start over: choose a "
        "directory on a mounted file system (the job mounts /workspace/megaloop, /data/team a, "
        "/scratch; slurm/ scripts: add one to MOUNTS)")


def test_a_run_directory_in_a_container_whose_mounts_cannot_be_read_must_be_on_the_job_s(
        monkeypatch, tmp_path):
    from megaloop.platform import mounts
    from megaloop.training.run_dir import _check_mounted

    monkeypatch.setattr(mounts, "MOUNTINFO", tmp_path / "absent")
    monkeypatch.setenv("MEGALOOP_CONTAINER_MOUNTS", "/workspace/megaloop:/lustre")
    _check_mounted(Path("/lustre/run"), "train.out_dir")
    with pytest.raises(ConfigError) as error:
        _check_mounted(Path("/scratch/run"), "train.out_dir")
    assert (f"the container's mounts are unknown ({tmp_path / 'absent'}: No such file"
            in _one_line(error))


def test_what_a_refused_set_up_made_and_cannot_delete_is_one_warning_naming_the_path(
        tmp_path, monkeypatch, caplog):
    """Before the fix: shutil.rmtree(ignore_errors=True), without a word."""
    import logging

    from megaloop.training.run_dir import RunDirs

    dirs = RunDirs(tmp_path / "out", tmp_path / "out" / "checkpoints")
    dirs.prepare()
    made = tmp_path / "out" / "made"
    dirs.created(made)
    made.mkdir()
    (made / "held").write_text("x")
    unlink_refused(monkeypatch, "held")
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        dirs.undo()
    assert [r.getMessage() for r in caplog.records] == [
        f"{made}: made by this run's set-up, which did not complete, not wholly deleted "
        f"({made / 'held'}: Permission denied); remove it by hand"]
