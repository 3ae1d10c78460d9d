"""The stop signals (SIGTERM, SIGUSR1) blocked as the first thing a ``megaloop-train`` process
does: before the imports that precede its handlers (megaloop.training.signals; psutil, logging,
argparse: about 0.1 s here, more on a cold shared file system), a signal then waits for the
handlers, which stop set-up and exit 75 with a line, instead of ending the process with 143 and no
word. For the console script (``megaloop-train``, ``main``) and ``python -m megaloop.train`` alike
(torchrun's workers included; megaloop/train.py blocks them as its first statement when run as a
program). Built-in modules only. The interpreter's own start before it (site-packages and its
.pth files: about 0.05 s here) stays exposed; the slurm/ scripts start the tasks with the signals
blocked already (``python -I -S``, slurm/common.sh MEGALOOP_STOP_SIGNALS_BLOCKED)."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def block_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def main():
    """The ``megaloop-train`` console script."""
    block_stop_signals()
    from megaloop.train import cli

    cli()
