"""Evaluation reports what it says: the validation loss comes from the held-out documents of the
split, and each test-time depth of train.eval_depths is an evaluation of the model at that K; a
finished run relaunched makes the final evaluation a kill cut short."""

import numpy as np
import pytest
import torch

from megaloop.training.trainer import Trainer
from tests.training.conftest import EOD, tiny_run

DOCUMENTS, HELD_OUT = 400, 40  # split "90,10,0": documents 360..399 are the validation split
TRAIN_IDS, VALID_IDS = range(1, 61), range(61, 121)


@pytest.fixture(scope="module")
def split_data(tmp_path_factory):
    """Training documents use token ids 1..60, held-out ones 61..120, so every token says which
    split it came from."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("split") / "split"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for index in range(DOCUMENTS):
        ids = VALID_IDS if index >= DOCUMENTS - HELD_OUT else TRAIN_IDS
        start, length = rng.integers(0, 60), rng.integers(20, 60)
        doc = ids[0] + (start + np.arange(length)) % 60
        builder.add_item(torch.from_numpy(np.append(doc, EOD).astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_validation_loss_comes_from_the_held_out_documents(mcore, split_data, tmp_path):
    trainer = Trainer(tiny_run(split_data, tmp_path, train={"train_steps": 2}))
    seen = {"train": [], "eval": []}
    forward = trainer._forward_step

    def recording(data_iterator, model, num_iterations=None):
        batch = next(data_iterator)
        seen["eval" if not model.training else "train"].append(batch)
        return forward(iter([batch]), model, num_iterations)

    trainer._forward_step = recording
    trainer.train()
    trainer._forward_step = forward
    for split, allowed in (("train", TRAIN_IDS), ("eval", VALID_IDS)):
        tokens = torch.cat([b["tokens"].flatten() for b in seen[split]])
        tokens = tokens[tokens != EOD]
        assert len(tokens) and tokens.min() >= allowed[0] and tokens.max() <= allowed[-1], split

    # The reported value is the token-weighted mean over those batches (eval_iters of them).
    batches = seen["eval"]
    assert len(batches) == trainer.cfg.train.eval_iters * trainer.num_microbatches
    trainer.model.eval()
    with torch.no_grad():
        total = count = 0.0
        for b in batches:
            losses = trainer.model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            total += (losses * b["loss_mask"]).sum().item()
            count += b["loss_mask"].sum().item()
    assert trainer.evaluate()["val_loss"] == pytest.approx(total / count, rel=1e-5)


def test_each_eval_depth_equals_an_evaluation_of_the_model_at_that_depth(mcore, pattern_data,
                                                                         tmp_path):
    depths = [1, 4]
    result = Trainer(tiny_run(pattern_data, tmp_path / "run",
                              train={"train_steps": 3, "eval_depths": depths})).train()
    for k in depths:
        # Independently: a model built with iterations=k from the trained weights.
        at_k = Trainer(tiny_run(pattern_data, tmp_path / f"k{k}", model={"iterations": k},
                                checkpoint={"load": str(tmp_path / "run" / "checkpoints"),
                                            "load_optimizer": False}))
        assert result[f"val_loss_k{k}"] == pytest.approx(at_k.evaluate()["val_loss"], rel=1e-6)
        at_k.close()
    # The depths really differ (the trained model has K=2): no column of copies.
    losses = [result["val_loss"]] + [result[f"val_loss_k{k}"] for k in depths]
    assert len(set(losses)) == len(losses), losses


@pytest.mark.parametrize("train_steps, evaluated", [(4, [3, 4]), (6, [3, 6])])
def test_evaluation_runs_every_eval_interval_and_at_the_end_once(mcore, pattern_data, tmp_path,
                                                                 train_steps, evaluated):
    import json
    import math

    result = Trainer(tiny_run(pattern_data, tmp_path,
                              train={"train_steps": train_steps, "eval_interval": 3})).train()
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert [e["step"] for e in evals] == evaluated
    for e in evals:
        assert e["val_ppl"] == pytest.approx(math.exp(e["val_loss"]), rel=1e-9)
    assert evals[-1]["val_loss"] == result["val_loss"] != evals[0]["val_loss"]


# ----------------------------------------------------------------- the final evaluation's record

def _evaluations(out) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"eval"' in line]


def _killed_in_its_final_evaluation(cfg, monkeypatch) -> None:
    """Runs ``cfg`` (whose last step is saved before the final evaluation) until a kill during
    that evaluation."""
    def killed(self, num_iterations=None):  # the kill: nothing after it runs
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "evaluate", killed)
        with pytest.raises(KeyboardInterrupt):
            Trainer(cfg).train()


def test_a_finished_run_killed_in_its_final_evaluation_makes_it_when_relaunched(
        mcore, pattern_data, tmp_path, caplog, monkeypatch):
    """checkpoint.save_interval dividing train.train_steps saves the last step before the final
    evaluation; a job killed during that evaluation left the run complete without it. Before the
    fix every relaunch exited 0 at once, evaluating nothing."""
    import logging

    from megaloop.training import checkpoint as ckpt

    def run(name):
        return tiny_run(pattern_data, tmp_path / name, train={"train_steps": 4},
                        checkpoint={"save_interval": 4})

    Trainer(run("straight")).train()  # the same run, evaluated in one go
    out, cfg = tmp_path / "run", run("run")
    _killed_in_its_final_evaluation(cfg, monkeypatch)
    path = out / "checkpoints" / "iter_0000004"
    assert ckpt.latest_checkpoint(out / "checkpoints") == path
    assert _evaluations(out) == []
    config = (out / "config.yaml").read_bytes()
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        result = Trainer(cfg).train()
    expected = _evaluations(tmp_path / "straight")[0]["val_loss"]
    assert result["step"] == 4 and result["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert [record["val_loss"] for record in _evaluations(out)] == [result["val_loss"]]
    assert f"{path}: no final evaluation of step 4 in {out / 'metrics.jsonl'} (the run was " \
           "stopped during it, it failed, or the run had not asked for it): making it now" in [
               r.getMessage() for r in caplog.records]
    assert ckpt.latest_checkpoint(out / "checkpoints") == path  # nothing saved
    assert (out / "config.yaml").read_bytes() == config
    # Made once: the next relaunch finds the run complete and evaluates nothing.
    assert Trainer(cfg).train() == {"step": 4, "complete": True}
    assert len(_evaluations(out)) == 1


def test_a_finished_run_without_validation_data_is_complete_without_an_evaluation(
        mcore, pattern_data, tmp_path, monkeypatch):
    """No validation split, no evaluation record: its lack is no missing final evaluation."""
    import megaloop.models.model as model_module

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 2})
    cfg.data.split = "100,0,0"
    Trainer(cfg).train()

    def no_model(*a, **k):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(model_module, "LoopedLM", no_model)
    assert Trainer(cfg).train() == {"step": 2, "complete": True}


def test_a_relaunch_making_the_final_evaluation_names_the_changes_it_applies(
        mcore, pattern_data, tmp_path, caplog, monkeypatch):
    """Before the fix the relaunch said "changed settings not applied: train.eval_iters, ..."
    while its final evaluation ran with the new train.eval_iters."""
    import logging

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 2},
                   checkpoint={"save_interval": 2})
    _killed_in_its_final_evaluation(cfg, monkeypatch)
    cfg.train.eval_iters, cfg.train.log_interval = 3, 1
    evaluated = []
    evaluate = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self, num_iterations=None: evaluated.append(
        self.cfg.train.eval_iters) or evaluate(self, num_iterations))
    done = (f"{tmp_path / 'checkpoints' / 'iter_0000002'}: the run is complete at step 2 "
            "(train.train_steps=2): nothing to train (raise train.train_steps to continue it); ")
    for applied in (True, False):  # the evaluation missing, then made
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megaloop.train"):
            Trainer(cfg).train()
        assert (done + ("changed settings applied by the final evaluation made now: "
                        "train.eval_iters; not applied: train.log_interval" if applied else
                        "changed settings not applied: train.log_interval, train.eval_iters")
                in [r.getMessage() for r in caplog.records]), caplog.text
    assert evaluated == [3]


def test_a_relaunch_making_the_final_evaluation_reports_no_resume(
        mcore, pattern_data, tmp_path, caplog, monkeypatch):
    """It trains no step: before the fix, after the line naming train.lr not applied, it said
    "resume: train.lr changed ...; the LR schedule follows the config from step 3", "resume:
    train.seed differs ...: the sample order from step 3 on ..." and "resumed from ... at step 2"
    of a run whose last step is 2."""
    import logging

    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 2},
                   checkpoint={"save_interval": 2})
    _killed_in_its_final_evaluation(cfg, monkeypatch)
    cfg.train.lr, cfg.train.seed = cfg.train.lr * 2, cfg.train.seed + 1
    with caplog.at_level(logging.INFO, logger="megaloop"):
        Trainer(cfg).train()
    messages = [r.getMessage() for r in caplog.records]
    assert (f"{tmp_path / 'checkpoints' / 'iter_0000002'}: the run is complete at step 2 "
            "(train.train_steps=2): nothing to train (raise train.train_steps to continue it); "
            "changed settings applied by the final evaluation made now: train.seed; "
            "not applied: train.lr" in messages), caplog.text
    assert [m for m in messages if m.startswith(("resume:", "resumed from"))] == []
