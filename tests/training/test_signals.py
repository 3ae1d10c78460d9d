"""Stop signals in a process that forks (dist_checkpointing's writers): a forked child outlives a
stop signal sent to the whole process group, so that the save in progress completes, and its
signals are not counted as the parent's."""

import multiprocessing
import signal
import sys

from megaloop.training.signals import StopSignals


def _signalled_then_done() -> None:
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
