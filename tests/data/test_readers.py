import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megaloop.data.preprocess import shard_ranges
from megaloop.data.readers import (
    BadRecords,
    DataError,
    RecordFilter,
    count_records,
    expand_inputs,
    input_kind,
    input_notes,
    iter_chunks,
    iter_documents,
    parse_chunk,
)

RECORDS = [{"id": i, "text": f"document {i}\nsecond line é", "int_score": i % 4, "score": i / 10} for i in range(40)]


def _jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _write_all_formats(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_jsonl_bytes(RECORDS))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(RECORDS)))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(RECORDS)))
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "d.parquet", row_group_size=7)
    return ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]


def _parse_all(path, record_filter=RecordFilter(), max_records=5):
    docs, bad, filtered = [], BadRecords(), 0
    for chunk in iter_chunks([(str(path), 0, None)], record_filter.columns(), max_records=max_records):
        parsed = parse_chunk(chunk, record_filter)
        docs += [d[0] for d in parsed.docs]
        bad.merge(parsed.bad)
        filtered += parsed.filtered
    return docs, bad, filtered


def test_every_format_yields_the_same_documents(tmp_path):
    expected = [r["text"] for r in RECORDS]
    for name in _write_all_formats(tmp_path):
        docs, bad, _ = _parse_all(tmp_path / name)
        assert docs == expected, name
        assert bad.total == 0
        assert count_records(str(tmp_path / name)) == len(RECORDS)


