"""tests/distributed.py's worker pools: a rendezvous port taken between its choice and rank 0's
listen (another test's process, under xdist) costs a retry, not the whole timeout."""

import socket

from tests import distributed


def _world(rank: int, world_size: int) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_a_pool_whose_port_is_taken_starts_on_another(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports, free_port = iter([taken.getsockname()[1]]), distributed.free_port
        monkeypatch.setattr(distributed, "free_port", lambda: next(ports, None) or free_port())
        monkeypatch.setattr(distributed, "_TIMEOUT_S", 120.0)
        pool = distributed._Pool(1)
    monkeypatch.setitem(distributed._pools, 1, pool)
    try:
        assert distributed.run_distributed(_world, world_size=1) == [(0, 1)]
    finally:
        pool.close()

