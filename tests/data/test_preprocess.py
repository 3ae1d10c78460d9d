import contextlib
import errno
import gzip
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megaloop.data import preprocess as pp
from megaloop.data.readers import DataError
from tests.data.conftest import sp_args


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

    code, err = run("--input", articles_path, "--output-prefix", tmp_path / "out", "--workers", 1, *sp_args(sp_model))
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
        code, err = run("--input", source, "--output-prefix", prefix, "--workers", workers, *sp_args(sp_model))
        assert code == 0, err
        outputs.append(_read(f"{prefix}_text_document"))
    assert outputs[0] == outputs[1] == outputs[2]


def test_mpiexec_two_ranks_matches_single_process(tmp_path, repo, sp_model, articles, tokenized_articles):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    shards = _shards(tmp_path, articles)
    cmd = [mpiexec, "-n", "2", sys.executable, str(repo / "tools" / "preprocess_data.py"), "--input", str(shards),
           "--output-prefix", str(tmp_path / "mpi"), "--workers", "1", *map(str, sp_args(sp_model))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _read(str(tmp_path / "mpi_text_document")) == _read(tokenized_articles)
    assert sorted(os.listdir(tmp_path)) == ["mpi_text_document.bin", "mpi_text_document.idx",
                                            "mpi_text_document.tokenizer.json", "shards"]
    assert pp.read_sidecar(str(tmp_path / "mpi_text_document")) == pp.read_sidecar(tokenized_articles)
    # Each rank stops at --max-docs on its own; the merge cuts the total, and so must the report.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cut = 40  # more than rank 0's 31 documents: rank 1's first 9 complete the output
    result = subprocess.run(cmd + ["--max-docs", str(cut), "--overwrite"], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    tokens = sum(len(IndexedDataset(tokenized_articles)[i]) for i in range(cut))
    assert f"done: {cut} documents, {tokens:,} tokens" in result.stderr


def test_mpiexec_max_docs_checks_the_documents_kept_as_one_process_does(tmp_path, repo, run, sp_model):
    # Before: under mpiexec the check saw every rank's documents, rank 1's 'b' texts among them,
    # and exit 0 wrote 4 documents whose 'b' texts are all empty; a single process refused them.
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    path = tmp_path / "ab.jsonl"  # rank 0 reads records 1-5, rank 1 records 6-10
    path.write_text("".join(json.dumps({"a": f"text {i}", "b": "words" if i >= 6 else ""}) + "\n" for i in range(10)))
    args = ["--input", path, "--workers", 1, "--json-keys", "a", "b", "--max-docs", 4, *sp_args(sp_model)]
    message = f"error: no usable document in {path}: all 4 documents have empty 'b' texts"
    code, err = run(*args, "--output-prefix", tmp_path / "one")
    assert code == 2 and err.strip() == message
    cmd = [mpiexec, "-n", "2", sys.executable, str(repo / "tools" / "preprocess_data.py"), *map(str, args),
           "--output-prefix", str(tmp_path / "mpi")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["ab.jsonl"]


def test_bad_records_are_skipped_and_reported_or_abort_with_strict(tmp_path, run, sp_model):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": \n{"txt": "typo"}\n{"text": "also fine"}\n')
    code, err = run("--input", path, "--output-prefix", tmp_path / "o", "--workers", 1, *sp_args(sp_model))
    assert code == 0
    assert "skipped 2 bad records (1 malformed JSON, 1 missing key)" in err
    assert f"{path}:2: malformed JSON" in err and f"{path}:3: missing key ('text')" in err
    assert "done: 2 documents" in err
    code, err = run("--input", path, "--output-prefix", tmp_path / "s", "--workers", 1, "--strict", *sp_args(sp_model))
    assert code == 2
    assert err.startswith(f"error: {path}:2: malformed JSON")
    assert not any(n.startswith("s_") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_truncated_compressed_shard_is_an_error_naming_it(tmp_path, run, sp_model, articles, suffix):
    # Before: "skipped 1 bad records (1 truncated compressed file)" and exit 0, the rest of the shard lost.
    compress = gzip.compress if suffix.endswith(".gz") else zstandard.ZstdCompressor().compress
    data = compress("".join(json.dumps(a) + "\n" for a in articles[:20]).encode())  # zstd: 3 blocks
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: len(data) * 2 // 3])
    code, err = run("--input", path, "--output-prefix", tmp_path / "o", "--workers", 1, *sp_args(sp_model))
    assert code == 2
    assert re.fullmatch(f"error: {re.escape(str(path))}: truncated compressed file, ends at line [0-9]+; "
                        r"replace the file \(a download cut short\?\) or leave it out\n", err)
    assert sorted(os.listdir(tmp_path)) == [path.name]
    code, err = run("--input", path, "--output-prefix", tmp_path / "o", "--workers", 1, "--max-docs", 2,
                    *sp_args(sp_model))
    assert code == 0 and "done: 2 documents" in err  # the documents before the cut are whole


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


def test_fineweb_style_parquet_with_score_filter_and_limit(tmp_path, run, sp_model):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megaloop.data.tokenizer import load_tokenizer

    rows = [{"text": f"Document number {i} about education.", "int_score": i % 5, "score": i % 5 + 0.5} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "000_00000.parquet", row_group_size=4)
    code, err = run("--input", tmp_path / "*.parquet", "--output-prefix", tmp_path / "fw", "--workers", 2,
                    "--min-int-score", 3, "--max-docs", 5, *sp_args(sp_model))
    assert code == 0, err
    ds = IndexedDataset(str(tmp_path / "fw_text_document"))
    tok = load_tokenizer("SentencePieceTokenizer", sp_model)
    kept = [r["text"] for r in rows if r["int_score"] >= 3][:5]
    assert [tok.decode(ds[i].tolist()[:-1]) for i in range(len(ds))] == kept


def test_documents_are_megatron_lm_s_for_sentence_lists_and_empty_texts(tmp_path, run, sp_model):
    import sentencepiece
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    texts = ["Hello world.", ["First.", "", "Second."], "", "   ", ["", ""], "line\n\nmore"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    code, err = run("--input", path, "--output-prefix", tmp_path / "o", "--workers", 2, *sp_args(sp_model))
    assert code == 0, err
    # Megatron-LM's Encoder.encode: each sentence is tokenized alone and kept if it has tokens, EOD
    # joins the last one kept, and a document without tokens is written with no sequence and no EOD.
    eos = sp.eos_id()
    expected = [[sp.encode("Hello world.") + [eos]], [sp.encode("First."), sp.encode("Second.") + [eos]], [],
                [sp.encode("   ") + [eos]], [], [sp.encode("line\n\nmore") + [eos]]]
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    bounds = ds.document_indices.tolist()
    assert [[ds[i].tolist() for i in range(bounds[d], bounds[d + 1])] for d in range(len(texts))] == expected
    assert "done: 6 documents" in err
    assert "note: 2 documents have no tokens (empty texts); written as empty documents, as Megatron-LM does" in err


def test_megatron_lm_tokenizer_flags(tmp_path, run, sp_model):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "an <EOD> inside"}\n{"text": "plain"}\n')
    plain = tmp_path / "plain"
    assert run("--input", path, "--output-prefix", plain, "--workers", 1, *sp_args(sp_model))[0] == 0
    metadata = tmp_path / "tokenizer_metadata.json"
    metadata.write_text('{"library": "sentencepiece", "model_type": "gpt", "chat_template": null}')
    flags = ["--keep-newlines", "--vocab-size", 1234, "--tokenizer-metadata", metadata,
             "--partitions", 4]
    code, err = run("--input", path, "--output-prefix", tmp_path / "flags", "--workers", 1, *flags, *sp_args(sp_model))
    assert code == 0, err
    assert _read(f"{tmp_path / 'flags'}_text_document") == _read(f"{plain}_text_document")
    assert "note: --keep-newlines changes nothing: Megatron-LM applies it only with --split-sentences" in err
    assert "note: --vocab-size 1234 changes nothing: Megatron-LM uses it for TikTokenizer and NullTokenizer only" in err
    assert "note: --partitions 4 changes nothing: the input is streamed" in err  # was silent
    # --legacy-tokenizer: Megatron-LM's legacy SentencePieceTokenizer, whose EOD is an added <EOD> id.
    code, err = run("--input", path, "--output-prefix", tmp_path / "legacy", "--workers", 1, "--legacy-tokenizer",
                    "--tokenizer-metadata", metadata, *sp_args(sp_model))
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    legacy = IndexedDataset(str(tmp_path / "legacy_text_document"))
    assert code == 0 and legacy[0].tolist()[-1] == 32002 and 32002 in legacy[0].tolist()[:-1]
    assert "note: --tokenizer-metadata changes nothing with --legacy-tokenizer" in err
    # GPTSentencePieceTokenizer encodes alike in both modes: said, not silently taken (was silent).
    gpt = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod"]
    code, err = run("--input", path, "--output-prefix", tmp_path / "gpt_legacy", "--workers", 1, "--legacy-tokenizer",
                    *gpt)
    assert code == 0 and "note: --legacy-tokenizer changes nothing with GPTSentencePieceTokenizer" in err
    metadata.write_text('{"library": "huggingface"}')
    code, err = run("--input", path, "--output-prefix", tmp_path / "bad", "--workers", 1, *flags, *sp_args(sp_model))
    assert code == 2 and err.strip().startswith(f"error: {metadata}: metadata names library 'huggingface'")
    assert len(err.strip().splitlines()) == 1


def test_a_sidecar_beside_the_output_says_how_its_ids_were_made(tmp_path, run, sp_model):
    import hashlib

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "an <EOD> inside"}\n{"text": "plain"}\n')
    prefix = tmp_path / "out_text_document"
    sidecar = tmp_path / "out_text_document.tokenizer.json"
    sha256 = hashlib.sha256(sp_model.read_bytes()).hexdigest()
    for legacy, eod, vocab in ((True, 32002, 32005), (False, 2, 32000)):  # the same prefix twice
        code, err = run("--input", path, "--output-prefix", tmp_path / "out", "--workers", 1, "--overwrite",
                        *(["--legacy-tokenizer"] if legacy else []), *sp_args(sp_model))
        assert code == 0, err
        data = IndexedDataset(str(prefix))
        assert json.loads(sidecar.read_text()) == {
            "tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp_model.name,
            "tokenizer_sha256": sha256, "legacy_tokenizer": legacy, "eod_id": eod,
            "vocab_size": vocab, "append_eod": True, "documents": 2,
            "tokens": sum(len(data[i]) for i in range(len(data)))}
        assert data[0].tolist()[-1] == eod
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx",
                                            sidecar.name]
    assert f"wrote {prefix}.bin / .idx / .tokenizer.json" in err


def test_a_failed_sidecar_write_names_it_and_keeps_the_complete_data(tmp_path, sp_model, articles_path,
                                                                     monkeypatch):
    sidecar = tmp_path / "o_text_document.tokenizer.json"
    replace = os.replace

    def no_room_for_the_sidecar(src, dst):
        if os.fspath(dst) == str(sidecar):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", no_room_for_the_sidecar)
    options = pp.PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=True, workers=0,
                                   max_docs=3)
    with pytest.raises(DataError) as error:
        pp.preprocess(pp.whole_files([str(articles_path)]), str(tmp_path / "o"), options)
    assert str(error.value) == (f"{sidecar}: cannot write the tokenizer sidecar (No space left on "
                                "device); the .bin/.idx are complete without it")
    from megaloop.data import validate_indexed

    assert validate_indexed(str(tmp_path / "o_text_document")).num_documents == 3
    assert sorted(os.listdir(tmp_path)) == ["o_text_document.bin", "o_text_document.idx"]  # no temp


def test_bytes_do_not_depend_on_which_worker_finishes_first(tmp_path, monkeypatch, sp_model, articles_path,
                                                             tokenized_articles):
    from tests.data import worker_faults

    finished = tmp_path / "finished"
    monkeypatch.setenv(worker_faults.FINISHED_LOG, str(finished))
    monkeypatch.setattr(pp, "encode_chunk", worker_faults.first_chunk_finishes_last)
    options = pp.PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=True, workers=2, chunk_records=8)
    pp.preprocess(pp.whole_files(str(articles_path)), str(tmp_path / "o"), options)
    order = [int(n) for n in finished.read_text().split()]
    assert sorted(order) == list(range(1, 63, 8)) and order[0] != 1  # the first chunk finished later
    assert _read(str(tmp_path / "o_text_document")) == _read(tokenized_articles)  # tokenized in-process


