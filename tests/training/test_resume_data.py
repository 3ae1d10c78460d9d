"""A resume on training data rewritten under the same names (preprocessed again, downloaded
again) is told, one line per dataset, as a changed setting that decides the sample order is; the
same data written again is not, and a checkpoint saved before data was fingerprinted resumes."""

import logging
import shutil

import numpy
import pytest
import torch

from megaloop.config import DataConfig, RunConfig
from megaloop.training.data import data_fingerprint
from megaloop.training.resume import report_data_changes, report_sample_order
from megaloop.training.trainer import Trainer
from tests.sft import arithmetic_records, train_tokenizer, write_jsonl
from tests.training.conftest import EOD, tiny_run, write_pattern_dataset

DATA = "data/pattern"  # relative: each test writes its own data under the name the run saved


def _write_data(directory, seed=0):
    (directory / DATA).parent.mkdir()
    write_pattern_dataset(directory / DATA, seed=seed)


@pytest.fixture(scope="module")
def run_stopped_at_step_2(mcore, tmp_path_factory):
    """A 4-step run on DATA whose latest checkpoint is that of step 2, as after a crash."""
    root = tmp_path_factory.mktemp("resume_data")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        _write_data(root)
        Trainer(tiny_run(DATA, root / "run", train={"train_steps": 4},
                         checkpoint={"save_interval": 2})).train()
    shutil.rmtree(root / "run" / "checkpoints" / "iter_0000004")
    (root / "run" / "checkpoints" / "latest").write_text("iter_0000002\n")
    return root / "run"


def _renumber_tokens(prefix):
    """Every token but the EOD given another id, every length kept: the documents tokenized anew
    by a tokenizer that splits the text alike."""
    tokens = numpy.fromfile(f"{prefix}.bin", numpy.uint16)
    text = tokens != EOD
    tokens[text] = tokens[text] % 120 + 1
    tokens.tofile(f"{prefix}.bin")


