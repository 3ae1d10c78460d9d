"""Saving a checkpoint (collective; the layout: megaloop.training.checkpoint).

A save writes into ``iter_N.tmp``; only once every rank's part is written does the finalize run:
rank 0 writes ``config.yaml`` into it, renames it to ``iter_N``, moves ``latest`` and prunes to
``keep_last``, and every rank takes its outcome (``rank0_decides``). ``save_checkpoint`` does both
in one call. Every write runs in a writer process through megatron-core's asynchronous save
(``dist_checkpointing.save(..., async_sharded_save=True)``, in the steps of sharded_save, whose
failure on one rank fails the save on every rank) scheduled on an ``AsyncCallsQueue``, as
Megatron-LM's ``--async-save``), one that ends whole when any of its processes is killed
(checkpoint_writer); a synchronous save waits for it at once, in place of megatron-core's own
synchronous save, which writes in the trainer and would wait for a killed worker for ever.
``CheckpointSaver`` is a run's saver: with ``checkpoint.async_save`` the write runs in the
background and the finalize runs when every rank's write has completed: found by ``poll``
(non-blocking, each step) or waited for by ``wait`` (before the next save, at the end, on a stop
signal, on close); after an error that ends training, maybe on one rank alone, ``abandon`` leaves
it as its ``.tmp``.

What the background write holds is the state of the step saved, however far training has gone:
megatron-core stages GPU tensors in host memory before it forks the writer process (the trainer
holds those copies until the write has ended: ``checkpoint_writer.watched``), and on the
CPU the fork itself is the snapshot (the writer's pages are copied when training writes to them,
so memory grows by up to the state's size while a write is in flight). A ``kill -9`` at any
moment, a crash, or a write that fails leaves ``latest`` on the previous complete checkpoint; a
writer process killed mid-write fails its save on every rank, synchronous or not.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megaloop.cli import decided_on_every_rank, is_decided_on_every_rank, restating
from megaloop.config import RunConfig, save_yaml
from megaloop.platform.files import (atomic_write_leftovers, remove_tree, sync_directory,
                                     sync_tree, write_text_atomic)
from megaloop.training.checkpoint_files import (LATEST, CheckpointError, checkpoint_name,
                                                complete_checkpoints, latest_checkpoint, one_line)
from megaloop.training.checkpoint_writer import (died_of, refuse_unguarded_main,
                                                 start_results_queue, watched)
from megaloop.training.collective import (any_rank, first_error, is_rank0, rank0_decides,
                                          said_by_this_rank)
from megaloop.training.sharded_save import save_sharded

log = logging.getLogger("megaloop.train")

# What a failed save's iter_N.tmp holds, removed for the space a full disk needs back.
_FAILED_PART = "the part of a checkpoint a failed save had written"


@dataclass
class _Save:
    """A save begun: where it writes, and the checkpoint ``latest`` named when it began."""
    directory: Path
    step: int
    previous: Path | None
    blocked_s: float = 0.0  # the training loop's time spent on this save so far
    scheduled_at: float | None = None  # when its background write began (async_save)
    writer: object = None  # the process of its write, if this rank writes any
    # The host copies its write reads (pinned on a GPU), held until it has ended (``watched``).
    staged: list = field(default_factory=list)

    @property
    def tmp(self) -> Path:
        return self.directory / (checkpoint_name(self.step) + ".tmp")

    @property
    def final(self) -> Path:
        return self.directory / checkpoint_name(self.step)

    @property
    def still_latest(self) -> str:
        return self.previous.name if self.previous else "none"


def _begin(directory: Path, step: int) -> _Save:
    """Collective: rank 0 removes what killed saves left and creates ``iter_N.tmp``."""
    try:
        previous = latest_checkpoint(directory)
    except CheckpointError:  # a pointer to nothing: this save repoints it
        previous = None
    save = _Save(directory, step, previous)

    def prepare() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("iter_*.tmp"):  # left by a killed save
            remove_tree(stale, "the part of a checkpoint a killed save had written", log)
        for stale in atomic_write_leftovers(directory / LATEST):  # by a killed pointer move
            stale.unlink(missing_ok=True)
        if save.final.exists():
            if previous == save.final:
                raise CheckpointError(f"{save.final}: already the latest checkpoint; refusing to "
                                      "overwrite it in place")
            shutil.rmtree(save.final)  # complete but never pointed to (a failed pointer move)
        save.tmp.mkdir()

    rank0_decides(prepare, (CheckpointError,))
    return save


def _write_failed(save: _Save, error: BaseException | str, part: str = "") -> CheckpointError:
    """The one-line error of a write that failed on any rank (every rank sees it), ``part`` naming
    the part that failed; its files are removed, since they hold the space a full disk needs
    back."""
    free = _free_space(save.directory)
    if is_rank0():
        remove_tree(save.tmp, _FAILED_PART, log)
    cause = error if isinstance(error, str) else one_line(error)
    return CheckpointError(f"{save.tmp}: saving step {save.step} failed{part} "
                           f"({cause}; {free} free on its filesystem); latest is still "
                           f"{save.still_latest}")


def _finish(save: _Save, cfg: RunConfig, keep_last: int) -> Path:
    """Collective, once every rank's part is written: rank 0 adds the run config, renames
    ``iter_N.tmp`` to ``iter_N``, moves ``latest`` to it and deletes the checkpoints beyond
    ``keep_last``; a failure is the same CheckpointError on every rank.

    Each step is on disk before the next: megatron-core syncs the shards (``*.distcp``, each
    rank's writer) but not common.pt or metadata.json, nor any directory, and a power loss
    after ``latest`` moved could otherwise leave it naming a checkpoint whose small files are
    empty, or missing. All of them are rank 0's, as is every rename."""

    def finish() -> None:
        tmp, final = save.tmp, save.final
        try:
            save_yaml(cfg, tmp / "config.yaml")
            sync_tree(tmp, durable=lambda path: path.suffix == ".distcp")
            os.replace(tmp, final)
            sync_directory(save.directory)
        except OSError as e:
            remove_tree(tmp, _FAILED_PART, log)
            raise CheckpointError(f"{e.filename or tmp}: saving step {save.step} failed "
                                  f"({e.strerror or e}); latest is still "
                                  f"{save.still_latest}") from None
        try:
            write_text_atomic(save.directory / LATEST, final.name + "\n")
            sync_directory(save.directory)
        except OSError as e:
            raise CheckpointError(f"{save.directory / LATEST}: not moved to {final.name} "
                                  f"({e.strerror or e}); it still names "
                                  f"{save.previous.name if save.previous else 'nothing'}"
                                  ) from None
        # Keep the newest keep_last by step, and always the one just written.
        complete = [p for p in complete_checkpoints(save.directory) if p != final]
        for old in complete[:max(len(complete) - (keep_last - 1), 0)]:
            _prune(old)

    rank0_decides(finish, (CheckpointError,))
    return save.final


# A checkpoint being deleted (keep_last) is first renamed to this prefix + its name: no reader
# takes it for a checkpoint, so that a kill mid-delete leaves no half-deleted iter_N.
PRUNED_PREFIX = ".pruned-"
_PRUNED = "a checkpoint beyond checkpoint.keep_last that no run reads"
_PRUNED_REMEDY = "removed at the next start, or remove it by hand"  # remove_pruned's try


def _prune(path: Path) -> None:
    """Deletes checkpoint ``path`` (rank 0): renamed to its hidden name, then removed. A failure
    leaves the checkpoint whole, or its hidden remains (``remove_pruned`` tries again), and is
    one warning line naming the path: the save itself has succeeded."""
    trash = path.with_name(PRUNED_PREFIX + path.name)
    try:
        os.replace(path, trash)
    except OSError as e:
        log.warning("%s: beyond checkpoint.keep_last, but not deleted (%s); remove it by hand",
                    path, e.strerror or e)
        return
    remove_tree(trash, _PRUNED, log, _PRUNED_REMEDY)


def remove_pruned(directory: Path) -> None:
    """Removes the remains of checkpoint deletions that a kill cut short (rank 0, at the start of
    a run)."""
    for trash in directory.glob(PRUNED_PREFIX + "iter_*"):
        remove_tree(trash, _PRUNED, log, _PRUNED_REMEDY)


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict, cfg: RunConfig,
                    keep_last: int) -> Path:
    """Collective: every rank calls it with its sharded state dict; returns once the checkpoint
    is complete and ``latest`` names it. A failed save raises a CheckpointError naming the path,
    leaving ``latest`` where it was.

    Memory: on the CPU, megatron-core's writer (FileSystemWriterAsync.prepare_write_data) clones
    every tensor that is a view of a larger storage, and all clones live until the save ends. Its
    own SwiGLU factory (mlp.apply_swiglu_sharded_factory) saves each fc1 weight as two chunk()
    views, so a bare model's save peaks at +0.16x its fp32 weights (60M AsymLoop); under its
    DistributedDataParallel with the distributed optimizer every parameter is a view into one
    flat buffer: +1.0x (tools/bench/checkpoint_save_memory.py). Both are megatron-core's. On a
    GPU nothing is cloned: the writer stages every tensor (a view: its own elements) in host
    memory."""
    refuse_unguarded_main()
    save = _begin(Path(directory), step)
    queue = _writer_queue()
    _write(save, state, queue)
    _written(save, queue, blocking=True)
    return _finish(save, cfg, keep_last)


