"""Tokenize text corpora into Megatron .bin/.idx files, streaming, in parallel, deterministically.

The main process cuts the inputs into bounded chunks (``readers.iter_chunks``); worker processes
parse and tokenize whole chunks with one batched tokenizer call each and return flat token arrays;
the main process writes them, in input order, through megatron-core's ``IndexedDatasetBuilder``.
At most ``2 * workers + 2`` chunks are in flight, so text and tokens take the same memory however
large the input, and results are consumed in submission order, so the bytes are the same for any
worker count and whichever worker finishes first. What does grow is the index the builder keeps
in Python lists until ``finalize``: about 80 bytes per document (measured; ~0.8 GB for FineWeb-Edu
sample-10BT's 9.7M documents), and ``finalize`` briefly needs ~60 bytes per document more.

Documents are what Megatron-LM's tools/preprocess_data.py writes for the same record: a text is one
sequence; a list of sentences is one sequence per sentence that has tokens; EOD (if asked) ends the
last sequence; a text with no tokens is an empty document, without EOD.

Beside each .bin/.idx pair goes ``{prefix}.tokenizer.json`` (``write_sidecar``): how the ids were
made (tokenizer type, model file and its sha256, legacy encoding, EOD id, vocabulary, --append-eod)
and the documents and tokens it describes, so that training can refuse settings that read the ids
otherwise. Megatron-LM writes none; readers treat it as optional.

Workers are spawned (not forked) and import only this module's light dependencies: the parent
has usually imported torch and megatron-core, which are slow to import and unsafe to fork. They are
a ``ProcessPoolExecutor``'s, which notices a worker that died (the kernel's out-of-memory killer
sends SIGKILL) where ``multiprocessing.Pool`` would wait for its result forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy

from megaloop.data.readers import (BadRecords, Chunk, DataError, RecordFilter, expand_inputs, first_line, iter_chunks,
                                   parse_chunk)
from megaloop.data.tokenizer import TextTokenizer, load_tokenizer
from megaloop.platform.files import write_text_atomic


class WorkerDied(RuntimeError):
    """A tokenizer worker process ended without returning its chunk (killed, or crashed)."""


@dataclass(frozen=True)
class PreprocessOptions:
    tokenizer_type: str
    tokenizer_model: str
    record_filter: RecordFilter = RecordFilter()
    append_eod: bool = False
    workers: int = 1  # 0 tokenizes in the calling process (tests, tiny inputs)
    max_docs: int | None = None
    strict: bool = False
    chunk_records: int = 512
    chunk_bytes: int = 1 << 20
    legacy_tokenizer: bool = False  # Megatron-LM's --legacy-tokenizer encoding (tokenizer.load_tokenizer)


@dataclass
class PreprocessStats:
    docs: int = 0
    tokens: int = 0
    key_tokens: dict[str, int] = field(default_factory=dict)  # per json key: what ``tokens`` sums
    bytes: int = 0  # uncompressed input bytes of the records consumed
    filtered: int = 0
    empty: int = 0  # documents (one per record and key) without a token: empty texts
    bad: BadRecords = field(default_factory=BadRecords)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the main process's and the workers' CPU time over ``seconds``

    def merge(self, other: PreprocessStats) -> None:
        self.docs += other.docs
        self.tokens += other.tokens
        for key, n in other.key_tokens.items():
            self.key_tokens[key] = self.key_tokens.get(key, 0) + n
        self.bytes += other.bytes
        self.filtered += other.filtered
        self.empty += other.empty
        self.bad.merge(other.bad)
        self.seconds = max(self.seconds, other.seconds)
        self.cpu_seconds += other.cpu_seconds

    def rates(self) -> str:
        s, megabytes = max(self.seconds, 1e-9), max(self.bytes / 1e6, 1e-9)
        return (f"{self.docs / s:,.0f} docs/s, {megabytes / s:.2f} MB/s, {self.tokens / s:,.0f} tokens/s, "
                f"{self.cpu_seconds / megabytes:.3f} CPU s/MB")


@dataclass
class EncodedKey:
    """One json key's documents of a chunk, flat: what ``IndexedDatasetBuilder.add_document`` takes."""

    tokens: numpy.ndarray  # int32, every sequence's ids concatenated
    sequence_lengths: numpy.ndarray  # int64, ids per sequence (EOD included)
    document_sequences: numpy.ndarray  # int64, sequences per document (0 for an empty document)

    def first_documents(self, count: int) -> EncodedKey:
        sequences = int(self.document_sequences[:count].sum())
        tokens = int(self.sequence_lengths[:sequences].sum())
        return EncodedKey(self.tokens[:tokens], self.sequence_lengths[:sequences], self.document_sequences[:count])