def _resume(run, tmp_path, monkeypatch, caplog, seed, renumbered=False):
    """Resumes a copy of ``run`` in ``tmp_path`` on DATA written there with ``seed`` (0: the
    documents it was trained on), ``renumbered`` by _renumber_tokens; its log records from
    WARNING, and the trainer's step."""
    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path, seed)
    if renumbered:
        _renumber_tokens(tmp_path / DATA)
    shutil.copytree(run, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        trainer = Trainer(tiny_run(DATA, tmp_path / "run", train={"train_steps": 4}))
    trainer.close()
    return [r for r in caplog.records if r.levelno >= logging.WARNING], trainer.step


def test_the_same_data_written_again_resumes_without_a_word(run_stopped_at_step_2, tmp_path,
                                                            monkeypatch, caplog):
    warnings, step = _resume(run_stopped_at_step_2, tmp_path, monkeypatch, caplog, seed=0)
    assert step == 2
    assert [r.getMessage() for r in warnings] == []


def test_data_rewritten_under_its_prefix_is_one_warning_naming_it(run_stopped_at_step_2,
                                                                  tmp_path, monkeypatch, caplog):
    warnings, step = _resume(run_stopped_at_step_2, tmp_path, monkeypatch, caplog, seed=1)
    assert step == 2
    path = tmp_path / "run" / "checkpoints" / "iter_0000002"
    # Before: none (the index cache, keyed by the sequence lengths, was built anew silently).
    assert len(warnings) == 1, caplog.text
    line = warnings[0].getMessage()
    assert line.startswith(f"resume: {DATA} holds other data than when {path} was saved (")
    assert "sequence_lengths_md5 " in line and line.endswith(
        ": the samples from step 3 on are not the ones the saved run would have seen")


def test_data_tokenized_anew_with_the_same_lengths_is_one_warning(run_stopped_at_step_2,
                                                                  tmp_path, monkeypatch, caplog):
    warnings, step = _resume(run_stopped_at_step_2, tmp_path, monkeypatch, caplog, seed=0,
                             renumbered=True)
    assert step == 2
    # Before: none (documents, tokens and sequence lengths are all the same).
    assert len(warnings) == 1, caplog.text
    line = warnings[0].getMessage()
    assert line.startswith(f"resume: {DATA} holds other data than when ")
    assert "(bin_sample_md5 " in line and "sequence_lengths_md5" not in line


def _without_the_token_sample(run, directory):
    """A copy of ``run`` in ``directory`` whose checkpoint records data fingerprints as saved
    before they held bin_sample_md5."""
    shutil.copytree(run, directory)
    common_file = directory / "checkpoints" / "iter_0000002" / "common.pt"
    common = torch.load(common_file, weights_only=True)
    for fingerprint in common["trainer"]["data"].values():
        del fingerprint["bin_sample_md5"]
    torch.save(common, common_file)
    return directory


@pytest.mark.parametrize("renumbered", [False, True])
def test_a_fingerprint_without_the_token_sample_resumes_with_one_note(
        run_stopped_at_step_2, tmp_path, monkeypatch, caplog, renumbered):
    old = _without_the_token_sample(run_stopped_at_step_2, tmp_path / "old")
    warnings, step = _resume(old, tmp_path, monkeypatch, caplog, seed=0, renumbered=renumbered)
    assert step == 2 and warnings == []  # before: a warning that it held other data, unchanged
    notes = [r.getMessage() for r in caplog.records if "bin_sample_md5" in r.getMessage()]
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_0000002"
    assert notes == [f"resume: {checkpoint}'s fingerprint of its training data has no "
                     "bin_sample_md5 (saved by an older megaloop): data rewritten with the same "
                     "sequence lengths is not detected"]


def test_a_checkpoint_without_a_data_fingerprint_resumes_with_a_note(run_stopped_at_step_2,
                                                                     tmp_path, monkeypatch,
                                                                     caplog):
    old = tmp_path / "old"
    shutil.copytree(run_stopped_at_step_2, old)
    common_file = old / "checkpoints" / "iter_0000002" / "common.pt"
    common = torch.load(common_file, weights_only=True)
    del common["trainer"]["data"]  # as saved before checkpoints recorded it
    torch.save(common, common_file)
    warnings, step = _resume(old, tmp_path, monkeypatch, caplog, seed=1)
    assert step == 2 and warnings == []
    assert "records no fingerprint of its training data" in caplog.text


def test_fine_tuning_records_rewritten_or_added_are_named(tmp_path, caplog):
    records = tmp_path / "records"
    records.mkdir()
    write_jsonl(records / "a.jsonl", arithmetic_records(4))
    cfg = RunConfig(data=DataConfig(path=[str(records)], format="sft"))  # a directory of files
    saved = {"data": {"path": cfg.data.path}}
    before = data_fingerprint(cfg, None)
    write_jsonl(records / "a.jsonl", arithmetic_records(4))  # the same records written again
    assert data_fingerprint(cfg, None) == before
    write_jsonl(records / "a.jsonl", arithmetic_records(4, seed=1))
    write_jsonl(records / "b.jsonl", arithmetic_records(2))
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        report_data_changes(before, data_fingerprint(cfg, None), saved, cfg, tmp_path / "ckpt", 6)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"resume: {records / 'a.jsonl'} holds other data than when ")
    assert lines[1].startswith(f"resume: {records / 'b.jsonl'} is new since ")
    assert all("from step 7 on" in line for line in lines)


def test_data_moved_under_another_name_resumes_without_a_word_unless_it_changed(tmp_path,
                                                                              caplog):
    """As a quickstart's, whose saved configs are rewritten to name where its data ends up, while
    its checkpoints' fingerprints name the staging directory it was made in. Before: two
    warnings (staged data gone, installed data new) on every resume of a quickstart model."""
    cfg = RunConfig(data=DataConfig(path=["out/data/corpus"]))
    saved = {"data": {"path": cfg.data.path}}
    held = {"documents": 60, "tokens": 900, "sequence_lengths_md5": "a" * 32,
            "bin_sample_md5": "b" * 32}
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        report_data_changes({"out/.staging/data/corpus": held}, {"out/data/corpus": held}, saved,
                            cfg, tmp_path / "ckpt", 6)
        assert caplog.records == []
        report_data_changes({"out/.staging/data/corpus": held},
                            {"out/data/corpus": {**held, "bin_sample_md5": "c" * 32}}, saved,
                            cfg, tmp_path / "ckpt", 6)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" since ")[0] for line in lines] == [
        "resume: out/.staging/data/corpus is gone", "resume: out/data/corpus is new"]


