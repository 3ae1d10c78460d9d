"""Tokenize text corpora into Megatron .bin/.idx files, streaming, in parallel, deterministically.

The main process cuts the inputs into bounded chunks (``readers.iter_chunks``); worker processes
parse and tokenize whole chunks with one batched tokenizer call each and return flat token arrays;
the main process writes them, in input order, through megatron-core's ``IndexedDatasetBuilder``.
At most ``2 * workers + 2`` chunks are in flight, so text and tokens take the same memory however
large the input, and results are consumed in submission order, so the bytes are the same for any
worker count. What does grow is the index the builder keeps in Python lists until ``finalize``:
about 80 bytes per document (measured; ~0.8 GB for FineWeb-Edu sample-10BT's 9.7M documents),
and ``finalize`` briefly needs ~60 bytes per document more to write the .idx.

Workers are spawned (not forked) and import only this module's light dependencies: the parent
has usually imported torch and megatron-core, which are slow to import and unsafe to fork.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy

from megaloop.data.readers import BadRecords, Chunk, DataError, RecordFilter, expand_inputs, iter_chunks, parse_chunk
from megaloop.data.tokenizer import TextTokenizer, load_tokenizer


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


@dataclass
class PreprocessStats:
    docs: int = 0
    tokens: int = 0
    bytes: int = 0  # uncompressed input bytes of the records consumed
    filtered: int = 0
    bad: BadRecords = field(default_factory=BadRecords)
    seconds: float = 0.0

    def merge(self, other: PreprocessStats) -> None:
        self.docs += other.docs
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.filtered += other.filtered
        self.bad.merge(other.bad)
        self.seconds = max(self.seconds, other.seconds)

    def rates(self) -> str:
        s = max(self.seconds, 1e-9)
        return f"{self.docs / s:,.0f} docs/s, {self.bytes / s / 1e6:.2f} MB/s, {self.tokens / s:,.0f} tokens/s"


@dataclass
class EncodedChunk:
    tokens: dict[str, numpy.ndarray]  # per json key: all documents' ids, concatenated
    lengths: dict[str, numpy.ndarray]  # per json key: ids per document (EOD included)
    docs: int
    nbytes: int
    filtered: int
    bad: BadRecords


def output_prefix(prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{prefix}_{key}_document``."""
    return f"{prefix}_{key}_document"


# Per-process state, set once by _init_worker so each task only ships a chunk.
_tokenizer: TextTokenizer | None = None
_options: PreprocessOptions | None = None


def _init_worker(options: PreprocessOptions) -> None:
    global _tokenizer, _options
    _tokenizer = load_tokenizer(options.tokenizer_type, options.tokenizer_model)
    _options = options


def encode_chunk(chunk: Chunk) -> EncodedChunk:
    """Parse and tokenize one chunk (runs in a worker)."""
    parsed = parse_chunk(chunk, _options.record_filter)
    tokens, lengths = {}, {}
    for k, key in enumerate(_options.record_filter.keys):
        ids = _tokenizer.encode_batch([doc[k] for doc in parsed.docs])
        if _options.append_eod:
            for doc_ids in ids:
                doc_ids.append(_tokenizer.eod)
        lengths[key] = numpy.fromiter(map(len, ids), dtype=numpy.int64, count=len(ids))
        # int32 here; the builder narrows to the file's dtype (uint16 for most vocabs) on write.
        tokens[key] = numpy.fromiter(itertools.chain.from_iterable(ids), dtype=numpy.int32, count=int(lengths[key].sum()))
    return EncodedChunk(tokens, lengths, len(parsed.docs), chunk.nbytes, parsed.filtered, parsed.bad)


def _ordered_bounded_map(fn: Callable, items: Iterable, pool, max_in_flight: int) -> Iterator:
    """``pool.imap`` that reads ``items`` lazily: Pool.imap would queue the whole input at once."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def check_tokenizer(options: PreprocessOptions) -> TextTokenizer:
    """Load the tokenizer up front, so a bad file or missing EOD fails before any work."""
    tokenizer = load_tokenizer(options.tokenizer_type, options.tokenizer_model)
    if options.append_eod and tokenizer.eod is None:
        raise DataError(f"{options.tokenizer_model}: --append-eod given but the tokenizer has no end-of-text token")
    return tokenizer


def preprocess(
    ranges: Sequence[tuple[str, int, int | None]],
    prefix: str,
    options: PreprocessOptions,
    on_progress: Callable[[PreprocessStats], None] | None = None,
) -> PreprocessStats:
    """Tokenize the records ``ranges`` names into ``output_prefix(prefix, key)`` for each key.

    ``ranges`` is ``[(path, start, stop)]`` as ``readers.iter_chunks`` takes; use
    ``whole_files(inputs)`` for everything. Raises DataError on the first bad record if strict.
    """
    from megaloop.data.indexed import AtomicIndexedWriter, token_dtype

    tokenizer = check_tokenizer(options)
    keys = options.record_filter.keys
    chunks = iter_chunks(ranges, options.record_filter.columns(), options.chunk_records, options.chunk_bytes)
    stats = PreprocessStats()
    pool, writers = None, {}
    try:
        if options.workers == 0:
            _init_worker(options)
            results = map(encode_chunk, chunks)
        else:
            pool = multiprocessing.get_context("spawn").Pool(options.workers, _init_worker, (options,))
            results = _ordered_bounded_map(encode_chunk, chunks, pool, 2 * options.workers + 2)
        # After starting the pool, so megatron-core's slow import overlaps the workers' start-up.
        dtype = token_dtype(tokenizer.vocab_size)
        writers = {key: AtomicIndexedWriter(output_prefix(prefix, key), dtype) for key in keys}
        # Rates count from here, after start-up, as Megatron-LM's log lines do.
        start = time.perf_counter()
        for encoded in results:
            if options.strict and encoded.bad.total:
                raise DataError(f"{encoded.bad.examples[0]} (--strict)")
            take = encoded.docs
            if options.max_docs is not None:
                take = min(take, options.max_docs - stats.docs)
            for key in keys:
                _write_documents(writers[key], encoded.tokens[key], encoded.lengths[key][:take])
            stats.docs += take
            stats.tokens += int(sum(int(encoded.lengths[key][:take].sum()) for key in keys))
            stats.bytes += encoded.nbytes
            stats.filtered += encoded.filtered
            stats.bad.merge(encoded.bad)
            stats.seconds = time.perf_counter() - start
            if on_progress:
                on_progress(stats)
            if options.max_docs is not None and stats.docs >= options.max_docs:
                break
        for writer in writers.values():
            writer.commit()
    finally:
        if pool is not None:
            pool.terminate()  # also stops workers still busy on chunks past --max-docs
            pool.join()
        for writer in writers.values():
            writer.__exit__(None, None, None)
    return stats


def _write_documents(writer, tokens: numpy.ndarray, lengths: numpy.ndarray) -> None:
    offset = 0
    for n in lengths.tolist():
        writer.add_document(tokens[offset:offset + n], [n])
        offset += n


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
