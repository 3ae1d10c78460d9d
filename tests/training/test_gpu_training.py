"""GPU-only (marker ``gpu``): the trainer's bf16 path (Float16Module, NCCL collectives, fused joint
attention on CUDA) and, with Transformer Engine, FP8 through the config."""

import pytest

from megaloop.training.trainer import Trainer
from tests.training.conftest import tiny_run, train_losses

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_trainer_runs_and_resumes_on_gpu(mcore, pattern_data, tmp_path, precision):
    if precision == "fp8":
        pytest.importorskip("transformer_engine")
    cfg = tiny_run(pattern_data, tmp_path, model={"hidden_size": 128, "seq_length": 64},
                   train={"precision": precision, "train_steps": 4},
                   checkpoint={"save_interval": 2})
    Trainer(cfg).train()
    losses = train_losses(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4] and all(v is not None for v in losses.values())
    resumed = Trainer(cfg)  # latest is step 4: loads optimizer state on the GPU
    assert resumed.step == 4
