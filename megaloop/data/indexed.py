"""Megatron .bin/.idx files: atomic writing through megatron-core's builder, merging, validation.

Writing goes through ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` so the bytes
are exactly what megatron-core's ``IndexedDataset`` and Megatron-LM read. The builder writes to the
names it is given, so ``AtomicIndexedWriter`` hands it temporary names and renames both files only
after ``finalize``: an interrupted run never leaves a .bin/.idx under its final name.

``validate_indexed`` exists because megatron-core's reader trusts the files: a truncated .idx dies
in ``numpy.frombuffer``, a short .bin only fails when a sample past its end is read, and a vocab
too large for the token dtype silently wraps ids. It turns each into one error naming the file.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy

from megaloop.data.readers import DataError
from megaloop.platform.files import sync_file

_HEADER = b"MMIDIDX\x00\x00"
_PREAMBLE = len(_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence and document counts
# megatron-core's DType codes (indexed_dataset.DType); repeated so validation needs no torch import.
_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
           6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def mcore_indexed():
    """megatron-core's indexed_dataset module, imported without its unrelated import warnings.

    Importing it imports all of megatron.core, which warns that Transformer Engine and Apex are
    missing: noise for a tool that only writes data files.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def token_dtype(vocab_size: int) -> type[numpy.number]:
    """The smallest dtype megatron-core uses for a vocab (its ``DType.optimal_dtype``)."""
    return mcore_indexed().DType.optimal_dtype(vocab_size)


_SUFFIXES = (".bin", ".idx")


def _partial_path(target: str, suffix: str, pid: str) -> str:
    """The temporary name of ``target`` (a .bin or .idx) while process ``pid`` writes it."""
    return f"{target.removesuffix(suffix)}.partial-{pid}{suffix}"


def partial_leftovers(prefix: str) -> list[str]:
    """The temporary .bin/.idx files of ``AtomicIndexedWriter(prefix)`` that a killed process
    (SIGKILL, which no clean-up survives) left: beside ``prefix``'s files and, where those are
    symbolic links, beside their targets, where the writer puts them. Live writers' included."""
    found = set()
    for path, suffix in zip((bin_path(prefix), idx_path(prefix)), _SUFFIXES):
        for target in [path] + ([os.path.realpath(path)] if os.path.islink(path) else []):
            found.update(glob.glob(_partial_path(glob.escape(target), suffix, "*")))
    return sorted(found)


class AtomicIndexedWriter:
    """An ``IndexedDatasetBuilder`` writing to temporary names, renamed into place on ``commit``.

    Use as a context manager: leaving the block by an exception (or Ctrl-C) removes the partial
    files, and ``commit`` must be called inside the block for the output to appear.
    """

    def __init__(self, prefix: str, dtype: type[numpy.number]):
        self.prefix = prefix
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        # A .bin or .idx that is a symbolic link is written through, as platform.files' atomic
        # writes are: its target replaced, the temporary beside it for the rename to stay on its
        # filesystem. The pid keeps concurrent writers (MPI ranks on a shared filesystem) apart.
        self.targets = (os.path.realpath(bin_path(prefix)), os.path.realpath(idx_path(prefix)))
        self.temporaries = tuple(_partial_path(target, suffix, str(os.getpid()))
                                 for target, suffix in zip(self.targets, _SUFFIXES))
        self.builder = mcore_indexed().IndexedDatasetBuilder(self.temporaries[0], dtype=dtype)
        self.committed = False

    def add_document(self, tokens: numpy.ndarray, lengths: Sequence[int]) -> None:
        self.builder.add_document(tokens, lengths)

    def add_documents(self, tokens: numpy.ndarray, sequence_lengths: numpy.ndarray,
                      document_sequences: numpy.ndarray) -> None:
        """Documents given flat: all tokens, the length of every sequence, the sequences per document."""
        sequence_ends = numpy.cumsum(document_sequences).tolist()
        token_ends = numpy.cumsum(sequence_lengths).tolist()
        lengths = sequence_lengths.tolist()
        first_sequence, first_token = 0, 0
        for end in sequence_ends:
            last_token = token_ends[end - 1] if end else 0
            self.builder.add_document(tokens[first_token:last_token], lengths[first_sequence:end])
            first_sequence, first_token = end, last_token

    def add_index(self, prefix: str) -> None:
        self.builder.add_index(prefix)

    def commit(self) -> None:
        self.builder.finalize(self.temporaries[1])
        for path in self.temporaries:
            sync_file(path)
        # .idx last: a reader needs both, and the .idx is what marks a dataset complete. A dataset
        # replaced loses its .idx first: interrupted between the renames, the new .bin is left
        # without one (refused as incomplete), never read through the old .idx.
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.targets[1])
        for temporary, target in zip(self.temporaries, self.targets):
            os.replace(temporary, target)
        self.committed = True

    def __enter__(self) -> AtomicIndexedWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.builder.data_file.close()
            for path in self.temporaries:
                if os.path.exists(path):
                    os.remove(path)


