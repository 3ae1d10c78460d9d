"""A finished Trainer frees its model and its communicators: notebooks, sweeps and this test
session build many in one process."""

import gc
import os
import weakref

from megaloop.training.data import MicroBatches
from megaloop.training.trainer import Trainer
from tests.training.conftest import tiny_run


def _one_trained_step(data_prefix, out_dir):
    """Builds a Trainer, takes one optimizer step and an evaluation (the forward pass memoises
    megatron-core's rotary embedding), closes it; returns weak references to its pieces."""
    trainer = Trainer(tiny_run(data_prefix, out_dir, train={"train_steps": 1}))
    trainer.step = 1
    trainer.train_step(MicroBatches(trainer.train_data, 2, 0, 1, 0, 4))
    trainer.evaluate()
    trainer.close()
    return {name: weakref.ref(getattr(trainer, name)) for name in ("ddp", "model", "optimizer")}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_dropped_trainer_frees_its_model_and_groups(mcore, pattern_data, tmp_path):
    refs = _one_trained_step(pattern_data, tmp_path / "first")
    gc.collect()
    assert {name: ref() is not None for name, ref in refs.items()} == {
        "ddp": False, "model": False, "optimizer": False}
    # Each set-up builds a dozen gloo groups (about 50 threads); a set-up after the first must
    # not add to the count that the first one left.
    before = _threads()
    for run in range(2):
        _one_trained_step(pattern_data, tmp_path / f"again{run}")
        gc.collect()
    assert _threads() <= before