def test_plain_text_documents_are_lines_or_paragraphs(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("para one\nstill one\n\npara two\n\n\npara three\n")
    docs, _, _ = _parse_all(path)
    assert docs == ["para one\nstill one", "para two", "para three"]


def test_bad_plain_text_is_located_by_paragraph(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"fine\nstill fine\n\ncaf\xe9\n")  # the bad paragraph starts on line 4
    docs, bad, _ = _parse_all(path)
    assert docs == ["fine\nstill fine"]
    assert bad.examples == [f"{path}:paragraph 2: invalid UTF-8 (byte 3)"]


def test_score_filters_and_doc_limit(tmp_path):
    _write_all_formats(tmp_path)
    for name in ("a.jsonl", "d.parquet"):
        docs, _, filtered = _parse_all(tmp_path / name, RecordFilter(min_int_score=3))
        assert docs == [r["text"] for r in RECORDS if r["int_score"] >= 3]
        assert filtered == len(RECORDS) - len(docs)
        docs, _, _ = _parse_all(tmp_path / name, RecordFilter(min_score=2.5))
        assert docs == [r["text"] for r in RECORDS if r["score"] >= 2.5]
    limited = list(iter_documents(str(tmp_path / "d.parquet"), RecordFilter(min_int_score=2), max_docs=3))
    assert limited == [r["text"] for r in RECORDS if r["int_score"] >= 2][:3]


def test_bad_records_are_counted_and_located(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        b'{"text": "good one"}',
        b'{"text": "broken',  # malformed JSON
        b'{"title": "no text", "id": 3}',  # missing key
        b'{"text": "   "}',  # blank: a document (Megatron-LM tokenizes it)
        b'{"text": "caf\xe9"}',  # invalid UTF-8 (latin-1 byte)
        b'{"text": 42}',  # not a string
        b'{"text": "\\ud800 lone surrogate"}',
        b"",  # blank line: not a record
        b'{"text": ["sentence", 7]}',  # a list of sentences holding a non-string
        b'{"text": "good two"}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    docs, bad, _ = _parse_all(path, max_records=3)
    assert docs == ["good one", "   ", "good two"]
    assert bad.counts == {"malformed JSON": 1, "missing key": 1, "invalid UTF-8": 2, "non-string text": 2}
    assert bad.examples == [
        f"{path}:2: malformed JSON (Invalid control character at (column 17))",
        f"{path}:3: missing key ('text')",
        f"{path}:5: invalid UTF-8 (byte 13)",
        f"{path}:6: non-string text ('text' is int)",
        f"{path}:7: invalid UTF-8 ('text' holds a lone surrogate)",
    ]
    assert bad.keys_seen == ["title", "id"]  # what a --json-keys typo gets told


def test_text_may_be_a_list_of_sentences_and_empty_texts_are_documents(tmp_path):
    # Megatron-LM tokenizes each sentence of a list, and writes an empty text as an empty document.
    path = tmp_path / "s.jsonl"
    records = [{"text": ["One.", "", "Two."]}, {"text": ""}, {"text": []}, {"text": "plain"}]
    path.write_bytes(_jsonl_bytes(records))
    assert _parse_all(path)[0] == [["One.", "", "Two."], "", [], "plain"]
    assert list(iter_documents(str(path))) == ["One.\n\nTwo.", "", "", "plain"]
    table = tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": ["é", "b"]}, {"text": []}]), table)
    chunk = next(iter_chunks([(str(table), 0, None)], ["text"]))
    assert parse_chunk(chunk, RecordFilter()).docs == [(["é", "b"],), ([],)]
    assert chunk.nbytes == 3  # the sentences' UTF-8 bytes


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_truncated_compressed_file_is_an_error_naming_it_where_it_ends(tmp_path, suffix):
    # Before: one bad record ("truncated compressed file"), every record after it lost, exit 0.
    compress = gzip.compress if suffix.endswith(".gz") else zstandard.ZstdCompressor().compress
    rng = random.Random(0)  # text that compresses little, so half the file holds whole zstd blocks
    records = [{"text": " ".join(str(rng.random()) for _ in range(20))} for _ in range(2000)]
    data = compress(_jsonl_bytes(records))
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: len(data) // 2])
    chunks = list(iter_chunks([(str(path), 0, None)], ["text"], max_records=1000))
    docs = [d[0] for chunk in chunks[:-1] for d in parse_chunk(chunk, RecordFilter()).docs]
    assert 0 < len(docs) < len(records)
    assert docs == [r["text"] for r in records[: len(docs)]]
    with pytest.raises(DataError) as err:
        parse_chunk(chunks[-1], RecordFilter())
    assert str(err.value) == (f"{path}: truncated compressed file, ends at line {len(docs) + 1}; replace the "
                              "file (a download cut short?) or leave it out")
    # A --max-docs cut before the end reads no further: the documents it wants are whole.
    assert list(iter_documents(str(path), max_docs=len(docs))) == docs


def test_a_malformed_line_in_an_intact_compressed_file_is_one_bad_record(tmp_path):
    path = tmp_path / "ok.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": \n{"text": "b"}\n'))
    docs, bad, _ = _parse_all(path)
    assert docs == ["a", "b"] and bad.counts == {"malformed JSON": 1}


def test_an_unreadable_parquet_file_is_an_error_naming_it(tmp_path):
    # Before: "1 bad record (unreadable data)" and exit 0, every row of the file lost.
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    path.write_bytes(path.read_bytes()[:-100])  # a download cut short: no footer
    with pytest.raises(DataError) as err:
        list(iter_chunks([(str(path), 0, None)], ["text"]))
    assert str(err.value) == (f"{path}: unreadable parquet (Parquet magic bytes not found in footer. "
                              "Either the file is corrupted or this is not a parquet file.); replace the "
                              "file (a download cut short?) or leave it out")


def test_every_frame_of_a_multi_frame_zstd_file_is_read(tmp_path):
    compress = zstandard.ZstdCompressor().compress
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(compress(_jsonl_bytes(RECORDS[:25])) + compress(_jsonl_bytes(RECORDS[25:])))
    docs, bad, _ = _parse_all(path)
    assert docs == [r["text"] for r in RECORDS] and bad.total == 0


def test_bom_crlf_and_json_lines_named_txt_read_as_a_user_expects(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "bom.jsonl").write_bytes(bom + _jsonl_bytes(RECORDS[:2]))
    assert _parse_all(tmp_path / "bom.jsonl")[0] == [r["text"] for r in RECORDS[:2]]
    (tmp_path / "notes.txt").write_bytes(bom + b"first line\r\nsecond\r\n\r\nnext paragraph\r\n")
    assert input_kind(tmp_path / "notes.txt") == "text"
    assert _parse_all(tmp_path / "notes.txt")[0] == ["first line\nsecond", "next paragraph"]
    (tmp_path / "data.txt").write_bytes(b"\n" + _jsonl_bytes(RECORDS[:3]))  # JSONL under a .txt name
    (tmp_path / "data.txt.gz").write_bytes(gzip.compress(_jsonl_bytes(RECORDS[:3])))
    for name in ("data.txt", "data.txt.gz"):
        assert input_kind(tmp_path / name) == "jsonl"
        assert _parse_all(tmp_path / name)[0] == [r["text"] for r in RECORDS[:3]]
    (tmp_path / "brace.txt").write_bytes(b"{not json} but prose\n")
    assert input_kind(tmp_path / "brace.txt") == "text"


def test_parquet_without_the_text_column_counts_every_row(tmp_path):
    path = tmp_path / "notext.parquet"
    pq.write_table(pa.Table.from_pylist([{"body": "x", "url": "u"}] * 9), path)
    docs, bad, _ = _parse_all(path)
    assert docs == [] and bad.counts == {"missing key": 9}
    assert bad.examples == [f"{path}:row 1: missing key ('text')"]
    assert bad.keys_seen == ["body", "url"]


def test_expand_inputs_directories_globs_and_errors(tmp_path):
    names = _write_all_formats(tmp_path)
    (tmp_path / "notes.md").write_text("ignored")
    skipped = []
    assert expand_inputs(str(tmp_path), skipped) == sorted(str(tmp_path / n) for n in names)
    assert skipped == [str(tmp_path / "notes.md")]
    assert input_notes([], skipped) == [f"skipped 1 files of unsupported types (1 .md): {tmp_path / 'notes.md'}"]
    assert expand_inputs(str(tmp_path / "*.jsonl*")) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz"), str(tmp_path / "c.jsonl.zst")]
    with pytest.raises(DataError, match="missing.jsonl: input not found"):
        expand_inputs(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"\*.parquet2: glob matches no files"):
        expand_inputs(str(tmp_path / "*.parquet2"))
    with pytest.raises(DataError, match="notes.md: unsupported input type"):
        expand_inputs(str(tmp_path / "notes.md"))


def test_a_directory_input_leaves_out_json_documents_that_are_not_json_lines(tmp_path):
    # Before: read as JSON lines, each line of a pretty-printed .json a bad record (the sidecar
    # of data preprocessed into the input directory gave 11 "malformed JSON" warnings).
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.json").write_text('\n{"text": "y"}\n')  # JSON lines after a blank line
    (tmp_path / "out_text_document.tokenizer.json").write_text('{\n "eod_id": 2\n}\n')
    skipped = []
    assert expand_inputs(str(tmp_path), skipped) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.json")]
    assert input_notes([], skipped) == [f"skipped 1 files of unsupported types (1 .json not JSON "
                                        f"lines): {tmp_path / 'out_text_document.tokenizer.json'}"]
    for name in ("a.jsonl", "b.json"):
        (tmp_path / name).unlink()
    with pytest.raises(DataError, match=r"files \(its .json files are not JSON lines\)$"):
        expand_inputs(str(tmp_path))


def test_a_directory_input_leaves_out_the_text_files_of_a_dataset_index_cache(tmp_path):
    # Before: tokenized as documents (a preprocess of a directory holding the cache/ beside its
    # data wrote 5 such documents beside the 5 it was given).
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    cache = tmp_path / "cache"
    cache.mkdir()
    names = ["0123456789abcdef0123456789abcdef-FingerprintedGPTDataset-train-description.txt",
             "fedcba9876543210fedcba9876543210-BlendedDataset-valid-description.txt",
             "max_token_id-pat.bin-32536-1796256881978194547.txt"]
    for name in names:
        (cache / name).write_text('{\n "split": "98,2"\n}\n' if "description" in name else "119\n")
    (cache / "notes-description.txt").write_text("a document of its own\n")
    skipped = []
    assert expand_inputs(str(tmp_path), skipped) == [str(tmp_path / "a.jsonl"), str(cache / "notes-description.txt")]
    assert skipped == [str(cache / name) for name in sorted(names)]
    assert input_notes([], skipped)[0].startswith("skipped 3 files of unsupported types (3 index cache .txt): ")


def test_directories_a_glob_matches_are_searched_as_directory_inputs(tmp_path):
    # Before: "glob matches no files", though unquoted the shell's expansion was taken.
    for shard in ("CC-1", "CC-2"):
        (tmp_path / shard).mkdir()
        (tmp_path / shard / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "CC-2" / "notes.md").write_text("left out")
    skipped = []
    assert expand_inputs(str(tmp_path / "CC-*"), skipped) == [str(tmp_path / "CC-1" / "a.jsonl"),
                                                             str(tmp_path / "CC-2" / "a.jsonl")]
    assert skipped == [str(tmp_path / "CC-2" / "notes.md")]
    skipped = []
    assert expand_inputs([str(tmp_path / "CC-*"), str(tmp_path)], skipped) == expand_inputs(str(tmp_path))
    assert skipped == [str(tmp_path / "CC-2" / "notes.md")]  # once, however many inputs hold it
    (tmp_path / "CC-3").mkdir()
    with pytest.raises(DataError, match=r"CC-3\*: glob matches no files"):
        expand_inputs(str(tmp_path / "CC-3*"))


def test_plain_text_of_one_document_per_line_is_noted(tmp_path):
    # Before: read as one document without a word (3,000 lines, 794 KB in the repro).
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"document {i}\n" for i in range(1000)))
    paragraphs = tmp_path / "paragraphs.txt"
    paragraphs.write_text("".join(f"document {i}\n\n" for i in range(1000)))
    assert len(list(iter_documents(str(lines)))) == 1 and len(list(iter_documents(str(paragraphs)))) == 1000
    assert input_notes([str(lines), str(paragraphs)], []) == [
        f"1 .txt file(s) open with 1000+ lines and no blank line: plain text is one document per blank-line "
        f"separated paragraph, so one document per line would be read as one document (give it as JSON "
        f"lines): {lines}"]