def merge_indexed(prefixes: Sequence[str], out_prefix: str, max_docs: int | None = None,
                  before_commit: Callable[[], None] | None = None) -> int:
    """Concatenate datasets (same dtype) into one, in order, atomically; returns the documents.

    With ``max_docs``, only the first ``max_docs`` documents of the concatenation are kept.
    ``before_commit``: called once the merge is written, just before it is renamed in (what
    must not outlive the output it replaces goes then, not before a merge that may fail).
    """
    if not prefixes:
        raise DataError(f"{out_prefix}: nothing to merge")
    summaries = [validate_indexed(p) for p in prefixes]
    dtypes = {s.dtype for s in summaries}
    if len(dtypes) > 1:
        names = ", ".join(f"{s.prefix} ({numpy.dtype(s.dtype).name})" for s in summaries)
        raise DataError(f"cannot merge datasets with different token dtypes: {names}")
    left = max_docs if max_docs is not None else sum(s.num_documents for s in summaries)
    with AtomicIndexedWriter(out_prefix, summaries[0].dtype) as writer:
        for summary in summaries:
            if left >= summary.num_documents:
                writer.add_index(summary.prefix)  # whole files, copied in bulk
                left -= summary.num_documents
            elif left > 0:
                _add_first_documents(writer, summary.prefix, left)
                left = 0
        if before_commit is not None:
            before_commit()
        writer.commit()
    return (max_docs if max_docs is not None else sum(s.num_documents for s in summaries)) - left


def _add_first_documents(writer: AtomicIndexedWriter, prefix: str, count: int) -> None:
    dataset = mcore_indexed().IndexedDataset(prefix)
    bounds = dataset.document_indices
    for doc in range(count):
        sequences = [dataset[i] for i in range(bounds[doc], bounds[doc + 1])]
        tokens = numpy.concatenate(sequences) if sequences else numpy.empty(0, dataset.index.dtype)
        writer.add_document(tokens, [len(s) for s in sequences])  # an empty document stays one


@dataclass(frozen=True)
class IndexedSummary:
    prefix: str
    dtype: type[numpy.number]
    num_sequences: int
    num_documents: int
    num_tokens: int


def _index_arrays(ipath: str, num_seq: int, num_doc: int):
    """(sequence lengths, sequence pointers in bytes, the ``num_doc`` document boundaries) of an
    .idx, memory-mapped: the one reading of the layout after its preamble."""
    index = numpy.memmap(ipath, mode="r")
    return (numpy.frombuffer(index, numpy.int32, num_seq, _PREAMBLE),
            numpy.frombuffer(index, numpy.int64, num_seq, _PREAMBLE + 4 * num_seq),
            numpy.frombuffer(index, numpy.int64, num_doc, _PREAMBLE + 12 * num_seq))


