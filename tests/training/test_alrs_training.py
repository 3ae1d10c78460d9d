"""ALRS inside the training loop: multipliers reach the optimizer's LRs, logs are written, a
resume restores the allocator exactly, and a machine without zarr trains (ALRS asks for zarr in
one line)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaloop.alrs import ALRSConfig, read_log
from megaloop.config import ConfigError, save_yaml
from megaloop.training.trainer import Trainer
from tests.training.conftest import resume_from, tiny_run, train_losses

ALRS = ALRSConfig(interval=2, fraction=0.5, transition=2)  # allocations at steps 1, 2, 4


def _run(data, out, **train):
    cfg = tiny_run(data, out, train={"use_alrs": True, **train},
                   checkpoint={"save_interval": 4})
    cfg.alrs = ALRS
    return cfg


def test_alrs_multipliers_set_the_learning_rates_of_every_block(mcore, pattern_data, tmp_path):
    trainer = Trainer(_run(pattern_data, tmp_path))
    scaling = trainer.lr_multipliers.scaling
    seen = []  # (base LR, group LRs, multipliers, block scales) at the moment of every step
    optimizer_step = trainer.optimizer.step

    def recording_step():
        groups = {g["megaloop_matrix"]: g["lr"] for g in trainer.optimizer.param_groups
                  if g.get("megaloop_matrix")}
        scales = {n: float(t.row_scale[t.row_block == i][0]) if t.row_scale is not None else 1.0
                  for t in scaling.targets for i, n in enumerate(t.names)}
        seen.append((trainer.current_lr(), groups, dict(trainer.lr_multipliers.multipliers),
                     scales))
        return optimizer_step()

    trainer.optimizer.step = recording_step
    trainer.train()
    assert len(seen) == 8
    base, groups, multipliers, scales = seen[0]
    assert set(multipliers) == set(trainer.lr_multipliers.names)  # from step 1 on, at once
    assert {"decoder.layers.0.self_attention.linear_qkv.weight:k",
            "decoder.layers.0.self_attention.linear_kv_global.weight:global_v",
            "encoder.layers.1.mlp.linear_fc1.weight:up"} <= set(multipliers)
    assert min(multipliers.values()) >= ALRS.s1 - 1e-9
    assert max(multipliers.values()) > 1.5, "ALRS should spread the multipliers over [s1, s2]"
    for base, groups, multipliers, scales in seen:
        for name, lr in groups.items():  # a fused weight's group keeps the base LR ...
            assert lr == pytest.approx(base * multipliers.get(name, 1.0), rel=1e-12), name
        for name, scale in scales.items():  # ... and its blocks' updates are scaled
            assert scale == pytest.approx(multipliers[name], rel=1e-6), name
    log = read_log(tmp_path / "alrs.zarr")
    assert log.matrices == trainer.lr_multipliers.names == trainer.alrs.names


def test_resume_with_alrs_is_exact(mcore, pattern_data, tmp_path):
    straight = tmp_path / "straight"
    Trainer(_run(pattern_data, straight)).train()
    resumed = tmp_path / "resumed"
    resume_from(straight, resumed, 4)
    # As saved before the schedule kept the length of its ramp (in progress: steps 4 to 6).
    common = resumed / "checkpoints" / "iter_0000004" / "common.pt"
    state = torch.load(common, weights_only=True)
    assert state["alrs"]["schedule"].pop("ramp_length") == 2
    torch.save(state, common)
    Trainer(_run(pattern_data, resumed)).train()
    a, b = train_losses(straight), train_losses(resumed)
    assert [a[s] for s in (5, 6, 7, 8)] == [b[s] for s in (5, 6, 7, 8)]
    # The same checkpoint with whole-parameter granularity (the layout of runs saved before
    # blocks existed): one line naming the setting.
    other = tiny_run(pattern_data, tmp_path / "other", train={"use_alrs": True},
                     checkpoint={"dir": str(resumed / "checkpoints")})
    other.alrs = dataclasses.replace(ALRS, granularity="parameter")
    with pytest.raises(ConfigError, match="alrs.granularity"):
        Trainer(other)


def test_without_zarr_training_runs_and_alrs_asks_for_it_in_one_line(mcore, pattern_data, tmp_path):
    for name, train in (("plain", {}), ("alrs", {"use_alrs": True})):
        save_yaml(tiny_run(pattern_data, tmp_path / name, train={"train_steps": 2, **train}),
                  tmp_path / f"{name}.yaml")
    code = f"""
import sys
sys.modules["zarr"] = None  # "import zarr" now raises ImportError, as on a bare CUDA machine
from megaloop.alrs import ALRS
from megaloop.train import main
import torch

weights = {{"w": torch.nn.Parameter(torch.randn(8, 8))}}
ALRS(lambda: weights.items(), 10).step(1)  # no log asked for: no zarr needed
print("EXIT", main(["--config", {str(tmp_path / "plain.yaml")!r}]),
      main(["--config", {str(tmp_path / "alrs.yaml")!r}]))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                         "PYTHONPATH": str(Path(__file__).parents[2])})
    assert "EXIT 0 2" in result.stdout, result.stderr[-3000:]
    # The test's directory is named after it, "zarr" included: lines naming paths do not count.
    errors = [line for line in result.stderr.splitlines()
              if "zarr" in line.replace(str(tmp_path), "")]
    assert errors == ["error: the ALRS log (train.use_alrs=true, or ALRS(log_path=...)) is written "
                      "with zarr, which is not installed: pip install 'zarr>=3'"]
    assert not (tmp_path / "alrs" / "alrs.zarr").exists()


def test_a_skipped_first_step_still_allocates(mcore, pattern_data, tmp_path):
    """Step 1 is the only allocation of a run shorter than alrs.interval / alrs.fraction. Before,
    a NaN loss at step 1 skipped ALRS with the update: the run trained with uniform LRs, its log
    holding no spectra, without a word."""
    cfg = tiny_run(pattern_data, tmp_path, train={"use_alrs": True, "train_steps": 2})
    trainer = Trainer(cfg)
    forward = trainer._forward_step

    def nan_at_step_1(data_iterator, model, num_iterations=None):
        output, loss_func = forward(data_iterator, model, num_iterations)
        return (output * float("nan") if trainer.step == 1 else output), loss_func

    trainer._forward_step = nan_at_step_1
    trainer.train()
    assert trainer.skipped_steps == 1
    assert max(trainer.lr_multipliers.multipliers.values()) == pytest.approx(cfg.alrs.s2)
    assert read_log(tmp_path / "alrs.zarr").spectra_step.tolist() == [1]