def test_a_file_named_twice_is_read_once_however_it_is_spelt(tmp_path, monkeypatch):
    # Before: "./a.jsonl" beside a glob matching "a.jsonl" (or a link to it) read it twice.
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "a.jsonl")
    monkeypatch.chdir(tmp_path)
    assert expand_inputs(["./a.jsonl", "*.jsonl", str(tmp_path / "b.jsonl")]) == [
        "./a.jsonl", "b.jsonl"]


def test_shards_partition_the_global_order(tmp_path):
    counts = [("a", 5), ("b", 0), ("c", 12), ("d", 3)]
    for world in (1, 2, 3, 7):
        covered = []
        for rank in range(world):
            for path, start, stop in shard_ranges(counts, world, rank):
                covered += [(path, i) for i in range(start, stop)]
        assert covered == [(p, i) for p, n in counts for i in range(n)]


def test_iter_documents_yields_every_key_of_a_record_and_max_docs_counts_records(tmp_path):
    # Before: only the first key's texts; train_tokenizer read the input once per key for the rest.
    path = tmp_path / "qa.jsonl"
    path.write_bytes(_jsonl_bytes([{"q": f"q{i}", "a": f"a{i}"} for i in range(4)] + [{"q": "no answer"}]))
    bad = BadRecords()
    assert list(iter_documents(str(path), RecordFilter(("q", "a")), max_docs=2)) == ["q0", "a0", "q1", "a1"]
    assert list(iter_documents(str(path), RecordFilter(("q", "a")), bad=bad))[-2:] == ["q3", "a3"]
    assert bad.counts == {"missing key": 1}  # as preprocess_data.py skips it