def test_data_moved_from_an_older_checkpoints_name_resumes_with_one_note(tmp_path, caplog):
    """A quickstart model saved before fingerprints held bin_sample_md5, its data installed since:
    the data is compared on the fields both hold, and what that leaves unchecked said once, as
    for data that kept its name. Before: not a word, the rewrite it cannot see left unsaid."""
    cfg = RunConfig(data=DataConfig(path=["out/data/corpus"]))
    saved = {"data": {"path": cfg.data.path}}
    older = {"documents": 60, "tokens": 900, "sequence_lengths_md5": "a" * 32}
    checkpoint = tmp_path / "ckpt"
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        report_data_changes({"out/.staging/data/corpus": older},
                            {"out/data/corpus": {**older, "bin_sample_md5": "b" * 32}}, saved,
                            cfg, checkpoint, 6)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"resume: {checkpoint}'s fingerprint of its training data has no bin_sample_md5 "
                 "(saved by an older megaloop): data rewritten with the same sequence lengths is "
                 "not detected")]


def test_a_fine_tuning_tokenizer_trained_anew_under_its_name_is_named(tmp_path, caplog):
    """Fine-tuning records are tokenized at every start: a tokenizer rewritten in place changes
    every sample while each record file stays as it was. Before: resumed without a word."""
    records = write_jsonl(tmp_path / "a.jsonl", arithmetic_records(4))
    tokenizer = train_tokenizer(tmp_path / "tok.model", arithmetic_records(40))
    cfg = RunConfig(data=DataConfig(path=[str(records)], format="sft",
                                    tokenizer_model=str(tokenizer)))
    saved = {"data": {"path": cfg.data.path}}
    before = data_fingerprint(cfg, None)
    train_tokenizer(tokenizer, arithmetic_records(40))  # the same tokenizer made again
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        report_data_changes(before, data_fingerprint(cfg, None), saved, cfg, tmp_path / "c", 6)
        assert caplog.records == []
        train_tokenizer(tokenizer, arithmetic_records(40, seed=1)[:5])
        report_data_changes(before, data_fingerprint(cfg, None), saved, cfg, tmp_path / "c", 6)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(
            f"resume: {tokenizer} holds other data than when {tmp_path / 'c'} was saved "
            "(tokenizer_sha256 "), lines
        caplog.clear()  # a checkpoint saved before tokenizers were recorded: one note
        old = {name: entry for name, entry in before.items() if name != str(tokenizer)}
        report_data_changes(old, data_fingerprint(cfg, None), saved, cfg, tmp_path / "c", 6)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, (
        f"resume: {tmp_path / 'c'}'s fingerprint of its training data has no tokenizer_sha256 "
        "(saved by an older megaloop): a tokenizer rewritten under its name is not detected"))]


def test_the_same_blend_spelt_otherwise_is_no_change(tmp_path, monkeypatch, caplog):
    """Before: "data.path differs ...: the sample order from step 7 on is not the one the saved
    run would have seen" for data/x given as ./data/x or by its absolute path."""
    from megaloop.config import to_dict

    monkeypatch.chdir(tmp_path)
    saved = to_dict(RunConfig(data=DataConfig(path=[0.7, "data/x", 0.3, "data/y"])))
    held = {"documents": 60, "tokens": 900, "sequence_lengths_md5": "a" * 32,
            "bin_sample_md5": "b" * 32}
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        for path in (["0.7", "./data/x", "0.30", str(tmp_path / "data" / "y")],
                     [0.7, "data/x", 0.3, "data/y"]):
            cfg = RunConfig(data=DataConfig(path=path))
            report_sample_order(saved, cfg, tmp_path / "c", 6)
            report_data_changes({"data/x": held, "data/y": held},
                                {str(p): held for p in path[1::2]}, saved, cfg, tmp_path / "c", 6)
        assert caplog.records == []
        for path in ([0.5, "data/x", 0.5, "data/y"], [0.7, "data/x", 0.3, "data/z"]):
            report_sample_order(saved, RunConfig(data=DataConfig(path=path)), tmp_path / "c", 6)
    assert [r.getMessage().split(" differs")[0] for r in caplog.records] == [
        "resume: data.path", "resume: data.path"]


