import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megaloop.data import preprocess as pp
from megaloop.data.readers import DataError


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("preprocess_data")


@pytest.fixture
def run(tool, capsys):
    """Run the tool in-process; returns (exit code, stderr)."""
    return lambda *args: _run(tool, capsys, *args)


def _run(tool, capsys, *args):
    code = tool.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.err


def _sp_args(sp_model, *extra):
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod", *extra]


def _read(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def _shards(tmp_path, articles):
    """The articles split over gzip, zstd, parquet and plain jsonl shards, in name order."""
    d = tmp_path / "shards"
    d.mkdir()
    parts = [articles[i:i + 10] for i in range(0, len(articles), 10)]
    for n, part in enumerate(parts):
        lines = "".join(json.dumps(a) + "\n" for a in part).encode()
        kind = n % 4
        if kind == 0:
            (d / f"{n:02d}.jsonl.gz").write_bytes(gzip.compress(lines))
        elif kind == 1:
            pq.write_table(pa.Table.from_pylist(part), d / f"{n:02d}.parquet", row_group_size=3)
        elif kind == 2:
            (d / f"{n:02d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
        else:
            (d / f"{n:02d}.jsonl").write_bytes(lines)
    return d


def test_output_matches_the_tokenizer_and_megatron_core_reads_it(tmp_path, run, sp_model, articles, articles_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megaloop.data.tokenizer import load_tokenizer

    code, err = run("--input", articles_path, "--output-prefix", tmp_path / "out", "--workers", 1, *_sp_args(sp_model))
    assert code == 0, err
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = load_tokenizer("SentencePieceTokenizer", sp_model)
    assert len(ds) == len(articles) and ds.index.dtype == numpy.uint16
    for i, article in enumerate(articles):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert tok.decode(ids[:-1]) == article["text"]
    assert f"done: {len(articles)} documents" in err


def test_bytes_do_not_depend_on_workers_or_sharding(tmp_path, run, sp_model, articles, articles_path):
    outputs = []
    for workers, source in ((1, articles_path), (2, articles_path), (2, _shards(tmp_path, articles))):
        prefix = tmp_path / f"w{workers}_{len(outputs)}"
        code, err = run("--input", source, "--output-prefix", prefix, "--workers", workers, *_sp_args(sp_model))
        assert code == 0, err
        outputs.append(_read(f"{prefix}_text_document"))
    assert outputs[0] == outputs[1] == outputs[2]


def test_mpiexec_two_ranks_matches_single_process(tmp_path, repo, sp_model, articles, tokenized_articles):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    shards = _shards(tmp_path, articles)
    cmd = [mpiexec, "-n", "2", sys.executable, str(repo / "tools" / "preprocess_data.py"), "--input", str(shards),
           "--output-prefix", str(tmp_path / "mpi"), "--workers", "1", *map(str, _sp_args(sp_model))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _read(str(tmp_path / "mpi_text_document")) == _read(tokenized_articles)
    assert sorted(os.listdir(tmp_path)) == ["mpi_text_document.bin", "mpi_text_document.idx", "shards"]
    # Each rank stops at --max-docs on its own; the merge cuts the total, and so must the report.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cut = 40  # more than rank 0's 31 documents: rank 1's first 9 complete the output
    result = subprocess.run(cmd + ["--max-docs", str(cut)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    tokens = sum(len(IndexedDataset(tokenized_articles)[i]) for i in range(cut))
    assert f"done: {cut} documents, {tokens:,} tokens" in result.stderr


def test_bad_records_are_skipped_and_reported_or_abort_with_strict(tmp_path, run, sp_model):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": \n{"text": ""}\n{"text": "also fine"}\n')
    code, err = run("--input", path, "--output-prefix", tmp_path / "o", "--workers", 1, *_sp_args(sp_model))
    assert code == 0
    assert "skipped 2 bad records (1 empty text, 1 malformed JSON)" in err
    assert f"{path}:2: malformed JSON" in err and f"{path}:3: empty text" in err
    assert "done: 2 documents" in err
    code, err = run("--input", path, "--output-prefix", tmp_path / "s", "--workers", 1, "--strict", *_sp_args(sp_model))
    assert code == 2
    assert err.startswith(f"error: {path}:2: malformed JSON")
    assert not any(n.startswith("s_") for n in os.listdir(tmp_path))


def test_truncated_gzip_shard_is_reported(tmp_path, run, sp_model, articles):
    data = gzip.compress("".join(json.dumps(a) + "\n" for a in articles[:6]).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    code, err = run("--input", path, "--output-prefix", tmp_path / "o", "--workers", 1, *_sp_args(sp_model))
    assert code == 0
    assert "truncated compressed file" in err and f"{path}:" in err


def test_tokenizer_errors_come_before_any_work(tmp_path, run, articles_path):
    code, err = run("--input", articles_path, "--output-prefix", tmp_path / "o", "--workers", 1,
                     "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "missing.model")
    assert code == 2
    assert err.strip() == f"error: {tmp_path / 'missing.model'}: tokenizer file not found"
    assert os.listdir(tmp_path) == []


def test_missing_input_is_a_one_line_error(tmp_path, run, sp_model):
    code, err = run("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "o", "--workers", 1, *_sp_args(sp_model))
    assert code == 2 and err.strip() == f"error: {tmp_path / 'nope.jsonl'}: input not found"


def test_interrupted_run_leaves_no_output(tmp_path, monkeypatch, sp_model, articles_path):
    real_iter_chunks = pp.iter_chunks

    def interrupted(*args, **kwargs):
        for n, chunk in enumerate(real_iter_chunks(*args, **kwargs)):
            if n == 2:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(pp, "iter_chunks", interrupted)
    options = pp.PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=True, workers=0, chunk_records=4)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(pp.whole_files(str(articles_path)), str(tmp_path / "o"), options)
    assert os.listdir(tmp_path) == []


def test_max_docs_keeps_a_prefix_of_the_full_output(tmp_path, sp_model, articles_path, tokenized_articles):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    options = pp.PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=True, workers=0, max_docs=7, chunk_records=3)
    stats = pp.preprocess(pp.whole_files(str(articles_path)), str(tmp_path / "o"), options)
    assert stats.docs == 7
    cut, full = IndexedDataset(str(tmp_path / "o_text_document")), IndexedDataset(tokenized_articles)
    assert len(cut) == 7
    assert all((cut[i] == full[i]).all() for i in range(7))


def test_append_eod_needs_an_eod_token(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    no_eos = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    no_eos.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    no_eos.save(str(path))
    assert pp.check_tokenizer(pp.PreprocessOptions("HuggingFaceTokenizer", str(path))).eod is None
    options = pp.PreprocessOptions("HuggingFaceTokenizer", str(path), append_eod=True)
    with pytest.raises(DataError, match=f"{path}: --append-eod given but the tokenizer has no end-of-text token"):
        pp.check_tokenizer(options)


def test_workers_must_be_positive(tool):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--input", "x", "--output-prefix", "y", "--workers", "0", "--tokenizer-type", "SentencePieceTokenizer"])
    assert exc.value.code == 2


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_fineweb_style_parquet_with_score_filter_and_limit(tmp_path, run, sp_model):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megaloop.data.tokenizer import load_tokenizer

    rows = [{"text": f"Document number {i} about education.", "int_score": i % 5, "score": i % 5 + 0.5} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "000_00000.parquet", row_group_size=4)
    code, err = run("--input", tmp_path / "*.parquet", "--output-prefix", tmp_path / "fw", "--workers", 2,
                    "--min-int-score", 3, "--max-docs", 5, *_sp_args(sp_model))
    assert code == 0, err
    ds = IndexedDataset(str(tmp_path / "fw_text_document"))
    tok = load_tokenizer("SentencePieceTokenizer", sp_model)
    kept = [r["text"] for r in rows if r["int_score"] >= 3][:5]
    assert [tok.decode(ds[i].tolist()[:-1]) for i in range(len(ds))] == kept
