"""Preemption and crashes, in real processes: SIGTERM saves and exits cleanly, or during set-up
stops at the next phase boundary; a second SIGTERM exits at once; a second SIGTERM or a kill -9 in
the middle of a save leaves the previous checkpoint as the one resumed. Signals go to the whole
process group, as SLURM and ``kill -- -PGID`` send them: the trainer's children (megatron-core's
checkpoint writers and results-queue manager) get them too, and none is left behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megaloop.config import save_yaml
from megaloop.train import EXIT_RESUMABLE
from megaloop.training import checkpoint as ckpt
from megaloop.training.signals import StopSignals
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run
from tests.training.process_groups import (end_group, processes_in_group, script_env,
                                          signal_this_process, start_in_own_session,
                                          wait_for_log, wait_until_group_ends)

def _train_lines(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    return [x for x in lines if x["kind"] == "train"]


def _train(tmp_path: Path, *overrides: str, log: str = "train.log") -> subprocess.Popen:
    """megaloop-train on ``tmp_path/run.yaml``, leader of a process group of its own."""
    return start_in_own_session(["-m", "megaloop.train", "--config", str(tmp_path / "run.yaml"),
                                 *overrides], tmp_path, tmp_path / log)


def _train_past_a_save(pattern_data, tmp_path: Path) -> subprocess.Popen:
    """A long megaloop-train run (``_train``), once it has saved step 2 and logged step 3."""
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 10_000, "log_interval": 1},
                   checkpoint={"save_interval": 2})
    save_yaml(cfg, tmp_path / "run.yaml")
    proc = _train(tmp_path)
    try:
        deadline = time.time() + 180
        while len(_train_lines(tmp_path)) < 3:  # step 2 is saved
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
    except BaseException:
        end_group(proc.pid)
        raise
    return proc


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_to_the_process_group_saves_a_checkpoint_and_exits_resumable(
        mcore, pattern_data, tmp_path, signum):
    proc = _train_past_a_save(pattern_data, tmp_path)
    try:
        assert any("multiprocessing.spawn" in line for line in processes_in_group(proc.pid)), \
            "megatron-core's results-queue manager, started by the first save, is there to signal"
        os.killpg(proc.pid, signum)
        assert proc.wait(timeout=120) == EXIT_RESUMABLE, \
            (tmp_path / "train.log").read_text()[-2000:]
        wait_until_group_ends(proc.pid)
    finally:
        end_group(proc.pid)
    latest = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    last_logged = _train_lines(tmp_path)[-1]["step"]
    assert latest is not None and ckpt.step_of(latest) == last_logged >= 3
    if signum != signal.SIGTERM:  # the checkpoint either signal leaves is the same: resume one
        return

    resumed = _train(tmp_path, f"train.train_steps={last_logged + 1}", log="resumed.log")
    try:
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-2000:]
        wait_until_group_ends(resumed.pid)  # a normal exit leaves no child either
    finally:
        end_group(resumed.pid)
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    assert _train_lines(tmp_path)[-1]["step"] == last_logged + 1


KILL_DURING_SECOND_SAVE = textwrap.dedent("""
    import os, signal, sys
    from megaloop.config import load_yaml
    from megaloop.training import checkpoint_save
    from megaloop.training.trainer import Trainer

    original, calls = checkpoint_save._finish, []

    def die_before_the_second_finalize(save, *args):
        calls.append(save)
        if len(calls) == 2:  # every file of the checkpoint is written...
            os.kill(os.getpid(), signal.SIGKILL)  # ...but the rename never happens
        return original(save, *args)

    checkpoint_save._finish = die_before_the_second_finalize
    if __name__ == "__main__":
        Trainer(load_yaml(sys.argv[1])).train()
""")


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(mcore, pattern_data,
                                                                      tmp_path):
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 6},
                   checkpoint={"save_interval": 2})
    save_yaml(cfg, tmp_path / "run.yaml")
    (tmp_path / "crash.py").write_text(KILL_DURING_SECOND_SAVE)
    log = tmp_path / "crash.log"
    # Own session: the killed trainer's helper processes (dist_checkpointing's writer manager)
    # are orphaned, and killing the group cleans them up.
    proc = start_in_own_session([str(tmp_path / "crash.py"), str(tmp_path / "run.yaml")],
                                tmp_path, log)
    try:
        returncode = proc.wait(timeout=300)
    finally:
        end_group(proc.pid)
    assert returncode == -signal.SIGKILL, log.read_text()[-2000:]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "iter_0000004.tmp").is_dir()
    assert not (checkpoints / "iter_0000004").exists()
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000002"

    trainer = Trainer(cfg)
    assert trainer.step == 2
    trainer.train()
    assert not list(checkpoints.glob("*.tmp")), "the next save clears a killed save's leftovers"
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000006"


HANG_AFTER_WRITING_STEP_4 = textwrap.dedent("""
    import sys, time
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data_multiproc


    class NeverReported:
        def put(self, results):
            print("step 4 written, completion not reported", flush=True)
            time.sleep(3600)


    def write_then_hang(transforms, use_msc, rank, buckets, results):  # in the forked writer
        if "iter_0000004.tmp" in buckets[0][0]:
            results = NeverReported()  # every shard written, the save still in flight
        write(transforms, use_msc, rank, buckets, results)


    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_then_hang)
    if __name__ == "__main__":
        from megaloop.train import cli

        sys.argv = ["megaloop-train", "--config", sys.argv[1]]
        cli()
