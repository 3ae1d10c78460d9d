"""Stop signals in a process that starts others: SLURM and ``kill -- -PGID`` signal every process of
the job, so a child started while the handlers are installed (forked or spawned, by any library)
outlives a stop signal, while the process itself still notices one sent to it; a forked child's
signals are not counted as the parent's; the exit at once on a second signal leaves no process it
started behind."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megaloop.training.signals import StopSignals
from tests.training.process_groups import end_group, wait_until_group_ends


def _signalled_then_done() -> None:
    # The child inherits the blocked mask; unblocked, the inherited handler only remembers.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.raise_signal(signal.SIGTERM)
    sys.exit(7)


def test_a_forked_child_outlives_sigterm_and_the_parent_does_not_count_it():
    handler, wakeup_fd = signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    stop_signals = StopSignals()
    try:
        child = multiprocessing.get_context("fork").Process(target=_signalled_then_done)
        child.start()
        child.join(timeout=60)
    finally:
        stop_signals.restore()  # returns once every signal written to the watcher is counted
    assert child.exitcode == 7
    assert stop_signals.received is None
    assert signal.getsignal(signal.SIGTERM) is handler, "the handlers are put back"
    assert signal.set_wakeup_fd(wakeup_fd) == wakeup_fd, "and so is the wakeup fd"


def _wait_for(condition, what: str) -> None:
    deadline = time.time() + 60
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.01)


def test_spawned_children_outlive_stop_signals_that_the_process_notices():
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    stop_signals = StopSignals()
    try:
        # An exec'd program (as multiprocessing's spawn and subprocess start them) that waits for
        # its stdin to close.
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
        for signum in (signal.SIGTERM, signal.SIGUSR1):  # the group-wide signal's share
            child.send_signal(signum)
        os.kill(os.getpid(), signal.SIGUSR1)  # and the process's own
        _wait_for(lambda: stop_signals.received is not None, "the process missed its signal")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    finally:
        stop_signals.restore()
    assert stop_signals.received == signal.SIGUSR1
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask, "the mask is put back"


def test_a_signal_sent_to_the_main_thread_alone_is_handled_when_the_handlers_go():
    stop_signals = StopSignals()
    try:
        signal.raise_signal(signal.SIGUSR1)  # blocked in this thread: pending
        assert signal.SIGUSR1 in signal.sigpending()
    finally:
        # Unblocked while the handlers are still installed: SIGUSR1's default would end pytest.
        stop_signals.restore()
    assert stop_signals.received == signal.SIGUSR1
    assert not signal.sigpending()


FIRST_SPAWN = textwrap.dedent("""
    import multiprocessing, os, signal
    from megaloop.training.signals import StopSignals

    if __name__ == "__main__":
        stop_signals = StopSignals()
        # megatron-core's results queue: this process's first spawn, as at a trainer's first save
        queue = multiprocessing.get_context("spawn").Manager().Queue()
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM)
        queue.put("the manager outlived SIGTERM")
        print(queue.get())
        print("SIGTERM blocked:", signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, ()))
        stop_signals.restore()
""")


def test_the_first_spawned_child_outlives_sigterm(tmp_path):
    """multiprocessing's resource tracker, started by a process's first spawn, unblocks SIGTERM."""
    (tmp_path / "first_spawn.py").write_text(FIRST_SPAWN)
    repo = Path(__file__).parents[2]
    run = subprocess.run([sys.executable, str(tmp_path / "first_spawn.py")], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.stdout == "the manager outlived SIGTERM\nSIGTERM blocked: True\n", run.stderr


def test_two_installed_and_restored_in_either_order_put_everything_back():
    """Two Trainers alive at once in a notebook or a test, closed first-made first: the second
    restored used to hand the interpreter the first one's closed wakeup fd (EBADF)."""
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1),
              signal.pthread_sigmask(signal.SIG_BLOCK, set()))
    for order in ((0, 1), (1, 0)):
        pair = [StopSignals(), StopSignals()]
        pair[order[0]].restore()
        os.kill(os.getpid(), signal.SIGUSR1)  # handled by the one left, whichever it is
        _wait_for(lambda: pair[order[1]].received == signal.SIGUSR1, "the one left does not count")
        pair[order[1]].restore()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1),
                signal.pthread_sigmask(signal.SIG_BLOCK, set())) == before
        assert signal.set_wakeup_fd(-1) == -1, "the wakeup fd is the one found"


TWO_SIGNALS_WITH_A_SUBPROCESS = textwrap.dedent("""
    import subprocess, time
    import psutil
    from megaloop.training.signals import StopSignals

    stop_signals = StopSignals()
    stop_signals.left_behind = "nothing"
    # A tool's child that starts one of its own (sh waits for a background sleep): both inherit
    # the blocked stop signals, so a signal to the group leaves them pending, not dead.
    subprocess.Popen(["sh", "-c", "sleep 600 & wait"])
    while len(psutil.Process().children(recursive=True)) < 2:
        time.sleep(0.01)
    print("started", flush=True)
    while True:
        time.sleep(1)
""")


def test_a_second_stop_signal_leaves_no_process_it_started(tmp_path):
    """subprocess's children, not only multiprocessing's, die with the exit at once."""
    (tmp_path / "two_signals.py").write_text(TWO_SIGNALS_WITH_A_SUBPROCESS)
    repo = Path(__file__).parents[2]
    err = tmp_path / "err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "two_signals.py")],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "PYTHONPATH": str(repo)},
                                start_new_session=True)
    try:
        assert proc.stdout.readline() == "started\n", err.read_text()
        os.killpg(proc.pid, signal.SIGTERM)
        _wait_for(lambda: "SIGTERM received" in err.read_text(), "the first signal unnoticed")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, err.read_text()
        wait_until_group_ends(proc.pid)
    finally:
        end_group(proc.pid)
    assert "exiting at once with status 143, without saving; nothing" in err.read_text()
