"""tests/process_state.py fails a test that leaves process-wide state changed, and puts it back
for the tests after it."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_state import LAUNCH_ENV, _umask

REPO = Path(__file__).parents[1]

LEAKS = """
import os, signal, torch

def test_rank(): os.environ["RANK"] = "1"
def test_cwd(tmp_path): os.chdir(tmp_path)
def test_mask(): signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
def test_dtype(): torch.set_default_dtype(torch.float64)
def test_umask(): os.umask(UMASK ^ 0o077)
def test_restored_by_monkeypatch(monkeypatch): monkeypatch.setenv("SLURM_PROCID", "3")

def test_next():
    assert "RANK" not in os.environ and "SLURM_PROCID" not in os.environ
    assert os.getcwd() == START and torch.get_default_dtype() == torch.float32
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, ())
    assert os.umask(UMASK) == UMASK
"""


def test_a_test_that_leaves_state_changed_fails_and_the_next_finds_it_put_back(tmp_path):
    (tmp_path / "test_leaks.py").write_text(
        f"START = {str(tmp_path)!r}\nUMASK = {_umask()}\n{LEAKS}")
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "SLURM_PROCID")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.process_state", "test_leaks.py"], cwd=tmp_path, capture_output=True,
        text=True, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, timeout=300)
    # Each leaking test's call passes and its teardown fails; the last test finds all put back.
    assert done.stdout.splitlines()[-1].startswith("7 passed, 5 errors"), done.stdout
    for leak in ("environment RANK: None -> '1'", "working directory", "blocked signals",
                 "torch default dtype torch.float32 -> torch.float64", "umask"):
        assert leak in done.stdout, done.stdout


def _leave_a_variable_set(rank, world_size):
    os.environ["MEGALOOP_TEST_LEFT"] = str(rank)


def _the_variable(rank, world_size):
    return os.environ.get("MEGALOOP_TEST_LEFT")


def test_a_distributed_call_that_leaves_state_changed_fails_and_the_next_finds_it_put_back():
    """tests/distributed.py's workers serve every test of the session, one call after another."""
    from tests.distributed import run_distributed

    with pytest.raises(AssertionError, match=r"rank 0:\n_leave_a_variable_set left changed .*"
                                             r"environment MEGALOOP_TEST_LEFT: None -> '0'"):
        run_distributed(_leave_a_variable_set, 2)
    assert run_distributed(_the_variable, 2) == [None, None]


def test_this_process_is_no_launchers_rank():
    """What every test finds, whatever launched pytest (the test below runs this one under srun's
    and torchrun's variables)."""
    from megaloop.platform.launch import detect_launch_env

    assert [key for key in os.environ if LAUNCH_ENV.fullmatch(key)] == []
    launch = detect_launch_env()
    assert (launch.launcher, launch.rank, launch.world_size) == ("single", 0, 1)


def test_under_a_launcher_the_tests_run_as_a_process_no_launcher_started():
    """Before: under `srun pytest`, rank 1 of 2, in-process tests took this process for rank 1,
    and the first to set up torch.distributed waited 30 minutes for a rank 0."""
    launched = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
                "SLURM_JOB_ID": "7", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599", "PMI_RANK": "1",
                "PMI_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_this_process_is_no_launchers_rank"], cwd=REPO, capture_output=True,
        text=True, env={**os.environ, **launched, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        timeout=300)
    assert done.returncode == 0, done.stdout


def test_ctrl_c_reaches_a_child_a_test_starts():
    """What every test finds (the test below runs this one under a background job's SIGINT)."""
    child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "default_int_handler", child.stderr


def test_started_as_a_background_job_ctrl_c_still_reaches_a_test_s_child():
    """A script's background job (`pytest ... &`) starts with SIGINT ignored, and children inherit
    that: a preprocess run a test interrupted never saw the signal and hung."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_ctrl_c_reaches_a_child_a_test_starts"], cwd=REPO, capture_output=True,
        text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 0, done.stdout