""")


def test_kill_9_while_a_background_write_is_in_flight_leaves_the_previous_checkpoint(
        mcore, pattern_data, tmp_path):
    """checkpoint.async_save: the whole process group (trainer and writers) killed while step
    4's write is in flight and training has gone on past it."""
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 6, "log_interval": 1},
                   checkpoint={"save_interval": 2, "async_save": True})
    save_yaml(cfg, tmp_path / "run.yaml")
    (tmp_path / "hang.py").write_text(HANG_AFTER_WRITING_STEP_4)
    log = tmp_path / "hang.log"
    proc = start_in_own_session([str(tmp_path / "hang.py"), str(tmp_path / "run.yaml")],
                                tmp_path, log)
    try:
        wait_for_log(proc, log, lambda text: "completion not reported" in text and any(
            line["step"] == 5 for line in _train_lines(tmp_path)), timeout_s=300)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        # The writer, which holds the run directory's lock too (a fork), may die after the trainer.
        wait_until_group_ends(proc.pid)
    finally:
        end_group(proc.pid)
    checkpoints = tmp_path / "checkpoints"
    assert list((checkpoints / "iter_0000004.tmp").glob("*.distcp")), "the shards were written"
    assert not (checkpoints / "iter_0000004").exists()
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000002"

    trainer = Trainer(cfg)  # verifies iter_0000002 and loads it; the .tmp is not looked at
    assert trainer.step == 2
    trainer.train()
    assert not list(checkpoints.glob("*.tmp")), "the next save clears a killed save's leftovers"
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000006"


SIGTERM_DURING_START_UP = textwrap.dedent("""
    import importlib, os, re, runpy, signal, sys

    watched, launch, config = sys.argv[1:]

    class SignalAtFirstImport:  # a meta-path finder that only watches
        def find_spec(self, name, path=None, target=None):
            if name == watched:
                sys.meta_path.remove(self)
                handled = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
                print(f"importing {name}; SIGTERM handled: {handled}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # preempted in the first second
            return None

    sys.meta_path.insert(0, SignalAtFirstImport())
    sys.argv = ["megaloop-train", "--config", config]
    if launch == "module":  # python -m megaloop.train
        runpy.run_module("megaloop.train", run_name="__main__")
    else:  # the console script, as pip writes it from setup.py's entry point
        module, function = re.search(r'"megaloop-train=([\\w.]+):(\\w+)"',
                                     open("setup.py").read()).groups()
        getattr(importlib.import_module(module), function)()
""")


@pytest.mark.parametrize("watched, launch", [
    ("torch", "module"),
    # Before the handlers are installed (psutil is imported for them): before, exit -15, no word.
    ("psutil", "module"), ("psutil", "console")])
def test_a_sigterm_during_start_up_exits_resumable_with_a_word(mcore, pattern_data, tmp_path,
                                                               watched, launch):
    cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 10_000})
    save_yaml(cfg, tmp_path / "run.yaml")
    (tmp_path / "start_up.py").write_text(SIGTERM_DURING_START_UP)
    proc = subprocess.run([sys.executable, str(tmp_path / "start_up.py"), watched, launch,
                           str(tmp_path / "run.yaml")], env=script_env(),
                          cwd=Path(__file__).parents[2], capture_output=True, text=True,
                          timeout=300)
    assert f"importing {watched}; SIGTERM handled: {watched == 'torch'}" in proc.stdout, \
        proc.stdout
    assert proc.returncode == EXIT_RESUMABLE, proc.stderr[-2000:]
    assert ("stopped by signal 15 during set-up, after joining the process group; nothing to "
            "save") in proc.stderr
    # The first boundary: no dataset was built, and the run left no lock file or checkpoints/.
    assert sorted(os.listdir(tmp_path)) == ["run.yaml", "start_up.py"]


def _signalled_while_building_datasets(monkeypatch, stop_signals: StopSignals,
                                       signalled: bool = True):
    import megaloop.training.trainer as trainer_module

    build_datasets = trainer_module.build_datasets

    def build(cfg, *progress):
        if signalled:
            signal_this_process(signal.SIGTERM, stop_signals)
        return build_datasets(cfg, *progress)

    monkeypatch.setattr(trainer_module, "build_datasets", build)


