"""Traces of a range of training steps (``train.profile``): torch.profiler's Chrome trace and its
table of the most expensive operators, and on CUDA the allocator's memory history, from the
ranks asked for. A trace that cannot be written (a full disk) is a warning: training goes on.

Files, in ``train.profile.dir`` (default ``<train.out_dir>/profile``), each written atomically:

- ``rank{R}_steps{A}-{B}.trace.json.gz``: open in https://ui.perfetto.dev, chrome://tracing or
  TensorBoard's profiler plugin;
- ``rank{R}_steps{A}-{B}.ops.txt``: operators by self time (CUDA time on a GPU);
- ``rank{R}_steps{A}-{B}.memory.pickle`` (``memory: true``, CUDA only): the allocator's history,
  for https://pytorch.org/memory_viz.

A and B are the steps traced: the range asked for, less the steps a resumed run had already done,
or up to the step a stop signal ended it at. A range that traces nothing (the run resumed past
it, or stopped before it) says so in a warning.
"""

from __future__ import annotations

import gzip
import logging
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from megaloop.cli import EVERY_RANK
from megaloop.config import ConfigError, RunConfig
from megaloop.platform.files import atomic_path, write_text_atomic

log = logging.getLogger("megaloop.train")
# The table's length: the operators that make up most of a step, not the long tail.
TABLE_ROWS = 40
# Allocation events kept by the CUDA memory history (the most recent, when a range has more).
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    """Traces steps ``train.profile.steps`` on this rank if it is one of ``train.profile.ranks``.
    The Trainer calls ``step_begins(step)`` before each training step, ``step_ends(step)`` after
    it, and ``close()`` once (also after a stop signal: what was traced is written)."""

    def __init__(self, cfg: RunConfig, resumed_step: int):
        settings = cfg.train.profile
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.on_gpu = on_gpu = torch.cuda.is_available()
        self._profiler, self._traced = None, []
        self._recording_memory = self._started = False
        self.first = self.last = None
        if not settings.steps:
            return
        outside = [r for r in settings.ranks if r >= world_size]
        if outside:
            raise ConfigError(f"train.profile.ranks={settings.ranks}: rank {outside[0]} is not "
                              f"in this run of {world_size} rank(s)")
        first, last = settings.steps
        if resumed_step >= last:
            log.warning("train.profile.steps=%s: the run resumes after step %d, so nothing is "
                        "traced; ask for later steps", settings.steps, resumed_step)
            return
        if resumed_step >= first:
            log.warning("train.profile.steps=%s: the run resumes after step %d, so steps %d-%d "
                        "only are traced", settings.steps, resumed_step, resumed_step + 1, last)
        if rank not in settings.ranks:
            return
        self.first, self.last = max(first, resumed_step + 1), last
        # One step before the range, when the run has one, warms the profiler up: the first
        # traced step would otherwise carry its start-up cost.
        self._warmup = 1 if self.first > resumed_step + 1 else 0
        self.rank, self.settings = rank, settings
        self.dir = Path(settings.dir or Path(cfg.train.out_dir) / "profile")
        if settings.memory and not on_gpu:
            log.warning("train.profile.memory=true: the memory history is CUDA's allocator's, "
                        "and this run has no GPU; no memory snapshot is written")

    def step_begins(self, step: int) -> None:
        if self.first is None:
            return
        self._started = True
        if step == self.first - self._warmup:
            self._start()
        elif self._profiler is not None:
            self._profiler.step()  # step ``step`` begins: what ran since (a save) was the last's
        if step == self.first and self.on_gpu and self.settings.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._recording_memory = True

    def step_ends(self, step: int) -> None:
        if self._profiler is None:
            return
        if step >= self.first:
            self._traced.append(step)
        if step == self.last:
            self._profiler.step()  # past the range: the schedule hands the trace to _write
            self.close()

    def close(self) -> None:
        """Stops tracing and writes what was traced (idempotent); a range the run never reached
        is named in a warning."""
        profiler, self._profiler = self._profiler, None
        try:
            if profiler is not None:
                profiler.stop()  # hands the steps recorded, if any, to _write
        finally:
            if self._recording_memory:  # also after a failed write: later work is not recorded
                torch.cuda.memory._record_memory_history(enabled=None)
                self._recording_memory = False
        if self.first is not None and self._started and not self._traced:
            log.warning("train.profile.steps=%s: the run ended before step %d; nothing was "
                        "traced", self.settings.steps, self.first)
        self.first = None

    def _start(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("train.profile.dir=%r: not a writable directory (%s); steps %d-%d are not "
                        "traced", str(self.dir), e.strerror or e, self.first, self.last)
            self.first = None
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        start = self.first - self._warmup
        # The schedule counts training steps, so that the trace's ProfilerStep#N is step N.
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(skip_first=start, wait=0, warmup=self._warmup,
                                             active=self.last - self.first + 1, repeat=1),
            on_trace_ready=self._write, record_shapes=True, profile_memory=True,
            with_stack=self.settings.with_stack)
        # From the step before (traced by none), step() enters step ``start`` as the schedule
        # says: warm-up, or tracing (torchtitan sets step_num the same way on resume).
        self._profiler.step_num = start - 1
        self._profiler.start()
        self._profiler.step()

    def _write(self, profiler) -> None:
        if not self._traced:  # stopped during the warm-up step: no step to write
            return
        try:
            self._write_files(profiler)
        except OSError as e:
            log.warning("rank %d: the trace of steps %d-%d was not written (%s: %s); training "
                        "goes on", self.rank, self._traced[0], self._traced[-1],
                        e.filename or self.dir, e.strerror or e)

    def _write_files(self, profiler) -> None:
        stem = self.dir / f"rank{self.rank}_steps{self._traced[0]}-{self._traced[-1]}"
        trace = stem.with_name(stem.name + ".trace.json.gz")
        with tempfile.TemporaryDirectory(dir=self.dir, prefix=".trace-") as staging, \
                atomic_path(trace) as tmp:
            raw = Path(staging) / "trace.json"
            profiler.export_chrome_trace(str(raw))
            with open(raw, "rb") as source, gzip.open(tmp, "wb") as target:
                shutil.copyfileobj(source, target)
        sort = "self_cuda_time_total" if self.on_gpu else "self_cpu_time_total"
        ops = stem.with_name(stem.name + ".ops.txt")
        write_text_atomic(ops, profiler.key_averages().table(sort_by=sort,
                                                             row_limit=TABLE_ROWS) + "\n")
        written = [trace, ops]
        if self.on_gpu and self.settings.memory:
            memory = stem.with_name(stem.name + ".memory.pickle")
            with atomic_path(memory) as tmp:
                torch.cuda.memory._dump_snapshot(str(tmp))
            written.append(memory)
        log.info("rank %d: steps %d-%d traced: %s", self.rank, self._traced[0], self._traced[-1],
                 ", ".join(str(p) for p in written), extra=EVERY_RANK)
