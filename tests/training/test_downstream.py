"""Downstream evaluation during training: a row per task at each due checkpoint save, equal to what
tools' path (the saved checkpoint, exported) measures, with training losses bit-identical to a run
without it; bad settings fail before the model is built."""

import dataclasses
import json

import pytest

from megaloop.config import ConfigError, DownstreamEvalConfig
from megaloop.training.trainer import Trainer
from tests.hf.harness import EVAL_DATA, require_harness
from tests.training.conftest import tiny_run, train_losses, write_pattern_dataset

TASKS = ["piqa", "winogrande"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A SentencePiece model small enough for the tiny run's 128-token vocabulary."""
    require_harness()
    from megaloop.data.tokenizer_training import train_sentencepiece

    lines = [json.loads(line)["goal"] + "\n" for line in
             (EVAL_DATA / "piqa_valid.jsonl").read_text().splitlines()[:300]]
    path = tmp_path_factory.mktemp("tokenizer") / "tok.model"
    train_sentencepiece(lines, path, vocab_size=100, byte_fallback=False,
                        hard_vocab_limit=False)
    return str(path)


@pytest.fixture(scope="module")
def pattern_data(tmp_path_factory, tokenizer):
    """The pattern data within the tokenizer's ids (training refuses ids past them)."""
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=tokenizer).get_piece_size()
    return write_pattern_dataset(tmp_path_factory.mktemp("data") / "pattern", modulus=pieces - 1)


def _run(pattern_data, out_dir, tokenizer, downstream=None):
    # A context that holds the tasks' texts in this tokenizer's short pieces.
    cfg = tiny_run(pattern_data, out_dir, model={"seq_length": 512}, train={"train_steps": 6},
                   checkpoint={"save_interval": 3})
    cfg.data = dataclasses.replace(cfg.data, tokenizer_model=tokenizer, eod_id=None)
    if downstream is not None:
        cfg.train.downstream_eval = downstream
    return cfg


