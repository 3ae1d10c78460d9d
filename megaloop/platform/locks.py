"""Exclusive ``flock`` locks whose file names their holder.

The kernel releases a flock when its process ends, however it ends (kill -9, OOM); on a network
filesystem the server releases a dead client's locks when its lease expires or it is evicted
(NFSv4: about 90 s). So a crashed holder never blocks the next process, and there is no stale-lock
cleanup to get wrong. A filesystem without lock support (Lustre mounted ``noflock``) answers with
one of ``NO_LOCK_SUPPORT``: the caller goes on unguarded, with a warning.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket
from typing import IO, Callable

NO_LOCK_SUPPORT = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def take_flock(file: IO, when_held: Callable[[str], None],
               unguarded: Callable[[str], None]) -> bool:
    """Takes an exclusive flock on ``file`` (open for reading and appending) and records this
    process in it as the holder: True. While another process holds it, ``when_held(holder)`` is
    called first with what that process recorded: raising refuses the lock; returning waits for
    it. False, after ``unguarded(reason)``, on a filesystem without locks."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        when_held(file.read().strip() or "another process")
        fcntl.flock(file, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno not in NO_LOCK_SUPPORT:
            raise
        unguarded(e.strerror)
        return False
    file.seek(0)
    file.truncate()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    file.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
    file.flush()
    return True


def warn_unguarded(log: logging.Logger, where: str, risk: str) -> Callable[[str], None]:
    """An ``unguarded`` for ``take_flock``: a warning naming ``where`` and the ``risk`` run."""
    return lambda reason: log.warning("%s: the filesystem does not support file locks (%s); %s",
                                      where, reason, risk)
