"""Streaming readers for pretraining text: .jsonl(.gz/.zst), parquet and plain text, in chunks.

Reading and parsing are split on purpose. ``iter_chunks`` runs in the main process and only cuts
raw bytes (or Arrow record batches) into bounded chunks, cheaply; ``parse_chunk`` runs in the
workers and does the JSON decoding, UTF-8 checks and score filtering. Every record that cannot be
used is counted by reason in ``BadRecords`` with the ``file:line`` of the first few, so nothing is
lost silently.

Documents are numbered in one global order: input files sorted by path, then lines (or parquet
rows) in file order. Sharding across MPI ranks and ``--max-docs`` both rely on that order.

What a user would expect of files as they come: a UTF-8 byte-order mark opening a file is dropped,
plain text's CRLF line ends become LF, a ``.txt`` file whose first line is a JSON object is read as
JSON lines (as Megatron-LM reads any file it is given), and a compressed file cut short (.gz or
.zst) or corrupt is an error naming it, as an unreadable parquet file is: the rest of the file
would be lost, not one record.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from megaloop.data.compressed import open_binary, read_errors

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
MAX_EXAMPLES = 5  # bad records quoted with file:line; the rest are only counted
# How a record is located in its file: jsonl lines (file:12), parquet rows (file:row 12), and
# plain-text paragraphs (file:paragraph 12; blank-line separated, so not a line number).
RECORD_UNITS = {"jsonl": "", "parquet": "row ", "text": "paragraph "}
MAX_KEYS_SEEN = 20  # field names kept from records lacking a wanted key, to name them in errors
BOM = b"\xef\xbb\xbf"
SCORE_FLAGS = {"int_score": "--min-int-score", "score": "--min-score"}  # the quality filter's keys


class DataError(ValueError):
    """Bad input the user must fix; the one-line message names the file, field or value."""


@dataclass
class BadRecords:
    """Counts of unusable records by reason, with ``file:line: reason`` for the first few."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    keys_seen: list[str] = field(default_factory=list)  # fields of records that lacked a wanted key
    keys_missing: list[str] = field(default_factory=list)  # the wanted keys those records lacked

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, where: str, detail: str = "", count: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + count
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}{f' ({detail})' if detail else ''}")

    def saw_keys(self, keys, missing=()) -> None:
        """A record (or parquet file) holding fields ``keys`` lacked the wanted ``missing``."""
        self.keys_missing.extend(key for key in missing if key not in self.keys_missing)
        for key in keys:
            if len(self.keys_seen) >= MAX_KEYS_SEEN:
                return
            if key not in self.keys_seen:
                self.keys_seen.append(key)

    def merge(self, other: BadRecords) -> None:
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples.extend(other.examples[: MAX_EXAMPLES - len(self.examples)])
        self.saw_keys(other.keys_seen, other.keys_missing)

    def reasons(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in sorted(self.counts.items()))

    def summary(self) -> str:
        return f"skipped {self.total} bad records ({self.reasons()})"

    def explain(self, keys: Sequence[str]) -> str:
        """Why records were bad, for an input that gave nothing: the tally, the first one, and for
        records lacking a field, which one (a --json-keys typo or no quality score) and the fields
        they do hold."""
        why = f"{self.total:,} bad records ({self.reasons()}); first: {self.examples[0]}"
        held = ", ".join(map(repr, self.keys_seen))
        if any(key in self.keys_missing for key in keys):
            why += f"; --json-keys {', '.join(map(repr, keys))} but the records hold {held}"
        for score, flag in SCORE_FLAGS.items():
            if score in self.keys_missing:
                why += f"; {flag} needs the score key {score!r} but the records hold {held}"
        return why


@dataclass
class Chunk:
    """A bounded run of consecutive raw records from one file.

    ``items`` holds raw lines (bytes) for jsonl, decoded documents (str) for plain text, or a
    ``pyarrow.RecordBatch`` for parquet. ``error`` is ``(reason, detail, count)`` for a parquet
    file lacking a column (every row is bad). ``read_failure`` is the one-line error of a chunk
    without items that stands for the rest of a compressed file that cannot be read (cut short,
    corrupt); ``parse_chunk`` raises it, so a ``--max-docs`` cut before it never sees it.
    """

    path: str
    kind: str  # "jsonl" | "text" | "parquet"
    first_record: int  # 1-based number of items[0] in its file, in the unit of RECORD_UNITS
    items: object
    nbytes: int  # uncompressed bytes of the raw records, for MB/s
    error: tuple[str, str, int] | None = None
    keys_seen: tuple[str, ...] = ()  # a parquet file's columns when it lacks a wanted one
    read_failure: str = ""