def test_rows_at_each_save_and_training_unchanged(mcore, pattern_data, tokenizer, tmp_path):
    from megaloop.hf import evaluate as ev

    Trainer(_run(pattern_data, tmp_path / "plain", tokenizer)).train()
    section = DownstreamEvalConfig(tasks=TASKS, data_dir=str(EVAL_DATA), limit=3)
    Trainer(_run(pattern_data, tmp_path / "evaluated", tokenizer, section)).train()
    assert train_losses(tmp_path / "evaluated") == train_losses(tmp_path / "plain")

    records = [json.loads(line) for line in
               (tmp_path / "evaluated" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if r["kind"] == "downstream"]
    assert sorted((r["step"], r["task"]) for r in rows) == [(3, "piqa"), (3, "winogrande"),
                                                            (6, "piqa"), (6, "winogrande")]
    for row in rows:
        assert (row["num_fewshot"], row["iterations"], row["samples"]) == (0, 2, 3)
    # The in-memory copy scores what the saved checkpoint scores through its export.
    checkpoint = tmp_path / "evaluated" / "checkpoints" / "iter_0000003"
    model, hf_tokenizer, _ = ev.load_for_evaluation(checkpoint, tmp_path / "export")
    expected = ev.evaluate(model, hf_tokenizer, TASKS, data_dir=EVAL_DATA, limit=3)
    for row in expected:
        logged = next(r for r in rows if r["step"] == 3 and r["task"] == row["task"])
        assert {k: logged[k] for k in ("acc", "samples")} == {k: row[k] for k in ("acc",
                                                                                   "samples")}


def test_every_second_save_and_always_the_final_checkpoint(mcore, pattern_data, tokenizer,
                                                           tmp_path, monkeypatch):
    from megaloop.training.downstream import DownstreamEval

    evaluated = []
    monkeypatch.setattr(DownstreamEval, "_evaluate", lambda self, model: evaluated.append(
        model.training) or [])
    cfg = _run(pattern_data, tmp_path, tokenizer,
               DownstreamEvalConfig(tasks=TASKS, data_dir=str(EVAL_DATA), every=2))
    cfg.train.train_steps, cfg.checkpoint.save_interval = 7, 2  # saves at 2, 4, 6, final 7
    steps = []
    monkeypatch.setattr(DownstreamEval, "after_save", _recording(DownstreamEval.after_save, steps))
    Trainer(cfg).train()
    assert steps == [4, 7] and evaluated == [True, True]
    # Resumed: saves at 8, 10, final 11; the 4th periodic save is at 8. Before: the count started
    # again at the resume, and the saves of 10 and 14 would have been evaluated.
    steps.clear()
    cfg.train.train_steps = 11
    Trainer(cfg).train()
    assert steps == [8, 11]


def _recording(after_save, steps):
    def wrapper(self, model, step, monitor, final=False):
        before = self.evaluated_step
        after_save(self, model, step, monitor, final)
        if self.evaluated_step != before:
            steps.append(step)
    return wrapper


@pytest.mark.parametrize("change, message", [
    (dict(data_dir=None), "train.downstream_eval.data_dir=None: must be the directory"),
    (dict(tasks=[], data_dir=None, limit=5),
     "train.downstream_eval.tasks=[]: must be set (a list of task names or tags) when "
     "train.downstream_eval.limit is"),
    (dict(every=0), "train.downstream_eval.every=0: must be >= 1"),
    (dict(limit=0), "train.downstream_eval.limit=0: must be >= 1 or null"),
    (dict(max_gen_toks=0), "train.downstream_eval.max_gen_toks=0: must be >= 1 or null"),
])
def test_bad_settings_are_refused_in_one_line(change, message):
    section = dataclasses.replace(DownstreamEvalConfig(tasks=TASKS, data_dir="d"), **change)
    with pytest.raises(ConfigError) as error:
        section.validate()
    assert str(error.value).startswith(message)


def test_run_level_requirements_fail_before_the_model_is_built(mcore, pattern_data, tokenizer,
                                                               tmp_path, monkeypatch):
    section = DownstreamEvalConfig(tasks=TASKS, data_dir=str(EVAL_DATA))
    cfg = _run(pattern_data, tmp_path / "a", tokenizer, section)
    cfg.parallel = dataclasses.replace(cfg.parallel, tensor=2)
    with pytest.raises(ConfigError, match=r"with parallel tensor/pipeline/expert sizes \(2, 1, 1\)"):
        cfg.validate()
    cfg = _run(pattern_data, tmp_path / "b", tokenizer, section)
    cfg.data = dataclasses.replace(cfg.data, tokenizer_model=None, eod_id=0)
    with pytest.raises(ConfigError, match="empty without data.tokenizer_model"):
        cfg.validate()

    monkeypatch.setattr(Trainer, "_build_model", lambda self: pytest.fail("model built"))
    for index, (change, message) in enumerate((
            (dict(tasks=["nope"]), "train.downstream_eval: task 'nope': not in "),
            (dict(data_dir=str(tmp_path)), "piqa_valid.jsonl: no such file"),
            # Before: accepted, then every evaluation failed and was logged while training went
            # on (as gsm8k's own 256 new tokens did with a context of 256 or less).
            (dict(tasks=["gsm8k"], max_gen_toks=512),
             r"train.downstream_eval: max_gen_toks 512 \(task gsm8k\): leaves no room for a "
             "prompt in the model's 512-token context; set a smaller "
             "train.downstream_eval.max_gen_toks$"),
            (dict(max_gen_toks=8), "max_gen_toks 8: none of the tasks generates text"),
            (dict(num_fewshot=10_000), "num_fewshot 10000: task piqa draws its examples"))):
        cfg = _run(pattern_data, tmp_path / f"run{index}", tokenizer,
                   dataclasses.replace(section, **change))
        with pytest.raises(ConfigError, match=message):
            Trainer(cfg)


def test_the_harness_tokenizer_encodes_as_the_runs_legacy_tokenizer(mcore, pattern_data,
                                                                    tokenizer, tmp_path):
    """data.legacy_tokenizer=true: the harness reads text with the run's <EOD> and other added ids,
    and eos is the EOD the model trains with."""
    from megaloop.data import load_tokenizer
    from megaloop.training.downstream import DownstreamEval

    cfg = _run(pattern_data, tmp_path, tokenizer,
               DownstreamEvalConfig(tasks=TASKS, data_dir=str(EVAL_DATA)))
    cfg.data = dataclasses.replace(cfg.data, legacy_tokenizer=True)
    legacy = load_tokenizer("SentencePieceTokenizer", tokenizer, legacy=True)
    downstream = DownstreamEval(cfg)
    try:
        text = "a goal<EOD> then<CLS>"
        assert downstream.tokenizer(text)["input_ids"] == legacy.encode_batch([text])[0]
        assert downstream.tokenizer.eos_token_id == legacy.eod
    finally:
        downstream.close()


def test_a_finished_run_killed_in_its_final_downstream_evaluation_makes_just_it_when_relaunched(
        mcore, pattern_data, tokenizer, tmp_path, monkeypatch, caplog):
    """The final downstream evaluation follows the final validation, whose record the relaunch
    of a finished run looked for alone: before the fix a kill during the downstream one left a
    run every relaunch found complete, exiting 0 without it."""
    import logging

    from megaloop.training.downstream import DownstreamEval

    # Saves at step 2, not evaluated (every second save is): the final evaluation follows.
    cfg = _run(pattern_data, tmp_path, tokenizer,
               DownstreamEvalConfig(tasks=["piqa"], data_dir=str(EVAL_DATA), every=2))
    cfg.train.train_steps, cfg.checkpoint.save_interval = 2, 2
    evaluated = []

    def evaluate(self, model):  # the harness's row (test_rows_at_each_save... checks the real)
        evaluated.append(self.section.limit)
        if self.section.limit is None:  # the first run: killed here
            raise KeyboardInterrupt
        return [{"task": "piqa", "num_fewshot": 0, "iterations": 2, "acc": 0.5}]

    monkeypatch.setattr(DownstreamEval, "_evaluate", evaluate)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg).train()
    cfg.train.downstream_eval.limit, cfg.train.eval_iters = 3, 5  # eval_iters: not applied
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        assert Trainer(cfg).train() == {"step": 2}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records if r["kind"] != "train"] == [
        ("eval", 2), ("downstream", 2)]  # the validation made once, before the kill
    assert evaluated == [None, 3]
    path = tmp_path / "checkpoints" / "iter_0000002"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(str(path))] == [
        f"{path}: no final downstream evaluation of step 2 in {tmp_path / 'metrics.jsonl'} (the "
        "run was stopped during it, it failed, or the run had not asked for it): making it now",
        f"{path}: the run is complete at step 2 (train.train_steps=2): nothing to train (raise "
        "train.train_steps to continue it); changed settings applied by the final downstream "
        "evaluation made now: train.downstream_eval; not applied: train.eval_iters"]
    assert Trainer(cfg).train() == {"step": 2, "complete": True}  # made once
    assert evaluated == [None, 3]
