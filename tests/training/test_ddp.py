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


class _TiedCopiesMade(Exception):
    pass


def test_model_chunks_are_on_the_collective_device_before_the_tied_copies_sync(
        mcore, pattern_data, tmp_path, monkeypatch):
    """The tied copies' first sync is a collective over their tensors, which NCCL takes on CUDA
    only; megatron-core's MoE routers and megaloop's local-spec norms are made on the CPU. The
    chunks were moved to the GPU only when DDP wrapped them, after that sync. Here the collective
    device is the meta device, which no tensor is made on."""
    import torch

    from megaloop.training import tied, trainer as trainer_module

    seen = {}

    class Recorder:
        def __init__(self, chunks, pipeline, group):
            seen["devices"] = {p.device.type for chunk in chunks for p in chunk.parameters()}
            raise _TiedCopiesMade

    monkeypatch.setattr(trainer_module, "collective_device", lambda: torch.device("meta"))
    monkeypatch.setattr(tied, "TiedCopies", Recorder)
    trainer = Trainer.__new__(Trainer)  # the model set-up alone, on this process's groups
    trainer.cfg = tiny_run(pattern_data, tmp_path, model={"num_experts": 4},
                           parallel={"pipeline": 2})
    trainer.precision, trainer.num_microbatches = "fp32", 2
    try:
        trainer._build_model()
    except _TiedCopiesMade:
        pass
    assert seen["devices"] == {"meta"}
