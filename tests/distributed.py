"""run_distributed: runs a function on N gloo ranks, reusing worker processes across tests.

Importing megatron-core costs about 4 s per process, so the workers of each world size are started
once per test session and kept alive; every call ships a module-level function (picklable) to all
ranks, waits for them, and re-raises the first rank's failure with its traceback. Model-parallel
state is torn down after every call so tests stay independent, and a call that leaves other
process-wide state changed fails (tests/process_state.py).
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import socket
import traceback
from contextlib import contextmanager

import torch.multiprocessing as mp

_TIMEOUT_S = float(os.environ.get("MEGALOOP_TEST_DIST_TIMEOUT", 600))
_pools: dict[int, "_Pool"] = {}


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share the machine's cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # the pool decides: another port, or the error
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "joined"))
    from megaloop.platform import cpu_compat
    from tests import process_state

    cpu_compat.enable()
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            # The session ended without closing the pool (killed, or a pytest-xdist worker,
            # which exits without running atexit): do not linger as an orphan.
            if os.getppid() != parent:
                break
            continue
        if task is None:
            break
        fn, kwargs = task
        before = process_state.snapshot()
        try:
            ok, value = True, fn(rank, world_size, **kwargs)
        except BaseException:  # report everything, the test decides
            ok, value = False, traceback.format_exc()
        finally:
            from megaloop.platform.distributed import destroy_model_parallel

            destroy_model_parallel()
        # These workers serve every test of the session that asks for their world size: what one
        # task leaves changed (an environment variable, a signal's handler) would decide the next.
        changed = process_state.put_back(before)
        if changed and ok:
            ok, value = False, (f"{fn.__name__} left changed for the tasks after it in this "
                                f"worker (put back now): {'; '.join(changed)}")
        results.put((rank, ok, value))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    _ATTEMPTS = 3

    def __init__(self, world_size: int):
        # The port is free when chosen but may be taken before rank 0 listens on it (another
        # test's process, under xdist): rank 1 would then wait on someone else's port for the
        # whole timeout. The ranks report their rendezvous, and a lost port gets a new pool.
        for attempt in range(1, self._ATTEMPTS + 1):
            self._start(world_size)
            failures = self._rendezvous(world_size)
            if not failures:
                return
            self.kill()
            if attempt == self._ATTEMPTS or "EADDRINUSE" not in failures[0]:
                raise RuntimeError("distributed test workers did not start\n" + failures[0])

    def _start(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            # Not daemonic: dist_checkpointing's writer starts a multiprocessing Manager, and
            # daemonic processes may not have children. close() (at exit too) ends them.
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                        daemon=False)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def _rendezvous(self, world_size: int) -> list[str]:
        """The failures of the ranks' process-group set-up; empty once every rank has joined."""
        joined = 0
        while joined < world_size:
            try:
                rank, ok, value = self.results.get(timeout=_TIMEOUT_S)
            except queue.Empty:
                return [f"no rendezvous within {_TIMEOUT_S}s"]
            if not ok:
                return [f"rank {rank}:\n{value}"]
            joined += 1
        return []

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.join()

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def close_all() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


atexit.register(close_all)


def run_distributed(fn, world_size: int = 2, **kwargs) -> list:
    """Calls ``fn(rank, world_size, **kwargs)`` on every rank; returns the per-rank results."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)
    for q in pool.tasks:
        q.put((fn, kwargs))
    out, errors = [None] * world_size, []
    for _ in range(world_size):
        try:
            rank, ok, value = pool.results.get(timeout=_TIMEOUT_S)
        except queue.Empty:
            pool.close()
            _pools.pop(world_size, None)
            raise TimeoutError(f"distributed test {fn.__name__} timed out after {_TIMEOUT_S}s")
        if ok:
            out[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
    if errors:
        raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(errors))
    return out


@contextmanager
def workers_discarded_on_failure():
    """A test that fails may have left a collective timed out, after which gloo has closed the
    workers' group for good: the next test gets new workers."""
    try:
        yield
    except BaseException:
        close_all()
        raise


@contextmanager
def collective_timeout(seconds: float):
    """In a rank: the default group's collectives time out after ``seconds`` (a test of a rank
    left waiting fails then, not after the process-group timeout), as before afterwards."""
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD
    before = world._get_backend(torch.device("cpu")).options._timeout
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), world)
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(before, world)