@pytest.mark.parametrize("rank, shown", [(0, 2), (1, 0)])
def test_the_resume_warnings_every_rank_makes_alike_are_shown_from_rank_0(monkeypatch, tmp_path,
                                                                         rank, shown):
    """Through megaloop-train's log filter (cli.log_to_stderr's), on rank ``rank``. Before: both
    lines on every rank, so a 2-rank resume on rewritten data wrote each twice (torchrun
    --nproc-per-node 2), and srun's job log of a 128-rank one, 128 times."""
    from megaloop import cli

    monkeypatch.setattr(cli, "_rank", lambda: rank)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    handler.addFilter(cli._notes_from_rank0)
    cfg = RunConfig(data=DataConfig(path=[DATA]))
    saved = {"data": {"path": [DATA]}, "train": {"seed": cfg.train.seed + 1}}
    logger = logging.getLogger("megaloop.train")
    logger.addHandler(handler)
    try:
        report_sample_order(saved, cfg, tmp_path / "ckpt", 6)
        report_data_changes({DATA: {"tokens": 1}}, {DATA: {"tokens": 2}}, saved, cfg,
                            tmp_path / "ckpt", 6)
    finally:
        logger.removeHandler(handler)
    assert len(records) == shown, [r.getMessage() for r in records]


def test_two_datasets_swapped_under_a_blend_spelt_otherwise_are_named(tmp_path, monkeypatch,
                                                                      caplog):
    """data/x and data/y hold each other's former contents, the blend given as ./data/x and
    ./data/y: the same files, so no sample-order warning; a dataset is matched to another's
    fingerprint only where it moved. Before: each was taken for the other moved, not a word."""
    from megaloop.config import to_dict

    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(data=DataConfig(path=[0.7, "./data/x", 0.3, "./data/y"]))
    saved = to_dict(RunConfig(data=DataConfig(path=[0.7, "data/x", 0.3, "data/y"])))
    x = {"documents": 60, "tokens": 900, "sequence_lengths_md5": "a" * 32,
         "bin_sample_md5": "b" * 32}
    y = {"documents": 70, "tokens": 800, "sequence_lengths_md5": "c" * 32,
         "bin_sample_md5": "d" * 32}
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        report_sample_order(saved, cfg, tmp_path / "c", 6)
        report_data_changes({"data/x": x, "data/y": y}, {"./data/x": y, "./data/y": x}, saved,
                            cfg, tmp_path / "c", 6)
    assert [r.getMessage().split(" than when ")[0] for r in caplog.records] == [
        "resume: ./data/x holds other data", "resume: ./data/y holds other data"]


def test_a_fine_tuning_tokenizer_directory_rewritten_is_named(tmp_path, caplog):
    """data.tokenizer_model may name a directory holding tokenizer.json (HuggingFaceTokenizer).
    Before: such a tokenizer was left out of the fingerprint, its rewrite resumed without a word."""
    records = write_jsonl(tmp_path / "a.jsonl", arithmetic_records(4))
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')  # bytes are all it reads
    cfg = RunConfig(data=DataConfig(path=[str(records)], format="sft",
                                    tokenizer_type="HuggingFaceTokenizer",
                                    tokenizer_model=str(directory)))
    saved = {"data": {"path": cfg.data.path}}
    before = data_fingerprint(cfg, None)
    (directory / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": []}')
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        report_data_changes(before, data_fingerprint(cfg, None), saved, cfg, tmp_path / "c", 6)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        f"resume: {directory} holds other data than when {tmp_path / 'c'} was saved "
        "(tokenizer_sha256 "), lines


