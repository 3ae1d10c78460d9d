"""Preemption signals: SIGTERM (SLURM, ``timeout``, ``docker stop``) and SIGUSR1 (SLURM's
``--signal``) are remembered instead of killing the process, so that training can save a checkpoint
at the end of the current step and exit "resumable" (75).

``megaloop-train`` installs the handlers before it imports torch (about 1.5 s): a signal that
arrives during start-up is then acted on too, rather than ending the process with 143 and no word.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Remembers the first stop signal received while installed; ``restore()`` puts the previous
    handlers back."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._remember) for s in STOP_SIGNALS}

    def _remember(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
