"""Decisions that every rank must share: a check that fails on one rank alone would leave the others
waiting in the next collective until the process-group timeout (30 minutes by default). The errors
they raise alike on every rank are marked so (``cli.decided_on_every_rank``): megaloop-train prints
them from rank 0 alone; so is an error its caller makes of ``first_error``'s message."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from megaloop.cli import decided_on_every_rank

T = TypeVar("T")


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def said_by_this_rank(message: str) -> str:
    """``message`` prefixed with this rank (``rank N: ...``) in a run of several ranks, where the
    others will raise or log it too; unchanged in a single process."""
    return f"rank {dist.get_rank()}: {message}" if _world() > 1 else message


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def rank0_decides(compute: Callable[[], T], errors: tuple[type[Exception], ...]) -> T:
    """Runs ``compute()`` on rank 0 only (file checks that need not run N times) and returns its
    result on every rank; one of ``errors`` raised there is raised on every rank with the same
    one-line message. An OSError becomes the first of ``errors``, naming the file."""
    outcome: list = [None]
    if is_rank0():
        try:
            outcome[0] = (None, compute())
        except errors as e:
            outcome[0] = (errors.index(type(e)) if type(e) in errors else 0, str(e))
        except OSError as e:
            outcome[0] = (0, f"{e.filename}: {e.strerror or e}")
    if _world() > 1:
        dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind is None:
        return value
    raise decided_on_every_rank(errors[kind](value))


def each_rank_agrees(compute: Callable[[], T], errors: tuple[type[Exception], ...]) -> T:
    """Runs ``compute()`` on every rank (what each rank does for itself: reading a file from its
    own node) and returns this rank's result; one of ``errors`` raised on any rank is raised on
    every rank, the first failing rank's message naming it. An OSError becomes the first of
    ``errors``, naming the file. Without it, the failing rank raised alone and the others waited
    in their next collective until the process-group timeout."""
    problem, result = None, None
    try:
        result = compute()
    except errors as e:
        problem = (errors.index(type(e)) if type(e) in errors else 0, str(e))
    except OSError as e:
        problem = (0, f"{e.filename}: {e.strerror or e}")
    if _world() == 1:
        if problem is None:
            return result
        raise errors[problem[0]](problem[1])
    gathered: list = [None] * _world()
    dist.all_gather_object(gathered, problem)
    first = next(((rank, p) for rank, p in enumerate(gathered) if p is not None), None)
    if first is None:
        return result
    rank, (kind, message) = first
    raise decided_on_every_rank(errors[kind](f"rank {rank}: {message}"))


def collective_device() -> torch.device:
    """Where collectives' tensors live: NCCL only takes CUDA tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def max_over_ranks(value: int) -> int:
    """Collective: the largest of every rank's ``value``; one all-reduce of one number, cheap
    enough for every step and every checkpoint save (object collectives pickle, and send twice)."""
    if _world() == 1:
        return value
    largest = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


def any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is true on any rank."""
    return bool(max_over_ranks(int(flag)))


def first_error(error: str | None) -> str | None:
    """Collective: the first error message any rank reports, on every rank (None if none); an
    error raised of it is marked ``cli.decided_on_every_rank``."""
    if _world() == 1:
        return error
    gathered: list[str | None] = [None] * _world()
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e), None)


def same_on_every_rank(settings: dict[str, object]) -> None:
    """Collective: raises ConfigError on every rank, naming the first setting whose value differs
    from rank 0's, with both values and ranks. A node launched with another config would otherwise
    build other groups and wait in a collective its peers never join."""
    from megaloop.config import ConfigError

    if _world() == 1:
        return
    gathered: list[dict | None] = [None] * _world()
    dist.all_gather_object(gathered, settings)
    for name, value in gathered[0].items():
        for rank, other in enumerate(gathered):
            if other.get(name) != value:
                raise decided_on_every_rank(ConfigError(
                    f"{name}={other.get(name)!r} on rank {rank} but {value!r} on rank 0: every "
                    "rank must be launched with the same settings"))