def _summary_arrays(summary: IndexedSummary):
    """``_index_arrays`` of a validated dataset (its boundaries: num_documents + 1)."""
    return _index_arrays(idx_path(summary.prefix), summary.num_sequences,
                         summary.num_documents + 1)


def sequence_lengths(summary: IndexedSummary) -> numpy.ndarray:
    """Tokens per sequence of a validated dataset, memory-mapped from its .idx."""
    return _summary_arrays(summary)[0]


def document_tokens(summary: IndexedSummary, count: int) -> numpy.ndarray:
    """Tokens in each of the first ``count`` documents of a validated dataset, from its .idx."""
    lengths, _, bounds = _summary_arrays(summary)
    bounds = bounds[:count + 1]
    ends = numpy.concatenate(([0], numpy.cumsum(lengths[:bounds[-1]], dtype=numpy.int64)))
    return numpy.diff(ends[bounds])


def document_last_tokens(summary: IndexedSummary, count: int = 1000) -> numpy.ndarray:
    """The last token of up to ``count`` non-empty documents spread evenly over a validated dataset:
    its EOD id wherever the data was made with one (--append-eod). A few pages of each file read."""
    if summary.num_tokens == 0:  # nothing to read (numpy cannot map an empty .bin)
        return numpy.empty(0, summary.dtype)
    lengths, pointers, bounds = _summary_arrays(summary)
    picked = numpy.unique(numpy.linspace(0, summary.num_documents - 1, count).astype(numpy.int64))
    first, last = bounds[picked], bounds[picked + 1] - 1  # each document's sequences
    itemsize = numpy.dtype(summary.dtype).itemsize
    nonempty = last >= first
    begin = pointers[first[nonempty]] // itemsize
    end = pointers[last[nonempty]] // itemsize + lengths[last[nonempty]]
    tokens = numpy.memmap(bin_path(summary.prefix), dtype=summary.dtype, mode="r")
    return numpy.array(tokens[(end - 1)[end > begin]])


SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 16, 1 << 16  # 1 MiB of any .bin, whatever its size


