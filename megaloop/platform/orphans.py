"""Helper processes that end when the process that started them ends, however it ends.

A ``kill -9`` (or a crash) gives a process no chance to stop what it started; outside a cgroup
or a process group that is killed whole, the helpers would live on, orphaned. Linux's
parent-death signal (PR_SET_PDEATHSIG) fires when the parent's *thread* that started the child
ends, not the process: a save made from a thread that then ends would kill its helpers too.
Hence a watcher thread that sees the parent's death as a change of this process's parent pid.

Standard library only: a spawned helper imports this module before it starts (no torch).
"""

from __future__ import annotations

import os
import threading
import time

_INTERVAL_S = 0.1


def exit_when_orphaned(parent: int, status: int = 1) -> None:
    """Starts a thread that ends this process (exit ``status``, at once) once ``parent``, its
    parent's pid when it was started, has ended (also if it already has)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_INTERVAL_S)
        os._exit(status)

    threading.Thread(target=watch, name="megaloop-exit-when-orphaned", daemon=True).start()