@pytest.mark.timeout(180)  # the failure this guards against is a hang
def test_a_killed_worker_is_a_one_line_error_not_a_hang(tmp_path, run, monkeypatch, sp_model, articles_path):
    from tests.data import worker_faults

    monkeypatch.setattr(pp, "encode_chunk", worker_faults.killed_on_second_chunk)
    code, err = run("--input", articles_path, "--output-prefix", tmp_path / "o", "--workers", 2, *sp_args(sp_model))
    assert code == 1
    assert err.strip() == ("error: a tokenizer worker process was killed by SIGKILL: the kernel's out-of-memory "
                           "killer sends it; use fewer --workers or more memory; no output written")
    assert os.listdir(tmp_path) == []


def test_the_killed_worker_is_named_however_the_pool_reaps_it():
    # The pool's manager thread reaps the workers while the cause is read; reading them alongside it
    # once lost the SIGKILL about one time in thirty on a loaded machine and named the SIGTERM the
    # pool sends the survivors. Repeating makes that race show.
    context = multiprocessing.get_context("spawn")
    causes = set()
    for _ in range(20):
        with ProcessPoolExecutor(2, context) as executor:
            for started in [executor.submit(time.sleep, 0.05) for _ in range(2)]:
                started.result()
            with pytest.raises(BrokenProcessPool):
                executor.submit(signal.raise_signal, signal.SIGKILL).result()
            causes.add(pp._death_cause(executor))
    assert causes == {"a tokenizer worker process was killed by SIGKILL: the kernel's out-of-memory killer sends "
                      "it; use fewer --workers or more memory; no output written"}