@dataclass
class EncodedChunk:
    keys: dict[str, EncodedKey]
    docs: int
    nbytes: int
    filtered: int
    bad: BadRecords
    cpu_seconds: float  # the worker's, for this chunk


def output_prefix(prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{prefix}_{key}_document``."""
    return f"{prefix}_{key}_document"


# Per-process state, set once by _init_worker so each task only ships a chunk.
_tokenizer: TextTokenizer | None = None
_options: PreprocessOptions | None = None
_all_started = None  # a pool worker's barrier with its peers (see _start_workers)


def _load(options: PreprocessOptions) -> TextTokenizer:
    return load_tokenizer(options.tokenizer_type, options.tokenizer_model, legacy=options.legacy_tokenizer)


def _init_worker(options: PreprocessOptions) -> None:
    global _tokenizer, _options
    _tokenizer = _load(options)
    _options = options


def _init_pool_worker(options: PreprocessOptions, all_started) -> None:
    global _all_started
    # Workers start with the signal mask of the submit that spawned them (_signals_held).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # Ctrl-C reaches every process of the terminal's group; only the main process acts on it and
    # stops the workers, so an interrupt is reported as one and not as a worker that died.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(options)
    _all_started = all_started


def _wait_for_peers() -> None:
    _all_started.wait()


def _start_workers(options: PreprocessOptions) -> tuple[ProcessPoolExecutor, list]:
    """A pool whose workers all start now, with futures done once every one is ready.

    ProcessPoolExecutor starts a worker per submit while none is idle, so one task per worker,
    each waiting for the others, starts them all and keeps any from taking two. Waiting for the
    futures keeps start-up out of the rates, as it was with multiprocessing.Pool.
    """
    ctx = multiprocessing.get_context("spawn")
    executor = ProcessPoolExecutor(options.workers, ctx, _init_pool_worker, (options, ctx.Barrier(options.workers)))
    with _signals_held():
        return executor, [executor.submit(_wait_for_peers) for _ in range(options.workers)]


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends. ``ProcessPoolExecutor.submit`` may start a
    worker and the pool's manager thread; interrupted half-way, it leaves a pool that can no longer
    be shut down ("cannot join thread before it is started"), and the clean-up fails with it.

    Blocking them in this thread is not enough: the kernel hands a process-directed signal to any
    thread that does not block it (pytest-xdist's I/O thread, a library's), and Python then runs
    the handler here anyway. So the handlers are deferred too, and the first signal caught is
    raised again once the block ends. The mask stays for the workers spawned inside the block, who
    start with it and set their own handlers before taking signals."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    caught: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # the only thread Python runs handlers in
        handlers = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                    for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if caught:
            signal.raise_signal(caught[0])


def encode_chunk(chunk: Chunk) -> EncodedChunk:
    """Parse and tokenize one chunk (runs in a worker)."""
    started = time.process_time()
    parsed = parse_chunk(chunk, _options.record_filter)
    keys = {key: encode_documents([doc[k] for doc in parsed.docs], _tokenizer, _options.append_eod)
            for k, key in enumerate(_options.record_filter.keys)}
    return EncodedChunk(keys, len(parsed.docs), chunk.nbytes, parsed.filtered, parsed.bad,
                        time.process_time() - started)


def encode_documents(texts: Sequence[str | list[str]], tokenizer: TextTokenizer, append_eod: bool) -> EncodedKey:
    """Tokenize documents (texts, or lists of sentences) in one batch, as Megatron-LM's Encoder does
    one by one: a sentence without tokens is dropped, EOD joins the last sequence of a non-empty one."""
    sentences = [s for text in texts for s in ([text] if isinstance(text, str) else text)]
    ids = iter(tokenizer.encode_batch(sentences))
    sequences: list[list[int]] = []
    document_sequences = numpy.empty(len(texts), dtype=numpy.int64)
    for d, text in enumerate(texts):
        kept = [s for s in (next(ids) for _ in range(1 if isinstance(text, str) else len(text))) if s]
        if kept and append_eod:
            kept[-1].append(tokenizer.eod)
        sequences += kept
        document_sequences[d] = len(kept)
    lengths = numpy.fromiter(map(len, sequences), dtype=numpy.int64, count=len(sequences))
    # int32 here; the builder narrows to the file's dtype (uint16 for most vocabs) on write.
    tokens = numpy.fromiter(itertools.chain.from_iterable(sequences), dtype=numpy.int32, count=int(lengths.sum()))
    return EncodedKey(tokens, lengths, document_sequences)


def _ordered_bounded_map(fn: Callable, items: Iterable, executor: ProcessPoolExecutor, max_in_flight: int) -> Iterator:
    """``executor.map`` that reads ``items`` lazily (it would queue the whole input at once), and
    yields in submission order however the workers finish."""
    pending: deque = deque()
    with _deaths_reported(executor):
        for item in items:
            with _signals_held():
                pending.append(executor.submit(fn, item))
            if len(pending) >= max_in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@contextlib.contextmanager
def _deaths_reported(executor: ProcessPoolExecutor) -> Iterator[None]:
    try:
        yield
    except BrokenProcessPool:
        raise WorkerDied(_death_cause(executor)) from None


def _death_cause(executor: ProcessPoolExecutor) -> str:
    # ProcessPoolExecutor keeps its processes private; the exit status is what tells OOM apart.
    processes = list((getattr(executor, "_processes", None) or {}).values())
    # The pool's manager thread terminates the survivors and reaps every worker. Reaping alongside
    # it races: only one caller of waitpid gets a status, and a worker read in between reports none
    # (the SIGKILL was then missed, and a survivor's SIGTERM named as the cause).
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=30)
    for process in processes:
        process.join(timeout=5)  # a no-op once the manager thread has reaped it
    codes = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
    # The pool stops the survivors with SIGTERM, so another signal is the cause if there is one.
    code = next((c for c in codes if c != -signal.SIGTERM), codes[0] if codes else None)
    if code is None:
        how = "died"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        if code == -signal.SIGKILL:
            how += ": the kernel's out-of-memory killer sends it; use fewer --workers or more memory"
    else:
        how = f"exited with status {code}"
    return f"a tokenizer worker process {how}; no output written"


def _stop_pool(executor: ProcessPoolExecutor, now: bool) -> None:
    """Stop the workers: ``now`` kills them (an interrupt: a stuck worker must not hold it up);
    otherwise chunks already handed out finish and the rest are dropped."""
    if now:
        processes = list((getattr(executor, "_processes", None) or {}).values())  # kill_workers() is 3.14+
        for process in processes:
            process.kill()
        for process in processes:
            process.join()
    # Waiting also for the pool's manager thread: left running, it races the interpreter's exit
    # (Python 3.11 then prints an OSError from concurrent.futures' exit hook).
    executor.shutdown(wait=True, cancel_futures=True)


SIDECAR_SUFFIX = ".tokenizer.json"


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR_SUFFIX


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_record(options: PreprocessOptions, tokenizer: TextTokenizer) -> dict:
    """The sidecar's description of how ``tokenizer`` (loaded from ``options``) makes ids."""
    return {"tokenizer_type": options.tokenizer_type,
            "tokenizer_model": os.path.basename(tokenizer.path),
            "tokenizer_sha256": file_sha256(tokenizer.path),
            "legacy_tokenizer": options.legacy_tokenizer, "eod_id": tokenizer.eod,
            "vocab_size": tokenizer.vocab_size, "append_eod": options.append_eod}


def write_sidecar(prefix: str, record: dict) -> None:
    """``record`` (``tokenizer_record`` with the ``documents`` and ``tokens`` of ``prefix``'s
    .bin/.idx) beside them, atomically; the data files are complete without it."""
    path = sidecar_path(prefix)
    try:
        write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    except OSError as err:
        raise DataError(f"{path}: cannot write the tokenizer sidecar ({err.strerror or err}); "
                        "the .bin/.idx are complete without it") from None


def remove_sidecar(prefix: str) -> None:
    """Before new data replaces ``prefix``: an earlier run's sidecar must not outlive its data.
    A linked sidecar loses the file it names, the link kept for the new one to be written
    through (``write_sidecar``)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.realpath(sidecar_path(prefix)))


def read_sidecar(prefix: str) -> dict | None:
    """The sidecar of ``prefix``, or None when it has none (data from Megatron-LM, say)."""
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable tokenizer sidecar ({first_line(err)}); remove it or "
                        "preprocess the data again")
    if not isinstance(record, dict):
        raise DataError(f"{path}: a tokenizer sidecar must be a JSON object, got "
                        f"{type(record).__name__}")
    return record


def check_tokenizer(options: PreprocessOptions) -> TextTokenizer:
    """Load the tokenizer up front, so a bad file or missing EOD fails before any work."""
    tokenizer = _load(options)
    if options.append_eod and tokenizer.eod is None:
        raise DataError(f"{options.tokenizer_model}: --append-eod given but the tokenizer has no end-of-text token")
    return tokenizer


def named_inputs(paths: Iterable[str]) -> str:
    """The input files, for an error about all of them: every one up to three, else how many and
    the first and last (a directory may hold thousands)."""
    paths = list(dict.fromkeys(map(str, paths)))
    if len(paths) <= 3:
        return ", ".join(paths)
    return f"{len(paths):,} files ({paths[0]} ... {paths[-1]})"


def check_usable(stats: PreprocessStats, keys: Sequence[str], inputs: Iterable[str]) -> None:
    """Refuse output in which a key has not a single token, naming the ``inputs`` and why: what
    each record lacked, or that all were empty or filtered out. A --json-keys typo names the
    fields the records do have. With several keys, one whose texts are all empty would be an
    output of empty documents."""
    empty = [key for key in keys if not stats.key_tokens.get(key)]
    if not empty:
        return
    wanted = ", ".join(map(repr, empty))
    if stats.bad.total and len(empty) == len(keys):
        why = stats.bad.explain(keys)
    elif stats.docs:
        why = f"all {stats.docs:,} documents have empty {wanted} texts"
    elif stats.filtered:
        why = f"all {stats.filtered:,} records are below the score threshold"
    else:
        why = "no records at all"
    raise DataError(f"no usable document in {named_inputs(inputs)}: {why}")


def preprocess(
    ranges: Sequence[tuple[str, int, int | None]],
    prefix: str,
    options: PreprocessOptions,
    on_progress: Callable[[PreprocessStats], None] | None = None,
    allow_empty: bool = False,
) -> PreprocessStats:
    """Tokenize the records ``ranges`` names into ``output_prefix(prefix, key)`` for each key.

    ``ranges`` is ``[(path, start, stop)]`` as ``readers.iter_chunks`` takes; use
    ``whole_files(inputs)`` for everything. Raises DataError on the first bad record if strict,
    and if no token at all came out unless ``allow_empty`` (an MPI rank's share may be empty);
    WorkerDied if a worker process died. Either way nothing is left under the output names.
    """
    from megaloop.data.indexed import AtomicIndexedWriter, mcore_indexed, token_dtype

    tokenizer = check_tokenizer(options)
    keys = options.record_filter.keys
    chunks = iter_chunks(ranges, options.record_filter.columns(), options.chunk_records, options.chunk_bytes)
    stats = PreprocessStats(key_tokens=dict.fromkeys(keys, 0))
    executor, writers = None, {}
    try:
        if options.workers == 0:
            _init_worker(options)
            results = map(encode_chunk, chunks)
        else:
            executor, started = _start_workers(options)
            results = _ordered_bounded_map(encode_chunk, chunks, executor, 2 * options.workers + 2)
        # After starting the pool, so megatron-core's slow import overlaps the workers' start-up.
        dtype = token_dtype(tokenizer.vocab_size)
        mcore_indexed()  # imported here, not while the signals are held below
        # Held: a signal between a writer's creating its .partial file and ``writers`` holding it
        # would leave that file behind (the clean-up below never sees the writer).
        with _signals_held():
            writers = {key: AtomicIndexedWriter(output_prefix(prefix, key), dtype) for key in keys}
        if executor is not None:
            with _deaths_reported(executor):
                for future in started:
                    future.result()
        # Rates count from here, after start-up, as Megatron-LM's log lines do.
        start, main_cpu, worker_cpu = time.perf_counter(), time.process_time(), 0.0
        for encoded in results:
            if options.strict and encoded.bad.total:
                raise DataError(f"{encoded.bad.examples[0]} (--strict)")
            take = encoded.docs
            if options.max_docs is not None:
                take = min(take, options.max_docs - stats.docs)
            for key in keys:
                part = encoded.keys[key].first_documents(take)
                writers[key].add_documents(part.tokens, part.sequence_lengths, part.document_sequences)
                stats.key_tokens[key] += len(part.tokens)
                stats.tokens += len(part.tokens)
                stats.empty += int((part.document_sequences == 0).sum())
            stats.docs += take
            stats.bytes += encoded.nbytes
            stats.filtered += encoded.filtered
            stats.bad.merge(encoded.bad)
            stats.seconds = time.perf_counter() - start
            if executor is not None:  # in-process chunks are in the main process's time already
                worker_cpu += encoded.cpu_seconds
            stats.cpu_seconds = time.process_time() - main_cpu + worker_cpu
            if on_progress:
                on_progress(stats)
            if options.max_docs is not None and stats.docs >= options.max_docs:
                break
        if not allow_empty:
            check_usable(stats, keys, (path for path, _, _ in ranges))
        record = tokenizer_record(options, tokenizer)
        for key, writer in writers.items():
            remove_sidecar(writer.prefix)
            writer.commit()
            write_sidecar(writer.prefix, {**record, "documents": stats.docs, "tokens": stats.key_tokens[key]})
    except BaseException as err:
        if executor is not None:
            _stop_pool(executor, now=not isinstance(err, Exception))
            executor = None
        raise
    finally:
        try:
            if executor is not None:
                _stop_pool(executor, now=False)  # also drops chunks read ahead past --max-docs
        finally:  # even if a signal interrupts the wait
            for writer in writers.values():
                writer.__exit__(None, None, None)
    return stats


def whole_files(inputs: str | Sequence[str]) -> list[tuple[str, int, None]]:
    """Every record of every input file, in the global order."""
    return [(path, 0, None) for path in expand_inputs(inputs)]


def shard_ranges(counts: Sequence[tuple[str, int]], world_size: int, rank: int) -> list[tuple[str, int, int]]:
    """The ``rank``-th of ``world_size`` contiguous, near-equal slices of the global record order.

    ``counts`` is ``[(path, records)]`` in global order; the result is ``[(path, start, stop)]``.
    Concatenating the ranks' outputs in rank order gives the single-process output.
    """
    total = sum(n for _, n in counts)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    ranges, offset = [], 0
    for path, n in counts:
        start, stop = max(lo - offset, 0), min(hi - offset, n)
        if start < stop:
            ranges.append((path, start, stop))
        offset += n
    return ranges
