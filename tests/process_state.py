"""process_state_restored: an autouse fixture (tests/conftest.py imports it) that fails a test
which leaves process-wide state changed, and puts that state back.

pytest-xdist runs any two tests in one worker process, in no fixed order: a test that leaves such a
setting changed decides the outcome of whichever test the worker runs next, a failure that comes
and goes with the distribution (CI failed once on a test that read its rank from a process group
an earlier test had left). Watched: the environment variables that say how this process was
launched and which rank it is (megaloop.platform.launch reads them) and megaloop's own, the
handlers and mask of the signals a run stops on, the working directory and umask, torch's default
dtype, thread count, grad mode and deterministic-algorithms flag, and the root log level. Not
watched: what is left on purpose for the worker's life (the mcore fixture's world-of-one process
group and the CPU layer it switches on), and what a library sets once on its first use
(TORCHINDUCTOR_CACHE_DIR, NVTE_*_ATTN, TOKENIZERS_PARALLELISM), which no test could put back.

tests/distributed.py checks each call in its reused rank workers the same way (``snapshot``,
``put_back``), and tests/conftest.py removes the LAUNCH_ENV variables before any test. Also a
plugin (``pytest -p tests.process_state``), which is how tests/test_process_state.py shows that
it fails a leaking test."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest
import torch

# What torchrun, srun and mpiexec tell a process about its launch (megaloop.platform.launch).
LAUNCH_ENV = re.compile(r"RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|"
                        r"MASTER_PORT|MPI_LOCALRANKID|MPI_LOCALNRANKS|"
                        r"(SLURM|OMPI_COMM_WORLD|PMI|PMIX)_\w+")
_OURS = re.compile(r"OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES|MEGALOOP_\w+")
# The stop signals (megaloop.stop_first.STOP_SIGNALS), Ctrl-C, and those a launcher may send.
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if LAUNCH_ENV.fullmatch(key) or _OURS.fullmatch(key)}


def _set_environment(saved: dict[str, str]) -> None:
    for key in _environment():
        del os.environ[key]
    os.environ.update(saved)


def _set_handlers(saved: dict) -> None:
    for signum, handler in saved.items():
        if handler is not None:  # installed from C: Python cannot put it back
            signal.signal(signum, handler)


def _umask() -> int | None:
    """From /proc (Linux 4.7 on; None before): os.umask reads it only by setting it, and a file
    made meanwhile by a thread of the test's would get the wrong mode."""
    with open("/proc/self/status") as status:
        return next((int(line.split()[1], 8) for line in status if line.startswith("Umask:")), None)


def _set_umask(saved: int | None) -> None:
    if saved is not None:
        os.umask(saved)


def _set_deterministic(saved: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


# name: (read it, set it to a value read)
_STATE = {
    "environment": (_environment, _set_environment),
    "signal handlers": (lambda: {s: signal.getsignal(s) for s in _SIGNALS}, _set_handlers),
    "blocked signals": (lambda: signal.pthread_sigmask(signal.SIG_BLOCK, ()),
                        lambda mask: signal.pthread_sigmask(signal.SIG_SETMASK, mask)),
    "working directory": (os.getcwd, os.chdir),
    "umask": (_umask, _set_umask),
    "torch default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "torch threads": (torch.get_num_threads, torch.set_num_threads),
    "torch grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "torch deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled()), _set_deterministic),
    "root log level": (lambda: logging.getLogger().level, logging.getLogger().setLevel),
}


def _changes(name: str, before, after) -> str:
    if isinstance(before, dict):
        return f"{name} " + ", ".join(f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
                                      for key in sorted({*before, *after}, key=str)
                                      if before.get(key) != after.get(key))
    return f"{name} {before!r} -> {after!r}"


def snapshot() -> dict:
    return {name: read() for name, (read, _) in _STATE.items()}


def put_back(before: dict) -> list[str]:
    """What differs from ``before`` (a ``snapshot()``), one phrase each, every one put back. First
    the StopSignals a Trainer never closed left installed: they block SIGTERM for what runs next."""
    from megaloop.training import signals

    left = list(signals._installed)
    for stop_signals in reversed(left):
        stop_signals.restore()
    changed = [f"{len(left)} StopSignals left installed (a Trainer was not closed)"] if left else []
    for name, (read, set_to) in _STATE.items():
        after = read()
        if after != before[name]:
            changed.append(_changes(name, before[name], after))
            set_to(before[name])
    return changed


@pytest.fixture(autouse=True)
def process_state_restored():
    before = snapshot()
    yield
    changed = put_back(before)
    assert not changed, ("left changed for the tests after it in this process (put back now): "
                         + "; ".join(changed))