@pytest.mark.parametrize("signum, code, message", [
    (signal.SIGTERM, 143, "terminated by SIGTERM: partial output removed"),
    (signal.SIGINT, 130, "interrupted: partial output removed"),
])
def test_a_signal_mid_run_removes_partial_output(tmp_path, repo, sp_model, articles_path, signum, code, message):
    # A worker stays busy on the second chunk, so the signal comes while the output is half written.
    # SIGUSR2 dumps every thread's stack: a run that does not stop says where it waits.
    driver = ("import faulthandler, signal; faulthandler.register(signal.SIGUSR2, all_threads=True); "
              "import runpy, sys; from megaloop.data import preprocess; from tests.data import worker_faults; "
              "preprocess.encode_chunk = worker_faults.stuck_on_second_chunk; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-c", driver, str(repo / "tools" / "preprocess_data.py"), "--input", str(articles_path),
           "--output-prefix", str(out / "o"), "--workers", "1", *map(str, sp_args(sp_model))]
    # stderr to a file, not a pipe: a worker left running after the main process had gone held the
    # pipe open, and reading the pipe to its end waited for that stuck worker (minutes per case, no
    # failure). The run has its own process group, so that what is left of it is killed at the end.
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=repo, stderr=err_file, env={**os.environ, "PYTHONPATH": str(repo)},
                                start_new_session=True)
    try:
        started = time.monotonic()
        while not any(".partial-" in name for name in os.listdir(out)):
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() - started < 120, f"no partial output in 120 s:\n{stderr.read_text()}"
            time.sleep(0.05)
        proc.send_signal(signum)
        # It kills the worker and removes its partial files: 1 to 3 s measured, with this file's
        # tests on 2 cores (-n 2) beside other jobs (load average 4); a bound 20 times that.
        stop_seconds = 60
        try:
            proc.wait(timeout=stop_seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR2)
            time.sleep(2)
            pytest.fail(f"no exit {stop_seconds} s after {signum.name}; its threads:\n{stderr.read_text()[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left: the run stopped its workers
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    err = stderr.read_text()
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == message
    assert os.listdir(out) == []


def test_failed_mpiexec_run_leaves_no_shards(tmp_path, repo, sp_model, articles):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    shards = _shards(tmp_path, articles)
    # Every rank commits its (empty) shard; rank 0 then finds no usable document in their sum.
    cmd = [mpiexec, "-n", "2", sys.executable, str(repo / "tools" / "preprocess_data.py"), "--input", str(shards),
           "--output-prefix", str(tmp_path / "mpi"), "--workers", "1", "--json-keys", "txt", *map(str, sp_args(sp_model))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2
    files = sorted(shards.iterdir())
    assert (f"error: no usable document in {len(files)} files ({files[0]} ... {files[-1]}): 62 bad records "
            "(62 missing key)") in result.stderr
    # Before: MPI_Abort ended the ranks, and under load mpiexec could end the job before it
    # forwarded rank 0's line (exit 2, nothing said).
    assert "MPI_Abort" not in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["shards"]


def test_a_rank_s_own_tokenizing_error_under_mpiexec_ends_every_rank_and_is_said(tmp_path, repo, sp_model):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text("".join(json.dumps({"text": f"fine {i}"}) + "\n" for i in range(4)))
    (inputs / "b.jsonl").write_text('{"text": "fine"}\n{"text": \n{"text": "x"}\n{"text": "y"}\n')
    # --strict: rank 1's slice (b.jsonl) holds a malformed record; rank 0's is whole.
    cmd = [mpiexec, "-n", "2", sys.executable, str(repo / "tools" / "preprocess_data.py"), "--input", str(inputs),
           "--output-prefix", str(tmp_path / "mpi"), "--workers", "1", "--strict", *map(str, sp_args(sp_model))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr
    assert f"error: rank 1: {inputs / 'b.jsonl'}:2: malformed JSON" in result.stderr
    # Before: the rank called MPI_Abort, and under load mpiexec could end the job before it
    # forwarded the rank's line.
    assert "MPI_Abort" not in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["in"]


@pytest.mark.parametrize("receiver", ["main thread", "another thread"])
def test_a_sigterm_as_an_output_file_is_created_leaves_none(tmp_path, run, sp_model, articles_path, monkeypatch,
                                                             receiver):
    # Before: a signal between the .partial file's creation and the clean-up's knowing its writer
    # (the test above hit it under load) left o_text_document.partial-<pid>.bin behind. Then, with
    # the signals blocked in the main thread only, a SIGTERM the kernel gave another thread (CI hit
    # it with pytest-xdist's I/O thread) still ran the handler there.
    from megaloop.data import indexed

    made = indexed.AtomicIndexedWriter.__init__
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()

    def made_then_signalled(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if receiver == "main thread":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            signal.pthread_kill(other.ident, signal.SIGTERM)
        time.sleep(0.2)  # time for a handler the block does not hold to run here

    monkeypatch.setattr(indexed.AtomicIndexedWriter, "__init__", made_then_signalled)
    try:
        code, err = run("--input", articles_path, "--output-prefix", tmp_path / "o", "--workers", 1,
                        *sp_args(sp_model))
    finally:
        idle.set()
    assert code == 143 and err.strip().splitlines()[-1] == "terminated by SIGTERM: partial output removed"
    assert os.listdir(tmp_path) == []