def test_a_signal_during_set_up_stops_it_at_the_next_boundary(mcore, pattern_data, tmp_path,
                                                              monkeypatch):
    from megaloop.training.trainer import Trainer

    stop_signals = StopSignals()
    try:
        _signalled_while_building_datasets(monkeypatch, stop_signals)
        trainer = Trainer(tiny_run(pattern_data, tmp_path), stop_signals)
    finally:
        stop_signals.restore()
    assert trainer.stopped_during_set_up
    assert not hasattr(trainer, "model"), "the model is not built after a stop signal"
    assert trainer.train() == {"step": 0, "stopped_by_signal": signal.SIGTERM}
    # Only the dataset cache (tiny_run keeps it in the run directory) holds anything: it stays.
    assert sorted(os.listdir(tmp_path)) == ["cache"]


def _one_rank_signalled_while_building_datasets(rank, world_size, data_prefix, out_dir):
    import pytest

    from megaloop.training.trainer import Trainer

    stop_signals = StopSignals()
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _signalled_while_building_datasets(monkeypatch, stop_signals, signalled=rank == 1)
            trainer = Trainer(tiny_run(data_prefix, Path(out_dir)), stop_signals)
    finally:
        stop_signals.restore()
    # The public all-rank agreement (the one loops outside the Trainer's own, such as
    # tools/bench/pipeline_balance.py, call) still holds the stop afterwards, on every rank.
    return (trainer.stopped_during_set_up, hasattr(trainer, "model"), trainer.stop_requested(),
            trainer.train())


def test_every_rank_stops_set_up_where_one_rank_saw_the_signal(mcore, pattern_data, tmp_path):
    outcomes = run_distributed(_one_rank_signalled_while_building_datasets, world_size=2,
                               data_prefix=pattern_data, out_dir=str(tmp_path))
    assert outcomes == [(True, False, True, {"step": 0, "stopped_by_signal": signal.SIGTERM})] * 2


HANG_IN_CPP = textwrap.dedent("""
    import datetime, importlib, runpy, sys
    import torch.distributed as dist


    def hang_on_call(module_name, name, nth):
        module = importlib.import_module(module_name)
        original, calls = getattr(module, name), []

        def hang(*args, **kwargs):  # stuck inside C++, as on a dead peer or a dead filesystem
            calls.append(name)
            if len(calls) < nth:
                return original(*args, **kwargs)
            store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(minutes=10))
            print(f"hanging in {name}", flush=True)
            store.wait(["never set"])

        setattr(module, name, hang)


    if __name__ == "__main__":  # not in the checkpoint writer's spawned processes
        config, module_name, name, nth = sys.argv[1:]
        hang_on_call(module_name, name, int(nth))
        sys.argv = ["megaloop-train", "--config", config]
        runpy.run_module("megaloop.train", run_name="__main__")
""")



def _two_stop_signals_while_hung(tmp_path: Path, cfg, hang: tuple[str, str, int],
                                 second: int) -> tuple[int, str]:
    """Runs megaloop-train until it hangs in ``hang`` (module, function, call number), sends
    SIGTERM to its process group, then once it has said so ``second``; (exit status, stderr),
    once no process of the group is left."""
    save_yaml(cfg, tmp_path / "run.yaml")
    (tmp_path / "hang.py").write_text(HANG_IN_CPP)
    out, err = tmp_path / "hang.out", tmp_path / "hang.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "hang.py"),
                                 str(tmp_path / "run.yaml"), *map(str, hang)], env=script_env(),
                                cwd=tmp_path, stdout=stdout, stderr=stderr,
                                start_new_session=True)
    try:
        for marker, path, then in ((f"hanging in {hang[1]}", out, signal.SIGTERM),
                                   ("SIGTERM received", err, second)):
            deadline = time.time() + 180
            while marker not in path.read_text():
                assert proc.poll() is None, err.read_text()[-2000:]
                assert time.time() < deadline, f"no {marker!r}: {err.read_text()[-2000:]}"
                time.sleep(0.1)
            os.killpg(proc.pid, then)
        status = proc.wait(timeout=60)
        wait_until_group_ends(proc.pid)  # the exit at once kills the trainer's children
        return status, err.read_text()
    finally:
        end_group(proc.pid)


def test_a_second_stop_signal_during_set_up_exits_at_once(mcore, pattern_data, tmp_path):
    cfg = tiny_run(pattern_data, tmp_path)
    status, stderr = _two_stop_signals_while_hung(
        tmp_path, cfg, ("megaloop.training.trainer", "build_datasets", 1), signal.SIGUSR1)
    assert status == 128 + signal.SIGUSR1, stderr[-2000:]
    assert ("megaloop: a second stop signal (SIGUSR1): exiting at once with status 138, without "
            "saving; the run had not started training\n") in stderr