@dataclass
class ParsedChunk:
    """Documents accepted from a chunk: per json key, in key order, a text or (as Megatron-LM
    takes it) a list of sentences, each tokenized on its own."""

    docs: list[tuple[str | list[str], ...]]
    bad: BadRecords
    filtered: int  # rows dropped by the score filter: not bad, just not wanted


@dataclass(frozen=True)
class RecordFilter:
    """Which fields become documents, and the FineWeb-Edu quality filter."""

    keys: tuple[str, ...] = ("text",)
    min_int_score: int | None = None
    min_score: float | None = None
    # Every key a non-blank string (fields filled into a template): no list, no empty text.
    plain_texts: bool = False

    def thresholds(self) -> tuple[tuple[str, int | float | None], ...]:
        """(score key, minimum or None) for the keys of SCORE_FLAGS."""
        return ("int_score", self.min_int_score), ("score", self.min_score)

    def columns(self) -> list[str]:
        return list(self.keys) + [column for column, value in self.thresholds() if value is not None]


def input_kind(path: str | os.PathLike) -> str:
    name = str(path).lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "jsonl" if starts_with_json_object(str(path)) else "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise DataError(f"{path}: unsupported input type; expected one of {', '.join(SUPPORTED_SUFFIXES)}")


def starts_with_json_object(path: str) -> bool:
    """Whether a file's first non-blank line is a JSON object: JSON lines, whatever the file's name."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return _first_line_is_json_object(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _first_line_is_json_object(path: str, mtime_ns: int, size: int) -> bool:
    # Keyed by mtime and size too, so a file rewritten in place is looked at again.
    lines = _iter_lines(path)
    try:
        first = next((line for line in lines if isinstance(line, BaseException) or line.strip()), b"")
    finally:
        lines.close()
    if isinstance(first, BaseException) or not first.lstrip().startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def expand_inputs(inputs: str | Sequence[str], skipped: list[str] | None = None) -> list[str]:
    """Files named by paths, directories (searched recursively) and globs, sorted, each file once
    however it is spelt (``./a.jsonl`` and a glob matching ``a.jsonl``, a link to it): its
    documents would otherwise be read twice.

    Files in a directory (given, or matched by a glob) that are not of a supported type, or .json
    files that are not JSON lines, are left out and listed in ``skipped``.
    """
    specs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    files: dict[str, str] = {}  # real path -> the first spelling given
    skipped = skipped if skipped is not None else []

    def keep(paths: Sequence[str]) -> None:
        for path in paths:
            files.setdefault(os.path.realpath(path), path)

    for spec in map(str, specs):
        if os.path.isdir(spec):
            found, others = _search(spec)
            if not found:
                json_docs = any(p.lower().endswith(".json") for p in others)
                why = " (its .json files are not JSON lines)" if json_docs else ""
                raise DataError(f"{spec}: directory holds no {', '.join(SUPPORTED_SUFFIXES)} files{why}")
            keep(found)
            skipped.extend(others)
        elif os.path.isfile(spec):
            input_kind(spec)
            keep([spec])
        elif glob.has_magic(spec):
            matched = glob.glob(spec, recursive=True)
            found = [p for p in matched if os.path.isfile(p)]
            for p in found:
                input_kind(p)
            for directory in sorted(p for p in matched if os.path.isdir(p)):  # as a directory input
                inside, others = _search(directory)
                found += inside
                skipped.extend(others)
            if not found:
                raise DataError(f"{spec}: glob matches no files")
            keep(found)
        else:
            raise DataError(f"{spec}: input not found")
    skipped[:] = dict.fromkeys(skipped)  # once each, however many inputs hold one
    return sorted(files.values())


def _search(directory: str) -> tuple[list[str], list[str]]:
    """The files under ``directory`` that are read, and those left out (see ``_left_out``)."""
    found, others = [], []
    for p in sorted(Path(directory).rglob("*")):
        if p.is_file():
            (others if _left_out(str(p)) else found).append(str(p))
    return found, others


# Text files of a dataset index cache (megatron-core's descriptions of its indices, the maximum
# token ids megaloop.training.data caches): settings beside the .npy files, not documents.
_INDEX_CACHE_TEXT = re.compile(r"[0-9a-f]{32}-\w+-(train|valid|test)-description\.txt|max_token_id-.+-\d+-\d+\.txt")


def _left_out(path: str) -> str | None:
    """Why a file found in a directory input is not read (its kind, for input_notes), or None. A
    .json file whose first line is not a JSON object is a JSON document (a tokenizer.json, the
    ``.tokenizer.json`` sidecar of data preprocessed there): read, each line would be a bad record."""
    name = path.lower()
    if not name.endswith(SUPPORTED_SUFFIXES):
        return Path(path).suffix.lower() or Path(path).name
    if name.endswith(".json") and not starts_with_json_object(path):
        return ".json not JSON lines"
    return "index cache .txt" if _INDEX_CACHE_TEXT.fullmatch(os.path.basename(path)) else None


def input_notes(files: Sequence[str], skipped: Sequence[str]) -> list[str]:
    """Lines for the files a directory input left out (how many of each type, the first few), for
    .txt files read as JSON lines, and for plain text that looks like one document per line."""
    def listed(paths: Sequence[str]) -> str:
        return f"{', '.join(paths[:MAX_EXAMPLES])}{', ...' if len(paths) > MAX_EXAMPLES else ''}"

    notes = []
    if skipped:
        kinds = Counter(map(_left_out, skipped))
        counted = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        notes.append(f"skipped {len(skipped)} files of unsupported types ({counted}): {listed(skipped)}")
    jsonl_txt = [f for f in files if f.lower().endswith(TEXT_SUFFIXES) and input_kind(f) == "jsonl"]
    if jsonl_txt:
        notes.append(f"read {len(jsonl_txt)} .txt file(s) as JSON lines (the first line is a JSON object): "
                     f"{listed(jsonl_txt)}")
    one_per_line = [f for f in files if input_kind(f) == "text" and _lines_without_a_break(f)]
    if one_per_line:
        notes.append(f"{len(one_per_line)} .txt file(s) open with {LINES_WITHOUT_A_BREAK}+ lines and no blank line: "
                     "plain text is one document per blank-line separated paragraph, so one document per line "
                     f"would be read as one document (give it as JSON lines): {listed(one_per_line)}")
    return notes


LINES_WITHOUT_A_BREAK = 1000  # lines opening a plain-text file without a blank line: not paragraphs


def _lines_without_a_break(path: str) -> bool:
    lines = _iter_lines(path)
    try:
        for n, line in enumerate(lines, 1):
            if isinstance(line, BaseException) or not line.strip():
                return False
            if n >= LINES_WITHOUT_A_BREAK:
                return True
        return False
    finally:
        lines.close()


def _iter_lines(path: str) -> Iterator[bytes | BaseException]:
    """Raw lines of a (possibly compressed) file; a read failure is yielded, then the file ends."""
    try:
        with open_binary(path) as f:
            first = f.readline()
            if first.startswith(BOM):
                first = first[len(BOM):]
            if first:
                yield first
            yield from f
    except read_errors() as err:
        yield err


def _iter_paragraphs(path: str) -> Iterator[bytes | BaseException]:
    """Blank-line separated paragraphs, so a plain-text file becomes many documents, streamed."""
    para: list[bytes] = []
    for line in _iter_lines(path):
        if isinstance(line, BaseException):
            if para:
                yield b"".join(para)
            yield line
            return
        if line.strip():
            para.append(line)
        elif para:
            yield b"".join(para)
            para = []
    if para:
        yield b"".join(para)


def _raw_records(path: str) -> Iterator[bytes | BaseException]:
    return _iter_paragraphs(path) if input_kind(path) == "text" else _iter_lines(path)


def count_records(path: str) -> int:
    """Records in a file as ``iter_chunks`` numbers them (a read failure counts as one: where
    it is, ``parse_chunk`` refuses the file)."""
    if input_kind(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # an unreadable parquet file, refused when read
            return 1
    return sum(1 for _ in _raw_records(path))


def iter_chunks(
    ranges: Sequence[tuple[str, int, int | None]],
    columns: Sequence[str],
    max_records: int = 512,
    max_bytes: int = 1 << 20,
) -> Iterator[Chunk]:
    """Chunks of at most ``max_records`` records / about ``max_bytes`` bytes.

    ``ranges`` lists ``(path, start, stop)``: the records ``[start, stop)`` of each file, in order
    (``stop=None``: to the end). Skipped records are still read, which only compressed input pays.
    """
    for path, start, stop in ranges:
        if input_kind(path) == "parquet":
            yield from _parquet_chunks(path, columns, start, stop, max_records)
        else:
            yield from _line_chunks(path, start, stop, max_records, max_bytes)


def _line_chunks(path: str, start: int, stop: int | None, max_records: int, max_bytes: int) -> Iterator[Chunk]:
    kind = input_kind(path)
    items: list[bytes] = []
    nbytes = 0
    first = start + 1
    for index, record in enumerate(_raw_records(path)):
        if index < start:
            continue
        if stop is not None and index >= stop:
            break
        if isinstance(record, BaseException):
            if items:  # usable up to a --max-docs cut, which then never reaches the failure
                yield Chunk(path, kind, first, items, nbytes)
                first += len(items)
            yield Chunk(path, kind, first, [], 0, read_failure=_read_failure(path, RECORD_UNITS[kind], first, record))
            return
        items.append(record)
        nbytes += len(record)
        if len(items) >= max_records or nbytes >= max_bytes:
            yield Chunk(path, kind, first, items, nbytes)
            first += len(items)
            items, nbytes = [], 0
    if items:
        yield Chunk(path, kind, first, items, nbytes)


def _read_failure(path: str, unit: str, record: int, err: BaseException) -> str:
    """The error for a file unreadable from its ``record``-th record on: every record left in it
    would be lost, which is not one bad record (parquet's is worded alike)."""
    where = f"{unit or 'line '}{record}"
    what = (f"truncated compressed file, ends at {where}" if isinstance(err, EOFError)
            else f"unreadable data at {where} ({first_line(err)})")
    return f"{path}: {what}; replace the file (a download cut short?) or leave it out"


def first_line(err: BaseException) -> str:
    """An exception's message cut to one line (or its type name), for one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _parquet_chunks(path: str, columns: Sequence[str], start: int, stop: int | None, max_records: int) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        pf = pq.ParquetFile(path)
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            # Every row lacks the field: one bad record per row, reported at the file's first row.
            n = pf.metadata.num_rows if stop is None else min(stop, pf.metadata.num_rows)
            empty = pa.RecordBatch.from_pylist([])
            yield Chunk(path, "parquet", start + 1, empty, 0, error=("missing key", repr(missing[0]), n - start),
                        keys_seen=tuple(pf.schema_arrow.names))
            return
        # Batches, not whole row groups, bound memory: FineWeb-Edu row groups hold ~100 MB of text.
        for batch in pf.iter_batches(batch_size=max_records, columns=list(columns)):
            lo, hi = max(start - row, 0), batch.num_rows if stop is None else min(stop - row, batch.num_rows)
            if lo < hi:
                part = batch.slice(lo, hi - lo)
                yield Chunk(path, "parquet", row + lo + 1, part, _text_bytes(part))
            row += batch.num_rows
            if stop is not None and row >= stop:
                return
    except (OSError, pa.ArrowException) as err:
        # Not one bad record: every row of the file (or the rest of it) would be lost.
        where = f" from row {row + 1}" if row else ""
        raise DataError(f"{path}: unreadable parquet{where} ({first_line(err)}); replace the file "
                        "(a download cut short?) or leave it out") from None


def _text_bytes(batch) -> int:
    """UTF-8 bytes in a batch's string columns: the text size users think of, for MB/s."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def is_text(t) -> bool:
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    columns = [pc.list_flatten(c) if pa.types.is_list(c.type) and is_text(c.type.value_type) else c
               for c in batch.columns]  # a list of sentences counts as its sentences
    return sum(pc.sum(pc.binary_length(c)).as_py() or 0 for c in columns if is_text(c.type))


def parse_chunk(chunk: Chunk, record_filter: RecordFilter) -> ParsedChunk:
    """Decode, validate and filter a chunk's records into documents."""
    if chunk.read_failure:
        raise DataError(chunk.read_failure)
    bad = BadRecords()
    docs: list[tuple[str, ...]] = []
    filtered = 0
    if chunk.kind == "parquet":
        rows = chunk.items.to_pylist()
    else:
        rows = chunk.items
    for offset, raw in enumerate(rows):
        where = _record_location(chunk, offset)
        record, reason, detail = _decode_record(raw, chunk.kind, record_filter.keys)
        if record is None:
            if reason:
                bad.add(reason, where, detail)
            continue
        keep, reason, detail = _passes_filter(record, record_filter)
        if reason:
            bad.add(reason, where, detail)
            if reason == "missing key":
                bad.saw_keys(record, _lacking(record_filter, record))
            continue
        if not keep:
            filtered += 1
            continue
        texts, reason, detail = _texts(record, record_filter)
        if reason:
            bad.add(reason, where, detail)
            if reason == "missing key":
                bad.saw_keys(record, _lacking(record_filter, record))
            continue
        docs.append(texts)
    if chunk.error:
        reason, detail, count = chunk.error
        bad.add(reason, _record_location(chunk, len(rows)), detail, count)
        if reason == "missing key":
            bad.saw_keys(chunk.keys_seen, _lacking(record_filter, chunk.keys_seen))
    return ParsedChunk(docs, bad, filtered)


def _lacking(record_filter: RecordFilter, held) -> list[str]:
    """The wanted keys a record's fields (or a parquet file's columns) ``held`` lack or hold null."""
    values = held if isinstance(held, dict) else dict.fromkeys(held, True)
    return [key for key in record_filter.columns() if values.get(key) is None]


def _record_location(chunk: Chunk, offset: int) -> str:
    """``path:N`` of the record ``offset`` places after the chunk's first one."""
    return f"{chunk.path}:{RECORD_UNITS[chunk.kind]}{chunk.first_record + offset}"


def _decode_record(raw, kind: str, keys: Sequence[str]) -> tuple[dict | None, str, str]:
    if kind == "parquet":
        return raw, "", ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, "invalid UTF-8", f"byte {err.start}"
    if kind == "text":
        return {keys[0]: text.replace("\r\n", "\n").rstrip("\n")}, "", ""
    if not text.strip():
        return None, "", ""  # blank lines in jsonl separate nothing and are not records
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return None, "malformed JSON", f"{err.msg} (column {err.colno})"
    if not isinstance(record, dict):
        return None, "malformed JSON", f"expected an object, got {type(record).__name__}"
    return record, "", ""


def _passes_filter(record: dict, f: RecordFilter) -> tuple[bool, str, str]:
    for name, threshold in f.thresholds():
        if threshold is None:
            continue
        value = record.get(name)
        if value is None:
            return False, "missing key", repr(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return False, "bad score", f"{name}={value!r}"
        if value < threshold:
            return False, "", ""
    return True, "", ""


def _texts(record: dict, f: RecordFilter) -> tuple[tuple[str | list[str], ...], str, str]:
    """Each key's text or list of sentences. Empty and blank texts are kept: Megatron-LM writes an
    empty text as an empty document and tokenizes a blank one, and the output must equal its."""
    texts = []
    for key in f.keys:
        value = record.get(key)
        if value is None:
            return (), "missing key", repr(key)
        if f.plain_texts and not (isinstance(value, str) and value.strip()):
            return (), "empty or non-string text", f"{key!r} is {value!r:.40}"
        sentences = [value] if isinstance(value, str) else value
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            return (), "non-string text", f"{key!r} is {_type_name(value)}"
        if not all(map(_is_encodable, sentences)):
            return (), "invalid UTF-8", f"{key!r} holds a lone surrogate"
        texts.append(value)
    return tuple(texts), "", ""


def _type_name(value) -> str:
    if isinstance(value, list):
        return f"a list holding {', '.join(sorted({type(v).__name__ for v in value if not isinstance(v, str)}))}"
    return type(value).__name__


def _is_encodable(text: str) -> bool:
    # JSON "\ud800" escapes decode to lone surrogates, which no tokenizer can take.
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def iter_documents(
    inputs: str | Sequence[str],
    record_filter: RecordFilter = RecordFilter(),
    max_docs: int | None = None,
    bad: BadRecords | None = None,
) -> Iterator[str]:
    """Every key's text of each record, in key order, streamed in global order; bad records are
    tallied into ``bad``. ``max_docs`` counts records: the documents preprocess writes per key.

    A list of sentences comes as one text, its sentences on lines of their own.
    """
    bad = bad if bad is not None else BadRecords()
    ranges = [(p, 0, None) for p in expand_inputs(inputs)]
    emitted = 0
    for chunk in iter_chunks(ranges, record_filter.columns()):
        if max_docs is not None and emitted >= max_docs:
            return  # before parsing: a file unreadable past the cut is not an error
        parsed = parse_chunk(chunk, record_filter)
        bad.merge(parsed.bad)
        for texts in parsed.docs:
            if max_docs is not None and emitted >= max_docs:
                return
            emitted += 1
            yield from (text if isinstance(text, str) else "\n".join(text) for text in texts)
