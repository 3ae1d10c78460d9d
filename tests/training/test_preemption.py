"""Preemption and crashes, in real processes: SIGTERM saves and exits cleanly; a kill -9 in the
middle of a save leaves the previous checkpoint as the one resumed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megaloop.config import save_yaml
from megaloop.train import EXIT_RESUMABLE
from megaloop.training import checkpoint as ckpt
from tests.training.conftest import tiny_run

REPO = Path(__file__).parents[2]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _train_lines(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    return [x for x in lines if x["kind"] == "train"]


def test_sigterm_saves_a_checkpoint_and_exits_resumable(mcore, pattern_data, tmp_path):
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 10_000, "log_interval": 1})
    save_yaml(cfg, tmp_path / "run.yaml")
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "megaloop.train", "--config",
                             str(tmp_path / "run.yaml")], env=_env(), cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while len(_train_lines(tmp_path)) < 3:
        assert proc.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
        assert time.time() < deadline, "training did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_RESUMABLE
    log.close()
    latest = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    last_logged = _train_lines(tmp_path)[-1]["step"]
    assert latest is not None and ckpt.step_of(latest) == last_logged >= 3
    assert last_logged < 10_000


KILL_DURING_SECOND_SAVE = textwrap.dedent("""
    import os, signal, sys
    from megatron.core import dist_checkpointing
    from megaloop.config import load_yaml
    from megaloop.training.trainer import Trainer

    original, calls = dist_checkpointing.save, []

    def save_then_die(state, directory, *args, **kwargs):
        calls.append(directory)
        original(state, directory, *args, **kwargs)  # every file of the checkpoint is written...
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # ...but the rename never happens

    dist_checkpointing.save = save_then_die
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
    with open(log, "w") as out:
        # Own session: the killed trainer's helper processes (dist_checkpointing's writer
        # manager) are orphaned, and killing the group cleans them up.
        proc = subprocess.Popen([sys.executable, str(tmp_path / "crash.py"),
                                 str(tmp_path / "run.yaml")], env=_env(), cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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


SIGTERM_DURING_START_UP = textwrap.dedent("""
    import runpy, signal, sys

    class ReportFirstTorchImport:  # a meta-path finder that only watches
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                handled = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
                print(f"importing torch; SIGTERM handled: {handled}", flush=True)
                signal.raise_signal(signal.SIGTERM)  # preempted in the first second
            return None

    sys.meta_path.insert(0, ReportFirstTorchImport())
    sys.argv = ["megaloop-train", "--config", sys.argv[1]]
    runpy.run_module("megaloop.train", run_name="__main__")
""")


def test_a_sigterm_during_start_up_exits_resumable_with_a_word(mcore, pattern_data, tmp_path):
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 10_000})
    save_yaml(cfg, tmp_path / "run.yaml")
    (tmp_path / "start_up.py").write_text(SIGTERM_DURING_START_UP)
    proc = subprocess.run([sys.executable, str(tmp_path / "start_up.py"),
                           str(tmp_path / "run.yaml")], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert "importing torch; SIGTERM handled: True" in proc.stdout, proc.stdout
    assert proc.returncode == EXIT_RESUMABLE, proc.stderr[-2000:]
    assert "stopped by signal 15 before the first step; nothing to save" in proc.stderr
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_sigusr1_saves_at_the_end_of_the_step_and_stops(mcore, pattern_data, tmp_path):
    """SLURM's --signal=B:USR1@600 warning: the step in flight completes, then a checkpoint."""
    from megaloop.training.trainer import Trainer

    before = signal.getsignal(signal.SIGUSR1)
    trainer = Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 10}))
    train_step = trainer.train_step

    def signalled_during_step_3(data):
        if trainer.step == 3:
            signal.raise_signal(signal.SIGUSR1)
        return train_step(data)

    trainer.train_step = signalled_during_step_3
    result = trainer.train()
    assert result == {"step": 3, "stopped_by_signal": signal.SIGUSR1}
    assert ckpt.step_of(ckpt.latest_checkpoint(tmp_path / "checkpoints")) == 3
    assert signal.getsignal(signal.SIGUSR1) is before, "the handlers are put back"
