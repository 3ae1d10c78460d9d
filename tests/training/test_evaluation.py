"""Evaluation reports what it says: the validation loss comes from the held-out documents of the
split, and each test-time depth of train.eval_depths is an evaluation of the model at that K."""

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
