"""tools/preprocess_data.py's refusals: bad settings, inputs and outputs are one line naming the
flag, file or value, found before any work where they can be, with nothing written."""

import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megaloop.data import preprocess as pp
from megaloop.data.readers import DataError
from tests.data.conftest import sp_args


def test_tokenizer_errors_come_before_any_work(tmp_path, run, articles_path):
    code, err = run("--input", articles_path, "--output-prefix", tmp_path / "o", "--workers", 1,
                     "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "missing.model")
    assert code == 2
    assert err.strip() == f"error: {tmp_path / 'missing.model'}: tokenizer file not found"
    assert os.listdir(tmp_path) == []


def test_missing_input_is_a_one_line_error(tmp_path, run, sp_model):
    code, err = run("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "o", "--workers", 1, *sp_args(sp_model))
    assert code == 2 and err.strip() == f"error: {tmp_path / 'nope.jsonl'}: input not found"


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


def test_workers_must_be_positive(preprocess_tool):
    with pytest.raises(SystemExit) as exc:
        preprocess_tool.main(["--input", "x", "--output-prefix", "y", "--workers", "0", "--tokenizer-type", "SentencePieceTokenizer"])
    assert exc.value.code == 2


def test_a_log_interval_below_one_is_refused(preprocess_tool, capsys):
    # Before: a ZeroDivisionError traceback at the first document, when not on a terminal.
    with pytest.raises(SystemExit) as exc:
        preprocess_tool.main(["--input", "x", "--output-prefix", "y", "--workers", "1", "--tokenizer-type",
                   "SentencePieceTokenizer", "--log-interval", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith("error: argument --log-interval: 0: must be >= 1\n")


def test_an_abbreviated_option_is_refused(preprocess_tool, capsys):
    """Before: --output-pre was taken for --output-prefix (argparse's allow_abbrev), so that
    slurm/preprocess.sh's refusal of an --output-prefix among its extra arguments let it by."""
    with pytest.raises(SystemExit) as exc:
        preprocess_tool.main(["--input", "x", "--output-prefix", "y", "--workers", "1", "--tokenizer-type",
                              "SentencePieceTokenizer", "--output-pre", "z"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: --output-pre z\n")


def test_a_json_key_given_twice_is_refused(preprocess_tool, capsys):
    # Before: both keys' writers wrote {prefix}_text_document at once, and exit 0.
    with pytest.raises(SystemExit) as exc:
        preprocess_tool.main(["--input", "x", "--output-prefix", "y", "--workers", "1", "--tokenizer-type",
                   "SentencePieceTokenizer", "--json-keys", "text", "title", "text"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith("error: --json-keys text title text: 'text' given twice\n")


def test_srun_tasks_that_are_not_mpi_ranks_are_refused(tmp_path, run, monkeypatch):
    # Before: each of `srun -n 4`'s tasks tokenized the whole input into the same output.
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    code, err = run("--input", "x", "--output-prefix", tmp_path / "o", "--workers", "1",
                    "--tokenizer-type", "SentencePieceTokenizer")
    assert (code, err) == (2, "error: srun started 4 tasks (SLURM_STEP_NUM_TASKS) that are not MPI "
                              "ranks: each would tokenize the whole input into the same output; run "
                              "one task, or mpiexec -n N as slurm/preprocess.sh does\n")
    assert os.listdir(tmp_path) == []


# Rank 1 alone does not see the input, as on a node without the filesystem.
ONLY_RANK_1_MISSES_THE_INPUT = (
    "import os, runpy, sys; from megaloop.data import readers; real = readers.expand_inputs\n"
    "def expand(inputs, skipped=None):\n"
    "    if os.environ['PMI_RANK'] == '1': raise readers.DataError(f'{inputs[0]}: input not found')\n"
    "    return real(inputs, skipped)\n"
    "readers.expand_inputs = expand; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("case", ["missing input", "missing tokenizer", "rank 1's own"])
def test_an_error_of_mpi_ranks_is_said_once(tmp_path, repo, sp_model, articles_path, case):
    """Before: every rank printed its error and called MPI_Abort; as many ranks as got there
    before the first abort said the line (2 to 4 of 4), each followed by MPICH's abort line,
    and a rank's own error did not say which rank it was."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    source, model = (tmp_path / "nope.jsonl" if case == "missing input" else articles_path,
                     tmp_path / "nope.model" if case == "missing tokenizer" else sp_model)
    driver = ["-c", ONLY_RANK_1_MISSES_THE_INPUT] if case == "rank 1's own" else []
    done = subprocess.run([mpiexec, "-n", "3", sys.executable, *driver, str(repo / "tools" / "preprocess_data.py"),
                           "--input", str(source), "--output-prefix", str(tmp_path / "out" / "o"), "--workers", "1",
                           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    said = {"missing input": f"{source}: input not found",
            "missing tokenizer": f"{model}: tokenizer file not found",
            "rank 1's own": f"rank 1: {source}: input not found"}[case]
    assert (done.returncode, done.stderr) == (2, f"error: {said}\n")
    assert os.listdir(tmp_path / "out") == []


def test_an_error_in_one_mpi_ranks_part_names_the_rank(tmp_path, repo, sp_model, articles):
    """Before: the line did not say which rank failed (its node may be the cause)."""
    import gzip
    import json

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text("".join(json.dumps(a) + "\n" for a in articles[:10]))
    whole = gzip.compress("".join(json.dumps(a) + "\n" for a in articles[10:40]).encode())
    (inputs / "b.jsonl.gz").write_bytes(whole[:len(whole) // 2])  # read by rank 1, the second half
    done = subprocess.run([mpiexec, "-n", "2", sys.executable, str(repo / "tools" / "preprocess_data.py"),
                           "--input", str(inputs), "--output-prefix", str(tmp_path / "out" / "o"), "--workers", "1",
                           *map(str, sp_args(sp_model))], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2
    [error] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith(f"error: rank 1: {inputs / 'b.jsonl.gz'}: truncated compressed file"), error
    assert os.listdir(tmp_path / "out") == []


def test_a_usage_error_under_mpiexec_is_said_once(repo):
    """Before: by every rank, usage and all."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    done = subprocess.run([mpiexec, "-n", "3", sys.executable, str(repo / "tools" / "preprocess_data.py"),
                           "--bad-flag"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2
    assert done.stderr.count("usage: ") == 1 and done.stderr.count("error: ") == 1, done.stderr


@pytest.mark.parametrize("launch", [{"RANK": "1", "WORLD_SIZE": "2"}, {}], ids=["torchrun_vars", "plain"])
def test_a_usage_error_of_one_process_is_said_whatever_torchruns_variables_say(repo, launch):
    """preprocess_data's ranks are mpiexec's (or srun's): a plain run in an environment holding
    torchrun's RANK=1 (a worker pod of a PyTorchJob, a shell inside a torchrun job) is one
    process, whose usage error no other rank says. Before: left to a "rank 0" that did not
    exist, it was printed by no process."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "RANK", "WORLD_SIZE"))}
    done = subprocess.run([sys.executable, str(repo / "tools" / "preprocess_data.py"), "--bad-flag"],
                          capture_output=True, text=True, timeout=120,
                          env={**env, **launch, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2
    assert done.stderr.count("usage: ") == 1 and done.stderr.count("error: ") == 1, done.stderr


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


@pytest.mark.parametrize("case", ["invalid lines", "json-keys typo", "parquet without the column", "no score",
                                  "empty texts", "one key's texts empty", "no records", "all filtered out"])
def test_input_without_a_usable_document_is_an_error_and_writes_nothing(tmp_path, run, sp_model, case):
    inputs, keys, extra, name = tmp_path / "in", ["text"], [], "a.jsonl"
    inputs.mkdir()
    if case == "invalid lines":
        (inputs / "a.jsonl").write_bytes(b'{"text": \nnot json\n')
        expected = ["2 malformed JSON", f"{inputs / 'a.jsonl'}:1: malformed JSON"]
    elif case == "json-keys typo":
        (inputs / "a.jsonl").write_text('{"id": 1, "text": "x"}\n{"id": 2, "text": "y"}\n')
        keys = ["txt"]
        expected = ["2 missing key", "--json-keys 'txt' but the records hold 'id', 'text'"]
    elif case == "parquet without the column":
        name = "a.parquet"
        pq.write_table(pa.Table.from_pylist([{"body": "x", "url": "u"}] * 3), inputs / name)
        expected = ["3 missing key", "--json-keys 'text' but the records hold 'body', 'url'"]
    elif case == "no score":  # plain text has no quality score: the message names that key, not --json-keys
        name = "small.txt"
        (inputs / name).write_text("one\n\ntwo\n")
        extra = ["--min-int-score", 3]
        expected = ["2 missing key", "missing key ('int_score')",
                    "; --min-int-score needs the score key 'int_score' but the records hold 'text'"]
    elif case == "empty texts":
        (inputs / "a.jsonl").write_text('{"text": ""}\n{"text": []}\n')
        expected = ["all 2 documents have empty 'text' texts"]
    elif case == "one key's texts empty":  # before: exit 0, with an output of empty documents for 'title'
        (inputs / "a.jsonl").write_text('{"text": "x", "title": ""}\n{"text": "y", "title": ""}\n')
        keys = ["text", "title"]
        expected = ["all 2 documents have empty 'title' texts"]
    elif case == "no records":
        (inputs / "a.jsonl").write_text("")
        expected = ["no records at all"]
    else:
        (inputs / "a.jsonl").write_text('{"text": "x", "int_score": 1}\n')
        extra = ["--min-int-score", 3]
        expected = ["all 1 records are below the score threshold"]
    out = tmp_path / "out"
    code, err = run("--input", inputs, "--output-prefix", out / "o", "--workers", 1, "--json-keys", *keys,
                    *extra, *sp_args(sp_model))
    assert code == 2
    # Before: "error: no usable document: ...", which named no input.
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: no usable document in {inputs / name}: ")
    assert all(e in err for e in expected), err
    assert ("--json-keys" in err) == (case in ("json-keys typo", "parquet without the column")), err
    assert os.listdir(out) == []


def test_unwritable_output_is_found_before_start_up(tmp_path, run, articles_path):
    (tmp_path / "file").write_text("not a directory")
    prefix = tmp_path / "file" / "o"
    # The tokenizer is missing too: the output is checked first, before anything loads.
    code, err = run("--input", articles_path, "--output-prefix", prefix, "--workers", 1,
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "missing.model")
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {prefix}: cannot write the output in {tmp_path / 'file'} (")


def test_an_output_prefix_naming_only_a_directory_is_refused(tmp_path, run, articles_path):
    # Before: written as out/_text_document.bin/.idx, a dataset without a name.
    code, err = run("--input", articles_path, "--output-prefix", f"{tmp_path}/out/", "--workers", 1,
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "missing.model")
    assert (code, err) == (2, f"error: --output-prefix {tmp_path}/out/: names a directory, not the start of "
                              "the outputs' names ({prefix}_{key}_document.bin/.idx); add a name, such as "
                              f"{tmp_path}/out/fwe\n")
    assert os.listdir(tmp_path) == []
    code, err = run("--input", articles_path, "--output-prefix", f"{tmp_path}/.", "--workers", 1,
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "missing.model")
    assert code == 2 and err.startswith(f"error: --output-prefix {tmp_path}/.: names a directory")


def test_temporary_files_a_killed_run_left_are_noted(tmp_path, run, sp_model):
    # Before: not a word; nothing removes them (a SIGKILL cannot be caught), and a .bin may be as
    # large as the dataset.
    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "out").mkdir()
    leftover = tmp_path / "out" / "o.shard00001-of-00002_text_document.partial-4242.bin"
    (tmp_path / "out" / "other_text_document.partial-4243.bin").write_bytes(b"another output's")
    leftover.write_bytes(b"\0" * 1000)
    code, err = run("--input", tmp_path / "a.jsonl", "--output-prefix", tmp_path / "out" / "o", "--workers", 1,
                    *sp_args(sp_model))
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("note:")] == [
        f"note: {leftover} (0.00 GB) is left from a run that was killed; remove it unless a run is writing it now"]


def test_temporary_files_a_killed_run_left_beside_a_linked_outputs_target_are_noted(tmp_path, run, sp_model):
    """A linked output is written beside the file the link names, its temporaries too, under that file's name.
    Before: they were looked for beside the prefix only, so the .bin a killed --overwrite left there, as large
    as the dataset, was never noted."""
    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n')
    shared, out = tmp_path / "shared", tmp_path / "out"
    assert run("--input", tmp_path / "a.jsonl", "--output-prefix", shared / "v", "--workers", 1,
               *sp_args(sp_model))[0] == 0
    out.mkdir()
    for suffix in (".bin", ".idx"):
        (out / f"o_text_document{suffix}").symlink_to(shared / f"v_text_document{suffix}")
    leftover = shared / "v_text_document.partial-4242.bin"
    leftover.write_bytes(b"\0" * 1000)
    (shared / "w_text_document.partial-4243.bin").write_bytes(b"another output's")
    code, err = run("--input", tmp_path / "a.jsonl", "--output-prefix", out / "o", "--workers", 1, "--overwrite",
                    *sp_args(sp_model))
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("note:")] == [
        f"note: {leftover} (0.00 GB) is left from a run that was killed; remove it unless a run is writing it now"]


def test_files_a_directory_input_leaves_out_and_txt_read_as_json_lines_are_reported(tmp_path, run, sp_model):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "hi"}\n')
    (d / "more.txt").write_text('{"text": "JSON lines under a .txt name"}\n')
    for name in ("README", "b.csv", "c.jsonl.bz2"):
        (d / name).write_text("x")
    code, err = run("--input", d, "--output-prefix", tmp_path / "o", "--workers", 1, *sp_args(sp_model))
    assert code == 0, err
    assert (f"note: skipped 3 files of unsupported types (1 .bz2, 1 .csv, 1 README): "
            f"{d / 'README'}, {d / 'b.csv'}, {d / 'c.jsonl.bz2'}") in err
    assert f"note: read 1 .txt file(s) as JSON lines (the first line is a JSON object): {d / 'more.txt'}" in err
    assert "done: 2 documents" in err


def test_an_error_about_every_input_names_up_to_three_then_the_first_and_last():
    assert pp.named_inputs(["a.jsonl", "b.jsonl", "a.jsonl"]) == "a.jsonl, b.jsonl"
    assert pp.named_inputs([f"d/{n}.jsonl" for n in range(1200)]) == "1,200 files (d/0.jsonl ... d/1199.jsonl)"


def test_outputs_an_earlier_run_left_are_refused_unless_overwrite(tmp_path, run, sp_model):
    # Before: replaced without a word (as Megatron-LM does), under the name training configs use.
    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "another"}\n{"text": "and a third"}\n')
    prefix = tmp_path / "out" / "o"
    assert run("--input", tmp_path / "a.jsonl", "--output-prefix", prefix, "--workers", 1, *sp_args(sp_model))[0] == 0
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    code, err = run("--input", tmp_path / "b.jsonl", "--output-prefix", prefix, "--workers", 1, *sp_args(sp_model))
    assert (code, err) == (2, f"error: --output-prefix {prefix}: {prefix}_text_document.bin (and 2 more of its "
                              "outputs) exist; pass --overwrite to replace them, or choose another prefix\n")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == written
    code, err = run("--input", tmp_path / "b.jsonl", "--output-prefix", prefix, "--workers", 1, "--overwrite",
                    *sp_args(sp_model))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(written)
    assert pp.read_sidecar(f"{prefix}_text_document")["documents"] == 2


def test_overwrite_through_symbolic_links_replaces_the_files_they_name(tmp_path, run, sp_model):
    """Outputs kept on shared storage and linked under the prefix: --overwrite writes the new data
    where the links point, as any other writer to them would. Before: each link was replaced by a
    file, and the shared data left as it was."""
    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "another"}\n{"text": "and a third"}\n')
    shared, out = tmp_path / "shared", tmp_path / "out"
    assert run("--input", tmp_path / "a.jsonl", "--output-prefix", shared / "o", "--workers", 1,
               *sp_args(sp_model))[0] == 0
    out.mkdir()
    names = sorted(p.name for p in shared.iterdir())
    for name in names:
        (out / name).symlink_to(shared / name)
    code, err = run("--input", tmp_path / "b.jsonl", "--output-prefix", out / "o", "--workers", 1,
                    "--overwrite", *sp_args(sp_model))
    assert code == 0, err
    assert all((out / name).is_symlink() for name in names)
    assert sorted(p.name for p in shared.iterdir()) == names  # no temporary left behind
    assert pp.read_sidecar(f"{shared}/o_text_document")["documents"] == 2
    from megaloop.data.indexed import validate_indexed

    assert validate_indexed(f"{shared}/o_text_document").num_documents == 2


class _OneRank:
    """mpi4py's COMM_WORLD as tools/preprocess_data.py uses it, for a world of one rank: its
    shard-and-merge path (run_mpi) in this process."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, value):
        return [value]

    def gather(self, value, root=0):
        return [value]

    def bcast(self, value, root=0):
        return value

    def Barrier(self):
        pass

    def Abort(self, code):
        pass


def test_an_mpi_merge_that_fails_leaves_the_output_it_replaces_whole(tmp_path, run, preprocess_tool, sp_model,
                                                                      monkeypatch):
    # Before: rank 0 removed the old sidecar before merging, so a merge that failed (a full disk, with the old
    # output, the shards and the merge on it) left the old .bin/.idx without it: its tokenizer unchecked.
    from megaloop.data.indexed import AtomicIndexedWriter

    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n')
    prefix = tmp_path / "out" / "o"
    args = ["--input", tmp_path / "a.jsonl", "--output-prefix", prefix, "--workers", 1, *sp_args(sp_model)]
    assert run(*args)[0] == 0
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    monkeypatch.setattr(preprocess_tool, "_mpi_comm", _OneRank)

    def disk_full(writer, prefix):
        raise DataError(f"{writer.temporaries[0]}: no space left on device")

    monkeypatch.setattr(AtomicIndexedWriter, "add_index", disk_full)
    code, err = run(*args, "--overwrite")
    assert code == 2 and "no space left on device" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == written