@pytest.mark.parametrize("hang, left", [
    # sharded_save calls it once a save, in the trainer, before the writer starts
    (("megatron.core.dist_checkpointing.state_dict_utils", "save_preprocess", 2),
     "iter_0000004.tmp"),
    (("megaloop.training.checkpoint_save", "write_text_atomic", 2), "iter_0000004"),  # complete
], ids=["writing the shards", "moving latest"])
def test_a_second_sigterm_during_a_hung_save_leaves_the_previous_checkpoint(
        mcore, pattern_data, tmp_path, hang, left):
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 6},
                   checkpoint={"save_interval": 2})
    status, stderr = _two_stop_signals_while_hung(tmp_path, cfg, hang, signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, stderr[-2000:]
    checkpoints = tmp_path / "checkpoints"
    assert (f"exiting at once with status 143, without saving; the save of step 4 is cut short: "
            f"{checkpoints / 'latest'} names iter_0000002 (or iter_0000004 if that save had just "
            "completed; an unfinished iter_0000004.tmp is never loaded, and the next save "
            "removes it)\n") in stderr
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000002"
    assert (checkpoints / left).is_dir()
    trainer = Trainer(cfg)  # verifies the checkpoint and loads it
    assert trainer.step == 2
    trainer.close()


def _signal_during_step(trainer, step: int, signum: int) -> None:
    """Has ``signum`` reach ``trainer``'s handlers while its step ``step`` runs."""
    train_step = trainer.train_step

    def signalled(data):
        if trainer.step == step:
            signal_this_process(signum, trainer.stop_signals)
        return train_step(data)

    trainer.train_step = signalled


@pytest.mark.parametrize("checkpoint", [{}, {"save_interval": 2, "async_save": True}],
                         ids=["sync", "async"])
def test_sigusr1_saves_at_the_end_of_the_step_and_stops(mcore, pattern_data, tmp_path,
                                                        checkpoint):
    """SLURM's --signal=B:USR1@600 warning: the step in flight completes, then a checkpoint
    (with async_save, step 2's write finalized first and step 3's waited for)."""
    from megaloop.training.trainer import Trainer

    before = signal.getsignal(signal.SIGUSR1)
    trainer = Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 10},
                               checkpoint=checkpoint))
    _signal_during_step(trainer, 3, signal.SIGUSR1)
    result = trainer.train()
    assert result == {"step": 3, "stopped_by_signal": signal.SIGUSR1}
    assert ckpt.step_of(ckpt.latest_checkpoint(tmp_path / "checkpoints")) == 3
    assert trainer.saver.pending_step is None
    assert [t["step"] for t in trainer.saver.timings] == ([2, 3] if checkpoint else [3])
    assert signal.getsignal(signal.SIGUSR1) is before, "the handlers are put back"


def test_ctrl_c_exits_130_in_one_line_naming_the_latest_checkpoint(mcore, pattern_data, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group, the writers' included) stops at once
    without saving: one line and the shell's 130, not the traceback of wherever it fell and 1."""
    from megaloop.train import EXIT_INTERRUPTED

    proc = _train_past_a_save(pattern_data, tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=120)
        wait_until_group_ends(proc.pid)
    finally:
        end_group(proc.pid)
    text = (tmp_path / "train.log").read_text()
    assert status == EXIT_INTERRUPTED == 130, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    latest = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    said = text.splitlines()[-1]  # mid-step, or mid-save (then naming the save cut short too)
    assert said.startswith("error: interrupted by SIGINT (Ctrl-C): exiting with status 130, "
                           "without saving (SIGTERM or SIGUSR1 saves first); "), said
    assert f"{tmp_path / 'checkpoints' / 'latest'} names " in said and latest.name in said, said
    ckpt.verify_checkpoint(latest)


def test_a_stop_signal_in_the_last_step_still_makes_the_final_evaluation(mcore, pattern_data,
                                                                          tmp_path):
    """The checkpoint of the last step is the run's end: a relaunch finds the run complete and
    evaluates nothing, so the final evaluation is made now, after that save, and the run exits
    as finished (0), not resumable (75), which would requeue a job with nothing left to do."""
    from megaloop.training.trainer import Trainer

    trainer = Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 3}))
    _signal_during_step(trainer, 3, signal.SIGTERM)
    result = trainer.train()
    assert "stopped_by_signal" not in result and result["step"] == 3, result
    assert result["val_loss"] > 0
    assert ckpt.step_of(ckpt.latest_checkpoint(tmp_path / "checkpoints")) == 3
    evaluations = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                   if '"eval"' in line]
    assert [record["step"] for record in evaluations] == [3], evaluations