def _split_warnings(saved_split, splits, data_format, tmp_path, caplog) -> list[str]:
    """report_sample_order's lines for a resume, with each of ``splits``, of a run saved with
    ``saved_split``."""
    from megaloop.config import to_dict

    def config(split):
        return RunConfig(data=DataConfig(path=[DATA], split=split, format=data_format))

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        for split in splits:
            report_sample_order(to_dict(config(saved_split)), config(split), tmp_path / "c", 6)
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("data_format", ["indexed", "sft"])
def test_the_same_split_spelt_otherwise_is_no_change(tmp_path, caplog, data_format):
    """The split's weights are normalised (megatron-core's, or the records' edges). Before:
    "data.split differs ...: the sample order from step 7 on is not the one the saved run would
    have seen" for each spelling."""
    assert _split_warnings("99,1,0", ["99,1,0", "99, 1, 0", "990,10,0", "0.99,0.01,0", "99,1",
                                      "99/1/0"], data_format, tmp_path, caplog) == []


@pytest.mark.parametrize("data_format", ["indexed", "sft"])
def test_another_split_is_named_with_both_values(tmp_path, caplog, data_format):
    """0.7 + 0.2 + 0.1 is 0.9999999999999999 in the floats the data is cut by: of 15 documents,
    "7,2,1" gives training 10, "0.7,0.2,0.1" 11, and "70,20,10" cuts as "7,2,1" does."""
    path = tmp_path / "c"
    assert _split_warnings("99,1,0", ["98,2,0"], data_format, tmp_path, caplog) == [
        f"resume: data.split differs from {path}'s (data.split '99,1,0' -> '98,2,0'): the sample "
        "order from step 7 on is not the one the saved run would have seen"]
    assert [line.split(": the sample")[0] for line in _split_warnings(
        "7,2,1", ["70,20,10", "0.7,0.2,0.1"], data_format, tmp_path, caplog)] == [
        f"resume: data.split differs from {path}'s (data.split '7,2,1' -> '0.7,0.2,0.1')"]


def test_a_setting_an_older_config_lacks_is_compared_as_its_default(tmp_path, caplog):
    """A checkpoint's config.yaml written before data.eod_mask_loss existed: it ran with the
    default. Before: "data.eod_mask_loss differs ... (data.eod_mask_loss None -> False)", a
    false warning that the sample order changed on every resume of such a checkpoint."""
    from megaloop.config import to_dict

    cfg = RunConfig(data=DataConfig(path=[DATA]))
    saved = to_dict(cfg)
    del saved["data"]["eod_mask_loss"]
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        report_sample_order(saved, cfg, tmp_path / "c", 6)
        assert caplog.records == []
        report_sample_order(saved, RunConfig(data=DataConfig(path=[DATA], eod_mask_loss=True)),
                            tmp_path / "c", 6)
    assert "(data.eod_mask_loss False -> True)" in caplog.records[0].getMessage()


def test_a_split_saved_in_a_spelling_now_refused_is_compared_as_megatron_core_cut_it(
        tmp_path, caplog):
    """A checkpoint saved before data.split refused "1e2" (megatron-core read its digits: 1,2)
    cut its data as "1,2" does. Before: resumed with "1,2", "data.split differs ... '1e2' ->
    '1,2'", the sample order said to change where it does not; another cut is still named."""
    from megaloop.config import to_dict

    saved = to_dict(RunConfig(data=DataConfig(path=[DATA], split="1,2")))
    saved["data"]["split"] = "1e2"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        for split in ("1,2", "1,2,0", "2,1"):
            report_sample_order(saved, RunConfig(data=DataConfig(path=[DATA], split=split)),
                                tmp_path / "c", 6)
    assert [r.getMessage().split(": the sample")[0] for r in caplog.records] == [
        f"resume: data.split differs from {tmp_path / 'c'}'s (data.split '1e2' -> '2,1')"]
