"""The quickstart (README.md, docs/quickstart.md), shrunk: task corpus, tokenizer, indexed data,
four models, tables."""

import dataclasses
import json
import logging
import os
import signal
import socket

import pytest

from megaloop.data.tokenizer import SentencePieceTextTokenizer
from megaloop.quickstart import (EVAL_HOPS, REPLACED, RUNS, STAGING, TEST_DEPTHS, StagedOutput, main,
                                 print_task_table)
from megaloop.training.run_dir import LOCK_FILE, RunLock

SMALL = ["--steps", "1", "--eval-per-hop", "2", "--models", "dense4", "--documents", "60"]


def outputs(out):
    """Every file under ``out`` with its bytes, but the locks (each run notes itself in them)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def test_quickstart_runs_end_to_end(mcore, tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "2", "--documents", "100",
                 "--eval-per-hop", "4"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == list(RUNS)
    assert {name: r["depth"] for name, r in results.items()} == {
        "dense8": 8, "dense4": 4, "fullloop": 8, "asymloop": 8}
    hops = [str(h) for h in EVAL_HOPS]
    for name, r in results.items():
        assert list(r["accuracy"]["hops"]) == hops and 0 <= r["accuracy"]["all"] <= 1
        assert r["val_loss"] > 0 and r["params"] > 0
    for name in ("fullloop", "asymloop"):
        by_depth = results[name]["accuracy_by_depth"]
        assert list(by_depth) == [str(k) for k in TEST_DEPTHS]
        trained = str(RUNS[name]["iterations"])
        assert by_depth[trained] == results[name]["accuracy"]
    assert results["asymloop"]["depth_at"] == {"1": 4, "2": 6, "3": 8, "4": 10, "5": 12, "6": 14}
    assert "accuracy_by_depth" not in results["dense8"]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    tokenizer = SentencePieceTextTokenizer(tmp_path / "data" / "tokenizer.model")
    assert len(tokenizer.encode_batch(["g=d;c=a;?e="])[0]) == 4  # space, 2 bindings, query
    table = capsys.readouterr().out
    assert "5-hop" in table and "matched" in table and "2+2x3" in table
    assert "answer accuracy at test-time depth" in table


def test_without_a_looped_model_no_empty_test_time_depth_table_is_printed(capsys):
    # Before: --models dense8 printed the depth table's title and header with no row under them.
    hops = EVAL_HOPS
    accuracy = {"all": 0.5, "hops": {h: 0.5 for h in hops}}
    print_task_table({"dense8": {"layers": 8, "depth": 8, "params": 4.7e5, "matched": "compute",
                                 "val_loss": 2.2, "tokens_per_s": 9000.0, "accuracy": accuracy}}, hops)
    table = capsys.readouterr().out
    assert table.count("\n") == 2 and table.startswith("model") and "dense8" in table


def test_a_rerun_replaces_the_previous_quickstart_and_a_foreign_directory_is_left_alone(
        mcore, tmp_path, capsys):
    argv = ["--out", str(tmp_path / "qs"), "--steps", "1", "--eval-per-hop", "2",
            "--models", "dense4"]
    assert main(argv + ["--documents", "60"]) == 0
    first = (tmp_path / "qs" / "data" / "multi_hop.jsonl").read_text()
    assert main(argv + ["--documents", "80", "--steps", "2"]) == 0
    assert "previous quickstart in" in capsys.readouterr().out
    assert (tmp_path / "qs" / "data" / "multi_hop.jsonl").read_text() != first
    assert json.loads((tmp_path / "qs" / "results.json").read_text())["dense4"]["step"] == 2
    # A rerun that fails on a missing input leaves the previous quickstart in place.
    assert main(["--out", str(tmp_path / "qs"), "--steps", "1", "--models", "dense4",
                 "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert (tmp_path / "qs" / "results.json").is_file()
    own = tmp_path / "own"
    own.mkdir()
    (own / "notes.txt").write_text("mine")
    assert main(["--out", str(own), "--steps", "1", "--models", "dense4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --out {own}: holds notes.txt, which the quickstart did not write; "
                   "choose an empty or new directory")
    assert sorted(p.name for p in own.iterdir()) == ["notes.txt"]


def test_a_rerun_that_fails_late_or_is_stopped_leaves_the_previous_quickstart_as_it_was(
        mcore, tmp_path, monkeypatch, capsys):
    import megaloop.quickstart as quickstart
    import megaloop.training.trainer as trainer_module

    out = tmp_path / "qs"
    argv = ["--out", str(out), *SMALL]
    assert main(argv) == 0
    before = outputs(out)
    handlers = {s: signal.getsignal(s) for s in quickstart.STOP_SIGNALS}
    # A .txt file is one document: the tokenizer and dataset are built, then refused as too small
    # to hold a validation split.
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("\n".join(f"line {i} of a single document" for i in range(300)))
    assert main(["--out", str(out), "--steps", "1", "--models", "dense4", "--input",
                 str(tiny)]) == 2
    assert "needs at least 20" in capsys.readouterr().err
    assert outputs(out) == before

    prepare_data = quickstart.prepare_data

    def prepare_then_terminate(*args):  # outside training SIGTERM's default ends the process
        prepared = prepare_data(*args)
        os.kill(os.getpid(), signal.SIGTERM)
        return prepared

    with monkeypatch.context() as patch:
        patch.setattr(quickstart, "prepare_data", prepare_then_terminate)
        assert main(argv) == 128 + signal.SIGTERM
    assert "stopped by signal 15" in capsys.readouterr().err
    assert outputs(out) == before

    train_step = trainer_module.Trainer.train_step

    def interrupt_then_step(self, data):  # Ctrl-C in the middle of training
        os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, data)

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module.Trainer, "train_step", interrupt_then_step)
        assert main(argv) == 128 + signal.SIGINT
    assert f"--out {out} is left as it was" in capsys.readouterr().err
    assert outputs(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK_FILE, "data", "dense4",
                                                            "curves.png", "results.json"])
    assert {s: signal.getsignal(s) for s in quickstart.STOP_SIGNALS} == handlers


def test_a_killed_runs_leftovers_are_removed_but_a_running_quickstart_is_refused(
        mcore, tmp_path, capsys):
    out = tmp_path / "qs"
    staged_checkpoint = out / STAGING / "dense4" / "checkpoints" / "iter_0000001.tmp"
    staged_checkpoint.mkdir(parents=True)  # what kill -9 leaves in the middle of a save
    (out / REPLACED / "dense8").mkdir(parents=True)  # ... or while moving the new one in
    (out / "results.json").write_text("{}")
    running = RunLock(out, "--out")
    try:
        assert main(["--out", str(out), *SMALL]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out={str(out)!r}: in use by another run (pid ")
        assert staged_checkpoint.is_dir()  # another quickstart's staging is not touched
    finally:
        running.release()
    assert main(["--out", str(out), *SMALL]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK_FILE, "data", "dense4",
                                                            "curves.png", "results.json"])
    assert list(json.loads((out / "results.json").read_text())) == ["dense4"]


def write_fake_quickstart(root, tag: str, runs: list[str]) -> None:
    """The outputs' shape (a data directory, run directories holding a checkpoint's config.yaml,
    the results), each file saying which quickstart it belongs to."""
    (root / "data" / "cache").mkdir(parents=True)
    (root / "data" / "cache" / "index.npy").write_text(tag)
    (root / "data" / "corpus.bin").write_text(tag)
    for run in runs:
        checkpoint = root / run / "checkpoints" / "iter_0000001"
        checkpoint.mkdir(parents=True)
        (checkpoint / "config.yaml").write_text(f"tag: {tag}\n")
        (root / run / "metrics.jsonl").write_text(tag)
    (root / "results.json").write_text(tag)


def test_a_kill_or_error_between_any_two_renames_of_the_final_move_leaves_one_quickstart_whole(
        tmp_path, monkeypatch):
    """The move into --out cut short at each rename: by kill -9 (simulated: the n-th rename
    raises and the lock is dropped without clean-up; then the next run), or by an error (the run's
    own clean-up). --out then holds the previous quickstart or the new one, whole, and nothing
    else."""
    import yaml

    def interrupted_install(out, renames_before_stop):
        """The StagedOutput, its install stopped before rename ``renames_before_stop``; the
        number of renames made."""
        write_fake_quickstart(out, "old", ["dense8", "dense4"])
        staged = StagedOutput(out)
        assert staged.claim() is None
        write_fake_quickstart(staged.path, "new", ["dense4", "asymloop"])
        renames = []

        def replace_or_stop(source, target):
            if len(renames) == renames_before_stop:
                raise KeyboardInterrupt
            renames.append(source)
            os_replace(source, target)

        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", replace_or_stop)
            try:
                staged.install()
            except KeyboardInterrupt:
                pass
        return staged, len(renames)

    os_replace = os.replace
    old, new = tmp_path / "old", tmp_path / "new"
    write_fake_quickstart(old, "old", ["dense8", "dense4"])
    write_fake_quickstart(new, "new", ["dense4", "asymloop"])
    for path in new.rglob("config.yaml"):  # as install rewrites them
        path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()), sort_keys=False))
    (new / "data" / "cache" / "index.npy").unlink()
    (new / "data" / "cache").rmdir()
    whole = {"old": outputs(old), "new": outputs(new)}
    staged, total = interrupted_install(tmp_path / "uninterrupted", None)
    staged.close()
    assert outputs(tmp_path / "uninterrupted") == whole["new"]
    for killed in (True, False):
        seen = []
        for n in range(total):
            out = tmp_path / f"{'killed' if killed else 'failed'}-after-{n}"
            staged, _ = interrupted_install(out, n)
            if killed:
                staged._lock.release()  # the kernel drops a dead process's lock
                staged = StagedOutput(out)  # the next run
                assert staged.claim() is None
            staged.close()
            found = outputs(out)
            whole_one = [name for name, files in whole.items() if files == found]
            assert whole_one, f"stopped after {n} renames, --out is left with {sorted(found)}"
            seen += whole_one
            assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [LOCK_FILE]
        assert seen == ["old"] * seen.count("old") + ["new"] * seen.count("new")
        assert seen.count("old") > 3 and seen.count("new") > 3, seen


def test_a_model_directory_a_training_run_is_using_is_not_replaced(tmp_path):
    """A resume of a quickstart model in --out (megaloop-train train.out_dir=<out>/dense4) holds
    its run lock: a quickstart started meanwhile would have moved its directory away and deleted
    it under the running training."""
    out = tmp_path / "qs"
    write_fake_quickstart(out, "old", ["dense4"])
    before = outputs(out)
    for directory in (out / "dense4", out / "dense4" / "checkpoints"):
        training = RunLock(directory, "train.out_dir")
        staged = StagedOutput(out)
        try:
            assert staged.claim() == (f"--out={str(directory)!r}: in use by another run (pid "
                                      f"{os.getpid()} on {socket.gethostname()} since "
                                      f"{training_since(directory)}); wait for it to end or "
                                      "choose another directory")
        finally:
            staged.close()
            training.release(remove_created=True)
        assert outputs(out) == before and not (out / STAGING).exists()
    staged = StagedOutput(out)
    assert staged.claim() is None
    write_fake_quickstart(staged.path, "new", ["dense4"])
    staged.install()
    staged.close()
    assert (out / "dense4" / "metrics.jsonl").read_text() == "new"
    assert [p.parent for p in out.rglob(LOCK_FILE)] == [out], "the lock files it made are gone"


def training_since(directory) -> str:
    return (directory / LOCK_FILE).read_text().split(" since ")[1].strip()


def test_a_quickstart_model_loads_resumes_and_exports_from_where_it_ends_up(mcore, tmp_path,
                                                                            caplog):
    """The models are trained in the staging directory; the run configs saved with their
    checkpoints must name the files where they end up, and a resume finds its data unchanged."""
    from megaloop.api import load
    from megaloop.config import load_yaml
    from megaloop.hf.to_hf import export_checkpoint
    from megaloop.training.trainer import Trainer

    out = tmp_path / "qs"
    assert main(["--out", str(out), *SMALL]) == 0
    assert not (out / STAGING).exists()
    checkpoints = out / "dense4" / "checkpoints"
    cfg = load_yaml(checkpoints / "iter_0000001" / "config.yaml")
    data = out / "data"
    assert (cfg.train.out_dir, cfg.data.path, cfg.data.tokenizer_model, cfg.data.cache_dir) == (
        str(out / "dense4"), [str(data / "corpus_text_document")], str(data / "tokenizer.model"),
        str(data / "cache"))
    assert load(checkpoints).cfg.num_layers == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        trainer = Trainer(dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, train_steps=2),
            checkpoint=dataclasses.replace(cfg.checkpoint, resume=True)))
    assert trainer.step == 1  # resumed from the quickstart's checkpoint
    # Before: the staged data "is gone" and the installed "is new", samples said to differ.
    assert [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"resume: {out}")] == []
    assert trainer.train()["step"] == 2 and (checkpoints / "iter_0000002").is_dir()
    # Megatron-core's index cache is keyed by the dataset's path: only the final one's is there.
    described = [json.loads(p.read_text())["dataset_path"]
                 for p in (data / "cache").glob("*-description.txt")]
    assert described and set(described) == {str(data / "corpus_text_document")}
    report = export_checkpoint(checkpoints, tmp_path / "hf")
    assert report["tokenizer"] == str(data / "tokenizer.model")


def test_quickstart_on_own_data_reports_cross_entropy(mcore, tmp_path, capsys):
    corpus = tmp_path / "own.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i} of the user's corpus, word "
                                                     f"{i * 7 % 13}"}) for i in range(300)))
    out = tmp_path / "out"
    assert main(["--input", str(corpus), "--out", str(out), "--steps", "2",
                 "--models", "fullloop"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["fullloop"] and "accuracy" not in results["fullloop"]
    assert "val_loss_k6" in results["fullloop"]
    table = capsys.readouterr().out
    assert "K=6" in table and "hop" not in table
    # Before: tokens over the wall time of set-up, training and evaluation (several times less).
    steps = [json.loads(line) for line in (out / "fullloop" / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(r["step_time_s"] for r in steps if r["kind"] == "train")
    assert results["fullloop"]["tokens_per_s"] == pytest.approx(2 * 16 * 64 / seconds)
    assert "tok/s over the training steps alone" in table


def test_own_data_too_small_to_validate_on_is_one_line(mcore, tmp_path, capsys):
    text = tmp_path / "own.txt"  # a .txt file is one document: nothing left for validation
    text.write_text("\n".join(f"line {i} of a single document" for i in range(300)))
    assert main(["--input", str(text), "--out", str(tmp_path / "out"), "--steps", "2",
                 "--models", "dense4"]) == 2
    err = capsys.readouterr().err.strip()
    # Before: "...: split '95,5,0' gives the valid split 0 of its 1 documents and no tokens, ...;
    # use more data or a split such as '100,0,0'", a setting the quickstart has no option for.
    assert err == (f"error: --input {text}: 1 document(s); the quickstart holds 1 in 20 out for validation "
                   "and needs at least 20: give more (a .jsonl line, a parquet row, or a blank-line "
                   "separated paragraph of a .txt is one)")
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("content", ["", '{"text": ""}\n'])
def test_an_input_without_text_is_one_line_naming_it(tmp_path, capsys, content):
    corpus = tmp_path / "own.jsonl"  # empty, or records whose texts are: both read as no text
    corpus.write_text(content)
    assert main(["--input", str(corpus), "--out", str(tmp_path / "out")]) == 2
    # Before: "error: no text to train the tokenizer on", naming neither the file nor the cause.
    assert capsys.readouterr().err.endswith(
        f"error: --input {corpus}: no text (no records, or only empty or blank texts); the "
        f"quickstart needs at least 20 documents\n")
    assert not (tmp_path / "out" / "data").exists()


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "argument --steps: 0: must be >= 1"),
    (["--eval-per-hop", "two"], "argument --eval-per-hop: 'two': not an integer"),
    (["--input", "x.txt", "--documents", "50"], "--documents applies to the generated task"),
    (["--documents", "19"], "argument --documents: 19: must be >= 20"),
    (["--input", "x.txt", "--eval-per-hop", "5"], "--eval-per-hop applies to the generated task"),
    (["--eval-per-hop", "100801"], "--eval-per-hop 100801: the generated task has 100800 "
     "distinct 1-hop programs, so at most 100800"),  # found before any search, not after one
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_stop_signal_ends_the_job_without_results(tmp_path, monkeypatch, capsys):
    import megaloop.training.trainer as trainer_module

    trained = []

    class StoppedTrainer:  # what Trainer.train returns after SIGTERM at step 7
        def __init__(self, cfg):
            trained.append(cfg.model.arch)
            self.model = None

        def train(self):
            return {"step": 7, "stopped_by_signal": signal.SIGTERM}

    monkeypatch.setattr(trainer_module, "Trainer", StoppedTrainer)
    assert main(["--out", str(tmp_path), "--documents", "20", "--eval-per-hop", "2"]) == 143
    assert trained == ["dense"]  # the job stops instead of training the next model
    assert "signal 15 while training dense8 (step 7)" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_missing_input_file_is_one_line(mcore, tmp_path, capsys):
    assert main(["--input", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "absent.jsonl" in err and "\n" not in err


@pytest.mark.parametrize("make, message", [
    ({"notes.txt": b"\x89PNG\r\n\x1a\n\x00\xff"}, "notes.txt:paragraph 1: invalid UTF-8"),
    ({"records.jsonl": b'{"body": "no text field"}\n'}, "records.jsonl:1: missing key ('text')"),
])
def test_input_the_quickstart_cannot_read_is_one_line_naming_the_file(tmp_path, capsys, make,
                                                                     message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, content in make.items():
        (corpus / name).write_bytes(content)
    assert main(["--input", str(corpus), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {corpus}/{message}") and err.count("\n") == 1, err
    assert "--input takes .jsonl records and .parquet rows with a 'text' field" in err
    assert not (tmp_path / "out").exists()


def test_a_directory_of_preprocessed_data_is_one_line(tmp_path, capsys):
    # Before: "no text to train the tokenizer on", naming no file; with the dataset cache's .txt
    # descriptions beside them, minutes of training on those. Then: the sidecar's first line,
    # "malformed JSON".
    for name, content in {"data.bin": b"\x00\x01\xff" * 50, "data.idx": b"MMIDIDX\x00\x00",
                          "data.tokenizer.json": b'{\n "eod_id": 2\n}\n'}.items():
        (tmp_path / name).write_bytes(content)
    assert main(["--input", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}: directory holds no .jsonl, .json, .jsonl.gz, .json.gz, .jsonl.zst, "
        ".json.zst, .parquet, .txt, .txt.gz, .txt.zst files (its .json files are not JSON lines)\n")
    assert not (tmp_path / "out").exists()


def test_files_of_other_types_in_an_input_directory_are_noted(tmp_path, capsys):
    from megaloop.quickstart import check_corpus

    (tmp_path / "own.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "own.bin").write_bytes(b"\x00\x01")
    check_corpus([str(tmp_path)])
    assert capsys.readouterr().err == (f"note: --input: skipped 1 files of unsupported types "
                                       f"(1 .bin): {tmp_path}/own.bin\n")


def test_more_held_out_programs_than_are_unseen_in_training_is_one_line(tmp_path, monkeypatch,
                                                                        capsys):
    from megaloop import multihop

    def too_few(seed, hops, per_hop, max_distractor_hops, exclude):  # the search's own refusal
        raise ValueError(f"hops=1: fewer than {per_hop} programs unseen in training")

    monkeypatch.setattr(multihop, "held_out_programs", too_few)
    assert main(["--out", str(tmp_path / "out"), "--documents", "20", "--eval-per-hop", "5"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --eval-per-hop 5: hops=1: fewer than 5 programs unseen in training")
    assert not (tmp_path / "out" / "results.json").exists()