def bin_sample_md5(prefix: str) -> str:
    """An md5 of a .bin's size and of its bytes in ``SAMPLE_BLOCKS`` blocks of
    ``SAMPLE_BLOCK_BYTES`` spread evenly from its first byte to its last (the whole file when
    smaller): a check of its tokens that reads 1 MiB of a multi-TB file. Data tokenized anew
    (another tokenizer, even one that splits the text alike) differs in every block; a change
    confined to bytes between the blocks (a few flipped bytes) goes unseen."""
    path = bin_path(prefix)
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            digest.update(f.read())
            return digest.hexdigest()
        last = size - SAMPLE_BLOCK_BYTES
        for block in range(SAMPLE_BLOCKS):
            f.seek(last * block // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def _meant_prefix(prefix: str) -> str:
    """A hint naming the dataset a prefix without one likely meant: the same path without its
    .bin/.idx suffix, or the ``{prefix}_{key}_document`` that tools/preprocess_data.py wrote
    for ``--output-prefix {prefix}``."""
    stem = prefix[:-4] if prefix.endswith((".bin", ".idx")) else None
    if stem and os.path.isfile(idx_path(stem)):
        return f"; a prefix names the files without .bin/.idx: {stem}"
    written = sorted(glob.glob(glob.escape(prefix) + "_*_document.idx"))
    if written:
        return (f"; tools/preprocess_data.py --output-prefix {prefix} writes "
                f"{', '.join(p[:-4] for p in written)}")
    return ""


def validate_indexed(prefix: str, vocab_size: int | None = None, scan_tokens: bool = False) -> IndexedSummary:
    """Check a .bin/.idx pair is whole and consistent; raise DataError naming the bad file.

    Checks the .idx header, its size against the counts it declares, the document boundaries,
    that the .bin holds exactly the bytes the .idx describes, and, given ``vocab_size``, that the
    token dtype can hold that vocab. ``scan_tokens`` also reads the .bin to check every id is
    below ``vocab_size`` (one pass over the file).
    """
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    for path in (ipath, bpath):
        if not os.path.isfile(path):
            raise DataError(f"{path}: not found (a dataset prefix needs both .bin and .idx)"
                            f"{_meant_prefix(prefix)}")
    idx_size = os.path.getsize(ipath)
    with open(ipath, "rb") as f:
        head = f.read(_PREAMBLE)
    if len(head) < _PREAMBLE or not head.startswith(_HEADER):
        raise DataError(f"{ipath}: not a Megatron .idx file (bad or truncated header)")
    version, code, num_seq, num_doc = struct.unpack("<QBQQ", head[len(_HEADER):])
    if version != 1:
        raise DataError(f"{ipath}: unsupported .idx version {version}")
    if code not in _DTYPES:
        raise DataError(f"{ipath}: unknown token dtype code {code}")
    dtype = _DTYPES[code]
    expected = _PREAMBLE + num_seq * (4 + 8) + num_doc * 8
    if idx_size not in (expected, expected + num_seq):  # + one int8 mode per sequence if multimodal
        raise DataError(
            f"{ipath}: size {idx_size} bytes does not match the {num_seq} sequences and "
            f"{num_doc} document boundaries it declares ({expected} bytes): truncated or corrupt"
        )
    lengths, pointers, documents = _index_arrays(ipath, num_seq, num_doc)
    if num_doc < 1 or documents[0] != 0 or documents[-1] != num_seq or numpy.any(numpy.diff(documents) < 0):
        raise DataError(f"{ipath}: corrupt document boundaries (must rise from 0 to {num_seq})")
    if numpy.any(lengths < 0):
        raise DataError(f"{ipath}: corrupt sequence lengths (negative)")
    itemsize = numpy.dtype(dtype).itemsize
    ends = numpy.cumsum(lengths, dtype=numpy.int64) * itemsize
    if num_seq and (pointers[0] != 0 or numpy.any(pointers[1:] != ends[:-1])):
        raise DataError(f"{ipath}: corrupt sequence pointers (do not follow the sequence lengths)")
    num_tokens = int(ends[-1] // itemsize) if num_seq else 0
    bin_size = os.path.getsize(bpath)
    if bin_size != num_tokens * itemsize:
        what = "shorter" if bin_size < num_tokens * itemsize else "longer"
        raise DataError(
            f"{bpath}: {bin_size} bytes, {what} than the {num_tokens * itemsize} bytes its .idx "
            f"describes: truncated, or paired with another dataset's .idx"
        )
    if vocab_size is not None:
        _check_vocab(bpath, dtype, vocab_size, num_tokens, scan_tokens)
    return IndexedSummary(prefix, dtype, num_seq, num_doc - 1, num_tokens)


def _check_vocab(bpath: str, dtype, vocab_size: int, num_tokens: int, scan_tokens: bool) -> None:
    if numpy.issubdtype(dtype, numpy.integer) and vocab_size - 1 > numpy.iinfo(dtype).max:
        raise DataError(
            f"{bpath}: token dtype {numpy.dtype(dtype).name} holds ids up to {numpy.iinfo(dtype).max}, "
            f"but the tokenizer has {vocab_size} tokens: made with a different tokenizer"
        )
    if not scan_tokens or num_tokens == 0:
        return
    tokens = numpy.memmap(bpath, dtype=dtype, mode="r")
    step = 1 << 26  # 64M tokens per pass keeps the scan's resident memory bounded
    for start in range(0, num_tokens, step):
        top = int(tokens[start:start + step].max())
        if top >= vocab_size:
            raise DataError(f"{bpath}: token id {top} is outside the tokenizer's {vocab_size}-token vocab")
    del tokens
