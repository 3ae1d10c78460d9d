"""Stop signals: SIGTERM (SLURM, ``timeout``, ``docker stop``, ``kill``) and SIGUSR1 (SLURM's
``--signal``).

The first one is remembered, not fatal: training saves a checkpoint at the end of the current step
and exits "resumable" (75), and set-up ends at its next phase boundary (nothing to save yet). A
second one means "now": the process exits at once with the shell's status for that signal (128 +
its number: 143 for SIGTERM, 138 for SIGUSR1) after one line on stderr saying what it leaves on
disk (``left_behind``, which the trainer keeps current). Checkpoint saves are atomic
(megaloop.training.checkpoint), so exiting in the middle of one leaves ``latest`` on a complete
checkpoint.

Python runs signal handlers in the main thread between bytecodes, so while that thread waits inside
C++ (a rendezvous, a collective waiting for a dead peer, a write to a hung filesystem) a handler
sees nothing, and two signals arriving meanwhile look like one when the call returns, if it ever
does. The signals are therefore counted by a watcher thread reading the interpreter's wakeup fd
(``signal.set_wakeup_fd``), to which the C-level handler writes each signal's number as it
arrives; the thread runs whenever the main thread has released the GIL. A C++ routine that keeps
the GIL (megatron-core's sample-index builder) delays the exit until it returns; SIGKILL ends a
process at any instant.

SLURM (``--signal``, ``scancel --signal``) and ``kill -- -PGID`` signal every process of the job,
not only the trainer, and the processes it starts must live through a first stop signal, or the
save that signal asks for fails (megatron-core's dist_checkpointing starts a results-queue manager
with ``spawn`` at the first save and keeps it, and forks writer processes at each save; the spawned
manager brings multiprocessing's resource tracker). While the handlers are installed, the
installing (main) thread therefore blocks the stop signals: a child inherits the blocked mask
through fork and exec, whichever library starts it and whenever, and leaves the signals pending.
The process still gets them: the kernel delivers a signal sent to the process (``kill``,
``killpg``) to a thread that does not block it, the watcher, whose C-level handler writes the
wakeup fd, and the main thread runs the Python handler at its next bytecode as before. Only a
signal sent to the main thread alone (``signal.raise_signal``, ``pthread_kill``) waits, until
``restore()``. The children end as they would anyway: their owners stop them at a normal exit (the
manager gets a shutdown message, writers are joined, the resource tracker leaves when its pipe
closes), and the exit on a second stop signal first kills every process this one started,
directly or not (a ``subprocess`` child such as wandb's service, its children, multiprocessing's):
all of them are stopped first (SIGSTOP, so that none starts another meanwhile), then SIGKILLed.
Only descendants still attached to this process are found: one that detached itself (a daemon's
double fork) has left the tree and is left alone, as is every process outside it.

``megaloop-train`` installs the handlers before it imports torch (about 1.5 s): a signal that
arrives during start-up is then acted on too, rather than ending the process with 143 and no word.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from megaloop.stop_first import STOP_SIGNALS
_STOP_WAIT_S = 1.0  # the most the exit at once waits for descendants to stop before killing them
_STOP_WATCHING = 0  # a byte no signal writes to the wakeup fd
_installed: list[StopSignals] = []  # innermost last


class StopSignals:
    """Remembers the first stop signal received while installed (``received``) and exits the
    process on the second; ``restore()`` puts the previous handlers and signal mask back. Install
    it from the main thread, which then blocks the stop signals (see the module docstring)."""

    def __init__(self):
        self.received: int | None = None
        # What an immediate exit leaves; the trainer replaces it once it has something on disk.
        self.left_behind = "the run had not started training"
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the interpreter requires it of a wakeup fd
        # The wakeup fd before the handlers, so that no signal reaches a handler uncounted.
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, self._remember) for s in STOP_SIGNALS}
        self._watcher = threading.Thread(target=self._watch, name="megaloop-stop-signals",
                                         daemon=True)
        self._watcher.start()
        # After the watcher starts: threads and processes inherit the mask of their creator.
        self._previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        _start_resource_tracker()
        _installed.append(self)

    def _remember(self, signum, frame) -> None:
        """The Python-level handler (main thread): sets ``received`` as soon as the main thread
        runs Python again, whether or not the watcher has had a turn yet."""
        if self.received is None:
            self.received = signum

    def _watch(self) -> None:
        # The thread stop signals are delivered to, even if started while they were blocked.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        count = 0
        while True:
            for signum in os.read(self._read_fd, 64):
                if signum == _STOP_WATCHING:
                    return
                if signum not in STOP_SIGNALS:  # SIGINT and other handled signals pass through
                    continue
                count += 1
                if count > 1:
                    self._exit_now(signum)
                if self.received is None:
                    self.received = signum
                _say(f"{signal.Signals(signum).name} received: stopping at the next step or "
                     "set-up boundary (a second stop signal exits at once, without saving)")

    def _exit_now(self, signum: int) -> None:
        status = 128 + signum
        _say(f"a second stop signal ({signal.Signals(signum).name}): exiting at once with status "
             f"{status}, without saving; {self.left_behind}")
        try:
            _kill_descendants()
        finally:
            os._exit(status)

    def restore(self, afterwards=None) -> None:
        """Idempotent; signals received before it have been counted when it returns.
        ``afterwards``: the stop signals' handler from now on instead of the previous ones (a
        process about to exit keeps them ignored: ``signal.SIG_IGN``)."""
        if self not in _installed:
            return
        if afterwards is not None:
            self._previous = dict.fromkeys(STOP_SIGNALS, afterwards)
        position = _installed.index(self)
        if position + 1 < len(_installed):
            # Restored before one installed after it (two Trainers, the first closed first): that
            # one stays in place, and puts back what this one found when it is restored in turn.
            inner = _installed[position + 1]
            inner._previous_mask = self._previous_mask
            inner._previous_wakeup_fd = self._previous_wakeup_fd
            inner._previous = self._previous
        else:
            # First, while the handlers are ours: a signal sent to this thread alone arrives now.
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous_mask)
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for s, handler in self._previous.items():
                signal.signal(s, handler)
        os.write(self._write_fd, bytes([_STOP_WATCHING]))
        self._watcher.join()
        os.close(self._read_fd)
        os.close(self._write_fd)
        _installed.remove(self)


def _say(line: str) -> None:
    """One line on stderr, written directly: from the watcher thread, ``sys.stderr`` may be locked
    by a main thread that is stuck in the middle of a write."""
    os.write(2, f"megaloop: {line}\n".encode())


def _kill_descendants() -> None:
    """SIGKILLs every process below this one. Each is stopped first, and the tree read again until
    it holds none that is not stopped: a process killed while its children run would orphan them
    (they would leave the tree before being found), and one still running could start another.
    Before each re-read, waits until the processes just signalled have stopped, not only been
    sent SIGSTOP (Linux already refuses a fork once the SIGSTOP is pending; the wait does not
    rely on it), up to ``_STOP_WAIT_S`` in all: one in uninterruptible sleep (a hung filesystem)
    stops only when it leaves it."""
    stopped = {}
    deadline = time.monotonic() + _STOP_WAIT_S
    while found := [p for p in psutil.Process().children(recursive=True) if p.pid not in stopped]:
        for process in found:
            stopped[process.pid] = process
            _signal(process, signal.SIGSTOP)
        while time.monotonic() < deadline and not all(map(_has_stopped, found)):
            time.sleep(0.001)
    for process in stopped.values():
        _signal(process, signal.SIGKILL)


def _has_stopped(process: psutil.Process) -> bool:
    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP,
                                    psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _signal(process: psutil.Process, signum: int) -> None:
    """Sends ``signum`` unless ``process`` has ended (psutil checks that its pid was not reused)."""
    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def _start_resource_tracker() -> None:
    """Starts multiprocessing's resource tracker now, unless it runs, so that it inherits the
    blocked stop signals. Left to the first ``spawn`` (megatron-core's results-queue manager, at the
    first save), its start would unblock SIGINT and SIGTERM in the starting thread whatever their
    state before (CPython issue 127586, present in 3.11), and that manager and every later child
    would die of a SIGTERM sent to the group."""
    from multiprocessing import resource_tracker

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _detach_forked_child() -> None:
    """A forked child (dist_checkpointing's writer processes) keeps the blocked mask of the thread
    that forked it and the handlers (a child that unblocks the signals remembers them, and is not
    ended by them), but loses the wakeup fd and the pipe, so that its signals are not counted as
    the parent's. The watcher thread does not exist in the child."""
    if not _installed:
        return
    signal.set_wakeup_fd(_installed[0]._previous_wakeup_fd)
    for instance in _installed:
        os.close(instance._read_fd)
        os.close(instance._write_fd)
    _installed.clear()


os.register_at_fork(after_in_child=_detach_forked_child)
