"""Process groups of the signal tests: which processes a group still holds, waiting until it
holds none, and ending whatever a failed test left in it."""

import os
import signal
import time


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
