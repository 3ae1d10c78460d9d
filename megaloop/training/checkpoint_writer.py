"""The processes a checkpoint save starts: the results-queue manager, and the write (in the
background with ``checkpoint.async_save``, else waited for at once) as a process tree that ends
whole.

megatron-core starts its results-queue manager with the spawn method, at a process's first save,
and a spawned process re-imports the main script: code of it that is not under ``if __name__ ==
"__main__":`` runs again there, and the save fails with a bare EOFError once the copy dies (of
the run directory's lock, at best). ``refuse_unguarded_main`` finds that before the run starts.

megatron-core forks a writer process for the write, which forks one worker per bucket of files
and waits on a JoinableQueue until every worker has reported (its synchronous save runs the same
writer in the trainer itself). Nothing watches them: a worker killed (the OOM killer's SIGKILL)
never reports, the writer waits for ever, and so does every training rank at its next wait for
the write; a writer killed leaves its workers orphaned, one blocked for ever on a pipe that
nobody reads. Hence every save's write runs in a writer process (checkpoint_save), and
``watched`` makes the tree end whole and at once: a worker's death ends the writer (status 128 +
the signal's number), and the writer's death, of any cause, SIGKILLs its workers (Linux's
parent-death signal). The training ranks then see the writer ended, megatron-core's collective
finalize fails the save on every rank (the writer's results are missing), and ``died_of`` names
the signal on the rank whose writer died. Both the writer and the results-queue manager end
when the training process does (``exit_when_orphaned``): nothing of a trainer killed with
``kill -9`` is left, in a cgroup or not.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil

from megaloop.platform.orphans import exit_when_orphaned
from megaloop.training.checkpoint_files import CheckpointError

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WATCH_INTERVAL_S = 0.1
_KILLED = (os.CLD_KILLED, os.CLD_DUMPED)


def watched(request, staged: list):
    """megatron-core's AsyncRequest ``request``, its writer process watching its workers and
    this (the training) process, and the host copies its preload stages appended to ``staged``,
    which the caller holds until the write has ended.

    On a GPU the preload copies every tensor into pinned host memory (``non_blocking``), then the
    writer is forked, and megatron-core 0.16.1 drops its copies at once. Pinned memory is shared
    with the fork, not copied on write: the trainer's next pinned allocations (a MoE dispatcher's
    token counts, the next step's copies) could reuse it while the writer still reads it, and the
    checkpoint would hold their bytes (megatron-core holds them since 0.17, PR #2288)."""
    if request.async_fn is None:  # nothing to write on this rank: no process
        return request
    preload = request.preload_fn

    def preload_and_hold():
        buckets = preload()
        staged.append(buckets)
        return buckets

    return request._replace(async_fn=partial(_write_watched, os.getpid(), request.async_fn),
                            preload_fn=preload_and_hold if preload is not None else None)


def start_results_queue() -> None:
    """Starts megatron-core's results-queue manager, if this process has none yet, as megatron-core
    would at its first save (``_get_write_results_queue``: a spawned SyncManager), but ending
    when this process ends: the manager does not watch it, and a ``kill -9`` of the trainer left
    it orphaned for good."""
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=get_context("spawn"))
        manager.start(exit_when_orphaned, (os.getpid(),))
        # The queue's proxy holds the manager, which shuts it down at this process's exit.
        filesystem_async._results_queue = manager.Queue()


def died_of(process) -> str | None:
    """The signal the writer ``process`` (joined) died of, itself or one of its workers, in words
    (None when it was not killed)."""
    code = process.exitcode
    if code is None or 0 <= code <= 128:
        return None
    signum = -code if code < 0 else code - 128
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return name + (", out of memory?" if signum == signal.SIGKILL else "")


def _write_watched(trainer: int, write, *args, **kwargs) -> None:
    """Runs in the writer process: megatron-core's ``write``, with every worker it forks dying
    with it, a thread that ends it when a worker is killed, and another when the ``trainer``
    process that forked it has ended: its write can no longer be finalized, and it would hold
    the run directory's lock (a fork's copy) until it completed."""
    exit_when_orphaned(trainer)
    # Looked up before any fork: a child of a threaded process must not take the loader's lock.
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    os.register_at_fork(after_in_child=partial(_die_with, os.getpid(), prctl))
    threading.Thread(target=_end_when_a_worker_is_killed, name="megaloop-writer-watch",
                     daemon=True).start()
    write(*args, **kwargs)


def _die_with(writer: int, prctl) -> None:
    """In a worker, just forked: SIGKILLed when the writer ends."""
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != writer:  # the writer ended before the signal was set
        os._exit(1)


def _end_when_a_worker_is_killed() -> None:
    """Ends this (writer) process as its killed worker did: it would wait for its report for ever.
    Looks without reaping (WNOWAIT): the writer joins its workers itself."""
    while True:
        for worker in _children():
            try:
                info = os.waitid(os.P_PID, worker, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped meanwhile by the writer
                continue
            if info is not None and info.si_code in _KILLED:
                os._exit(128 + info.si_status)
        time.sleep(_WATCH_INTERVAL_S)


def _children() -> list[int]:
    """This process's children, from its threads' /proc children lists: psutil's ``children()``
    reads every process's stat file, 40 ms a call among 600 processes, a third of a core at ten
    calls a second on every rank while it writes."""
    try:
        return [int(pid) for task in os.listdir("/proc/self/task")
                for pid in Path(f"/proc/self/task/{task}/children").read_text().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN, or a thread that just ended
        return [child.pid for child in psutil.Process().children()]


def refuse_unguarded_main() -> None:
    """Raises a CheckpointError naming the line when the code running now (a Trainer or a save
    being made) is the main script's top-level code outside ``if __name__ == "__main__":`` and
    this process has yet to start megatron-core's results-queue manager (spawn's rules for what
    it re-imports: multiprocessing.spawn.get_preparation_data)."""
    writer = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if (getattr(writer, "_results_queue", None) is not None or path is None
            or name == "__main__" or name.endswith(".__main__")):
        return
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    # Code exec'd from the script (another file name) has line numbers of its own: no verdict.
    if (frame is not None and frame.f_code.co_filename == path
            and not _under_main_guard(path, frame.f_lineno)):
        raise CheckpointError(
            f"{path}: line {frame.f_lineno} runs outside 'if __name__ == \"__main__\":'; put the "
            "script's code under it: checkpoint saves start a process with the spawn method, "
            "which imports the script again and would run that code twice")


@functools.lru_cache(maxsize=8)
def _under_main_guard(path: str, line: int) -> bool:
    """Whether ``line`` of Python file ``path`` is in the body of an ``if __name__ ==
    "__main__":`` (True when the file cannot be read or parsed: nothing to refuse for sure)."""
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError):
        return True
    return any(isinstance(node, ast.If) and _is_main_test(node.test)
               and node.body[0].lineno <= line <= node.body[-1].end_lineno
               for node in ast.walk(tree))


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round, or an ``and`` of it with other conditions
    (the spawned copy, named ``__mp_main__``, never enters either)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(map(_is_main_test, test.values))
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(side) for side in (test.left, *test.comparators)}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())),
                     ast.dump(ast.Constant("__main__"))}