def _writer_queue():
    """megatron-core's AsyncCallsQueue for a saver's writes.

    Not megatron-core's persistent worker: without a GPU it dies as it starts
    (torch.cuda.set_device(rank % device_count()), a division by zero) and the save waits for it
    forever; and it would receive CPU tensors through shared memory, the weights that training
    goes on changing, not a snapshot."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    start_results_queue()
    return AsyncCallsQueue(persistent=False)


def _write(save: _Save, state: dict, queue) -> None:
    """Collective: stages this rank's part of ``save`` (``state``) and starts its write on
    ``queue``, in a writer process forked from this one (``watched``).

    Whether every rank started its write is agreed on (one all-reduce of one number): a fork
    refused on one rank alone (ENOMEM under strict overcommit, EAGAIN at a pids cgroup's limit)
    would otherwise leave the others waiting in the finalize's collectives until the
    process-group timeout. Then the save fails on every rank, naming the rank and its error, and
    the writes that did start are killed. The failing rank logs its error first: one in
    megatron-core's planning that sharded_save's run of it ahead did not meet leaves the others
    in its gather of the plans, not here."""
    started, call_idx, error = len(queue.async_calls), queue.call_idx, None
    try:
        request = save_sharded(state, save.tmp)
    except (Exception, CheckpointException) as e:
        if is_decided_on_every_rank(e):  # sharded_save's: none waits in a collective
            raise restating(e, _write_failed(save, str(e))) from None
        error = one_line(e)
    else:
        try:
            queue.schedule_async_request(watched(request, save.staged))
        except (Exception, CheckpointException) as e:
            error = f"its writer process did not start: {one_line(e)}"
    if error is not None and dist.is_initialized() and dist.get_world_size() > 1:
        error = said_by_this_rank(error)
        # Said at once, before the agreement: a failure in megatron-core's planning leaves rank 0
        # in its gather of the plans, not in this agreement, and both wait out the process-group
        # timeout, after which only this line says why.
        log.error("%s (saving step %d into %s)", error, save.step, save.tmp)
    if not any_rank(error is not None):
        save.writer = queue.async_calls[-1].async_caller.process
        return
    if len(queue.async_calls) > started:  # this rank's write started: it would write on
        caller = queue.async_calls.pop().async_caller
        writer = caller.process
        caller.close(abort=True)  # a SIGKILL, not waited for (and forgets the process)
        writer.join()  # gone, not exiting, once the save's failure is reported
        _drop_results()
    queue.call_idx = call_idx  # counted on the ranks that got as far: the finalize compares them
    # Also the barrier that keeps rank 0 from removing iter_N.tmp before every write is killed.
    raise decided_on_every_rank(_write_failed(save, first_error(error))) from None


def _written(save: _Save, queue, blocking: bool, part: str = "") -> bool:
    """Collective: whether every rank's write of ``save`` on ``queue`` is complete, waiting for
    them if ``blocking``. A write failed on any rank fails on every rank (megatron-core's
    finalize gathers every rank's results), naming the signal on the rank whose writer process
    was killed; ``part``: what ``_write_failed`` says failed."""
    try:
        return bool(queue.maybe_finalize_async_calls(blocking=blocking))
    except (Exception, CheckpointException) as e:
        died = save.writer is not None and died_of(save.writer)
        # The finalize's own failures (sharded_save's) were agreed on: restated as such.
        raise restating(e, _write_failed(save, f"its writer process died of {died}" if died
                                         else e, part)) from None


def _drop_results() -> None:
    """Empties megatron-core's results queue of a write that will not be finalized: its result
    would be taken by this process's next save as its own."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = filesystem_async._results_queue
    while results is not None and not results.empty():
        results.get_nowait()


def left_by_an_exit(directory: Path, latest_step: int | None, saving_step: int | None) -> str:
    """What a run exiting at once leaves in checkpoint ``directory``, in words: the checkpoint
    ``latest`` names (this run's ``latest_step``, or none) and, if it was saving ``saving_step``,
    what the save may have got to."""
    latest = (f"{directory / LATEST} names {checkpoint_name(latest_step)}"
              if latest_step is not None else f"{directory} holds no checkpoint of this run")
    if saving_step is None:
        return latest
    name = checkpoint_name(saving_step)
    return (f"the save of step {saving_step} is cut short: {latest} (or {name} if that save had "
            f"just completed; an unfinished {name}.tmp is never loaded, and the next save "
            "removes it)")


def _free_space(directory: Path) -> str:
    """Space left for unprivileged writes: a full disk often surfaces as some other error (torch's
    zip writer says "unexpected pos")."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return "unknown space"
    return f"{stats.f_bavail * stats.f_frsize / 2**20:.1f} MiB"


class CheckpointSaver:
    """A run's checkpoint saves into ``directory`` (every method but ``abandon`` is a collective).

    ``latest_step``: the step of the checkpoint ``latest`` names (as far as this run knows; set
    by a resume); ``pending_step``: the step whose background write is in flight, if any.
    ``note(text)`` is told, after every change, what an exit at once would leave
    (``left_by_an_exit``). ``timings``: per finalized save, its step, the seconds the training
    loop spent on it (``blocked_s``: staging and scheduling, polls, the finalize and any wait
    for the write) and, for a background write, the seconds from its start until it was found
    complete (``background_s``, None for a synchronous save; found at the next step's poll, so
    up to a step longer than the write itself)."""

    def __init__(self, directory: Path, cfg: RunConfig,
                 note: Callable[[str], None] = lambda text: None):
        refuse_unguarded_main()  # before the run starts, not at its first save
        self.directory, self.cfg, self._note = Path(directory), cfg, note
        self.keep_last, self.asynchronous = cfg.checkpoint.keep_last, cfg.checkpoint.async_save
        self.latest_step: int | None = None
        self.timings: list[dict] = []
        self._pending: _Save | None = None
        self._queue = None  # megatron-core's AsyncCallsQueue, made by the first save
        if is_rank0():
            remove_pruned(self.directory)

    @property
    def pending_step(self) -> int | None:
        return self._pending.step if self._pending is not None else None

    def noted(self, saving: int | None = None) -> None:
        """Tells ``note`` what an exit now leaves (``saving``: a save about to begin)."""
        self._note(left_by_an_exit(self.directory, self.latest_step,
                                   saving if saving is not None else self.pending_step))

    def save(self, step: int, state: dict, wait: bool = True) -> Path:
        """Saves ``state`` (every rank's sharded state dict) as checkpoint ``step``, after the
        save in flight is finalized. Returns its path, complete when synchronous or ``wait``;
        else it is complete once a later ``poll`` or ``wait`` has finalized it."""
        self.wait()
        started = time.perf_counter()
        self.noted(saving=step)
        save = _begin(self.directory, step)
        if self._queue is None:
            self._queue = _writer_queue()
        _write(save, state, self._queue)
        if not self.asynchronous:
            _written(save, self._queue, blocking=True)
            return self._finished(save, started)
        save.scheduled_at = time.perf_counter()
        save.blocked_s = save.scheduled_at - started
        self._pending = save
        self.noted()
        if wait:
            self.wait()
        return save.final

    def poll(self) -> Path | None:
        """Finalizes the save in flight if every rank's write has completed (the path), else
        returns at once (None)."""
        return self._finalize(blocking=False)

    def wait(self) -> Path | None:
        """Waits for the write in flight and finalizes it (its path; None when none)."""
        return self._finalize(blocking=True)

    close = wait

    def abandon(self) -> None:
        """Local, no collective: after a failure that may be this rank's alone, a write in flight
        is left as its ``iter_N.tmp`` (never loaded; the next save removes it) and ``latest``
        where it is. ``wait`` would finalize it in collectives that the other ranks, busy in
        training's own, never join: both would wait until the process-group timeout."""
        save, self._pending = self._pending, None
        if save is None:
            return
        while self._queue.async_calls:  # this rank's writer, joined: no write outlives the run
            self._queue.async_calls.popleft().async_caller.close()
        _drop_results()
        self.noted()

    def _finalize(self, blocking: bool) -> Path | None:
        save = self._pending
        if save is None:
            return None
        started = time.perf_counter()
        try:
            done = _written(save, self._queue, blocking, " in its background write")
        except CheckpointError:  # raised on every rank
            self._pending = None
            self.noted()
            raise
        if not done:
            save.blocked_s += time.perf_counter() - started
            return None
        self._pending = None
        return self._finished(save, started)

    def _finished(self, save: _Save, since: float) -> Path:
        """``_finish`` of ``save``, whose every part is written; the loop waits from ``since``."""
        background = (None if save.scheduled_at is None
                      else time.perf_counter() - save.scheduled_at)
        try:
            path = _finish(save, self.cfg, self.keep_last)
        except CheckpointError:
            self.noted()
            raise
        save.blocked_s += time.perf_counter() - since
        self.latest_step = save.step
        self.noted()
        self.timings.append({"step": save.step, "blocked_s": save.blocked_s,
                             "background_s": background})
        if is_rank0():
            log.info("saved %s: training waited %.2f s for it%s", path, save.blocked_s,
                     "" if background is None else
                     f", its write ran {background:.2f} s in the background")
        return path
