"""Stand-ins for ``preprocess.encode_chunk`` that misbehave on purpose.

A test sets ``megaloop.data.preprocess.encode_chunk`` to one of these; the pool pickles it by name,
so spawned workers import this module and run it, with their own (real) ``encode_chunk`` inside.
"""

import os
import signal
import time

from megaloop.data import preprocess

FINISHED_LOG = "MEGALOOP_TEST_FINISHED_LOG"  # environment: file that records chunks as they finish


def first_chunk_finishes_last(chunk):
    """Hold the input's first chunk until another chunk has finished: workers finish out of order."""
    log = os.environ[FINISHED_LOG]
    if chunk.first_record == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(log) and time.monotonic() < deadline:
            time.sleep(0.01)
    result = preprocess.encode_chunk(chunk)
    with open(log, "a") as f:
        f.write(f"{chunk.first_record}\n")
    return result


def killed_on_second_chunk(chunk):
    """The worker dies as the out-of-memory killer kills: SIGKILL, no result, no goodbye."""
    if chunk.first_record > 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return preprocess.encode_chunk(chunk)


def stuck_on_second_chunk(chunk):
    """A worker busy for as long as a test needs (it must be stopped, not waited for)."""
    if chunk.first_record > 1:
        time.sleep(600)
    return preprocess.encode_chunk(chunk)
