"""ALRS inside the training loop: multipliers reach the optimizer's LRs, logs are written, and a
resume restores the allocator exactly."""

import shutil

import pytest

from megaloop.alrs import ALRSConfig, read_log
from megaloop.training.trainer import Trainer
from tests.training.conftest import tiny_run, train_losses

ALRS = ALRSConfig(interval=2, fraction=0.5, transition=2)  # allocations at steps 1, 2, 4


def _run(data, out, **train):
    cfg = tiny_run(data, out, train={"use_alrs": True, **train},
                   checkpoint={"save_interval": 4})
    cfg.alrs = ALRS
    return cfg


def test_alrs_multipliers_set_the_group_learning_rates(mcore, pattern_data, tmp_path):
    trainer = Trainer(_run(pattern_data, tmp_path))
    seen = []  # (base LR, group LRs, multipliers) at the moment of every optimizer step
    optimizer_step = trainer.optimizer.step

    def recording_step():
        seen.append((trainer.current_lr(), trainer.lr_multipliers.group_lrs(),
                     dict(trainer.lr_multipliers.multipliers)))
        return optimizer_step()

    trainer.optimizer.step = recording_step
    trainer.train()
    assert len(seen) == 8
    base, group_lrs, multipliers = seen[-1]
    assert set(multipliers) == set(trainer.lr_multipliers.names)
    assert min(multipliers.values()) >= ALRS.s1 - 1e-9
    assert max(multipliers.values()) > 1.5, "ALRS should spread the multipliers over [s1, s2]"
    for name, lr in group_lrs.items():
        assert lr == pytest.approx(base * multipliers.get(name, 1.0), rel=1e-12), name
    log = read_log(tmp_path / "alrs.zarr")
    assert len(log.matrices) == len(multipliers)


def test_resume_with_alrs_is_exact(mcore, pattern_data, tmp_path):
    straight = tmp_path / "straight"
    Trainer(_run(pattern_data, straight)).train()
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "iter_0000004",
                    resumed / "checkpoints" / "iter_0000004")
    (resumed / "checkpoints" / "latest").write_text("iter_0000004\n")
    Trainer(_run(pattern_data, resumed)).train()
    a, b = train_losses(straight), train_losses(resumed)
    assert [a[s] for s in (5, 6, 7, 8)] == [b[s] for s in (5, 6, 7, 8)]
