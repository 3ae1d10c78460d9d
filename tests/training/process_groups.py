"""Process groups of the signal tests: starting a run's script as the leader of a group of its
own, waiting for its log to say something, which processes a group still holds, waiting until it
holds none, and ending whatever a failed test left in it; and a signal to the test's own process,
returning once it is noticed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).parents[2]


def script_env() -> dict[str, str]:
    """A subprocess's environment: this checkout importable, one thread (2 shared cores)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def start_in_own_session(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """``python ARGS`` in ``cwd``, stdout and stderr to ``log``, leader of a session (and process
    group) of its own: whatever it starts (checkpoint writers, their managers) can be found and
    ended by the group, also once a kill -9 has orphaned it."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], env=script_env(), cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_log(proc: subprocess.Popen, log: Path, said: Callable[[str], bool],
                 timeout_s: float) -> None:
    """Until ``said(log's text)``; fails with the log's end if ``proc`` ends first or it takes
    longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not said(log.read_text()):
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)


def processes_in_group(group: int) -> list[str]:
    """The command lines of the live processes of process group ``group`` (a zombie has ended:
    it only waits to be reaped)."""
    import psutil

    found = []
    for process in psutil.process_iter(["status", "cmdline"]):
        try:
            if (os.getpgid(process.pid) == group
                    and process.info["status"] != psutil.STATUS_ZOMBIE):
                found.append(" ".join(process.info["cmdline"] or []))
        except ProcessLookupError:
            pass
    return found


def wait_until_group_ends(group: int) -> None:
    """Children leave once the trainer has gone (the resource tracker when its pipe closes)."""
    deadline = time.time() + 60
    while left := processes_in_group(group):
        assert time.time() < deadline, f"left alive: {left}"
        time.sleep(0.1)


def end_group(group: int) -> None:
    """Whatever a failed test leaves."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def signal_this_process(signum: int, stop_signals) -> None:
    """Sends ``signum`` to this process, as ``kill`` does, and returns once ``stop_signals`` (a
    megaloop.training.signals.StopSignals) has noticed it. The main thread blocks stop signals, so
    the kernel hands it to another thread, which a loaded machine may run only much later: a test
    that went on meanwhile would see the signal after a step of its choosing, not the one asked."""
    os.kill(os.getpid(), signum)
    deadline = time.time() + 60
    while stop_signals.received is None:
        assert time.time() < deadline, f"signal {signum} not noticed"
        time.sleep(0.01)
