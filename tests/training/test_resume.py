"""What a resume keeps and what it takes from the new config: the LR schedule follows the config
(each change logged in one line) unless the checkpoint's is asked for, per-matrix LR multipliers
set by hand come back group by group, and changes that alter the sample order are warned about."""

import logging
import math

import pytest

from megaloop.training.trainer import SCHEDULE_FIELDS, Trainer
from tests.training.conftest import tiny_run

LR = 3e-3


@pytest.fixture(scope="module")
def run_at_step_4(mcore, pattern_data, tmp_path_factory):
    """A finished 4-step run (cosine to 0.1 x LR over 4 steps, Adam betas 0.9/0.95)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    Trainer(tiny_run(pattern_data, out, train={"train_steps": 4})).train()
    return out


def _copy(run, tmp_path):
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def cosine_lr(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """The LR of the optimizer step after ``step`` completed steps: linear warmup from 0, then
    cosine to ``floor`` (the documented schedule, written out independently)."""
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / (total - warmup)
    return floor + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - floor)


CHANGED = {"train_steps": 12, "warmup_fraction": 0.25, "lr": 2e-3, "min_lr_ratio": 0.5,
           "weight_decay": 0.05, "adam_beta1": 0.8, "adam_beta2": 0.99}


def _matrix_groups(trainer):
    return [g for g in trainer.optimizer.param_groups if g["wd_mult"] != 0.0]


def test_the_config_schedule_wins_on_resume_and_each_change_is_one_line(
        run_at_step_4, pattern_data, tmp_path, caplog):
    assert set(CHANGED) == set(SCHEDULE_FIELDS)
    out = _copy(run_at_step_4, tmp_path)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        trainer = Trainer(tiny_run(pattern_data, out, train=CHANGED))
    assert trainer.step == 4
    for name, value in CHANGED.items():
        lines = [r.getMessage() for r in caplog.records
                 if f"train.{name} changed" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0] and repr(value) in lines[0], (name, lines)
    # Before the fix, extending train_steps pinned the LR at the old floor (0.1 x 3e-3).
    expected = cosine_lr(4, total=12, warmup=3, peak=2e-3, floor=1e-3)
    assert trainer.current_lr() == pytest.approx(expected, rel=1e-12)
    for group in _matrix_groups(trainer):
        assert group["betas"] == (0.8, 0.99)
        assert group["weight_decay"] == pytest.approx(0.05)
    trainer.close()


def test_keep_schedule_keeps_the_checkpoints_schedule_and_says_so(run_at_step_4, pattern_data,
                                                                  tmp_path, caplog):
    out = _copy(run_at_step_4, tmp_path)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        trainer = Trainer(tiny_run(pattern_data, out, train=CHANGED,
                                   checkpoint={"keep_schedule": True}))
    for name in CHANGED:
        assert sum(f"train.{name}=" in r.getMessage() and "is kept" in r.getMessage()
                   for r in caplog.records) == 1, name
    # The 4-step schedule is over at step 4: its floor, 0.1 x 3e-3, held for the extension.
    assert trainer.current_lr() == pytest.approx(0.1 * LR, rel=1e-12)
    for group in _matrix_groups(trainer):
        assert group["betas"] == (0.9, 0.95)
        assert group["weight_decay"] == pytest.approx(0.1)
    trainer.close()


def test_an_unchanged_config_resumes_without_a_word(run_at_step_4, pattern_data, tmp_path,
                                                    caplog):
    out = _copy(run_at_step_4, tmp_path)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        Trainer(tiny_run(pattern_data, out, train={"train_steps": 4})).close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("change, named", [
    (dict(model={"seq_length": 16}), "model.seq_length"),
    (dict(train={"seed": 7}), "train.seed"),
])
def test_a_change_of_the_sample_order_is_warned(run_at_step_4, pattern_data, tmp_path, caplog,
                                                change, named):
    out = _copy(run_at_step_4, tmp_path)
    train = {"train_steps": 4, **change.get("train", {})}
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        Trainer(tiny_run(pattern_data, out, model=change.get("model"), train=train)).close()
    lines = [r.getMessage() for r in caplog.records if "sample order" in r.getMessage()]
    assert len(lines) == 1 and named in lines[0], caplog.text


def test_lr_multipliers_set_by_hand_survive_save_and_resume_group_by_group(
        mcore, pattern_data, tmp_path):
    first = Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 2}))
    # Whole matrices (their own param group) and blocks of fused weights (scaled in the step).
    whole = sorted(n for n in first.lr_multipliers.names if ":" not in n)
    blocks = sorted(n for n in first.lr_multipliers.names if ":" in n)
    chosen = {whole[0]: 2.5, whole[-1]: 4.0, blocks[0]: 0.5, blocks[-1]: 3.0}
    first.lr_multipliers.set(chosen)
    first.train()

    resumed = Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 3}))
    assert resumed.step == 2
    seen = []
    optimizer_step = resumed.optimizer.step
    multipliers = resumed.lr_multipliers

    def recording_step():
        groups = {g["megaloop_matrix"]: g["lr"] for g in resumed.optimizer.param_groups
                  if g.get("megaloop_matrix") in whole}
        seen.append((resumed.current_lr(), groups, multipliers.block_lrs(resumed.current_lr())))
        return optimizer_step()

    resumed.optimizer.step = recording_step
    resumed.train()
    (base, group_lrs, block_lrs), = seen
    assert set(group_lrs) == set(whole)
    for name, lr in group_lrs.items():  # what the optimizer applies to whole matrices
        assert lr == pytest.approx(base * chosen.get(name, 1.0), rel=1e-12), name
    for name, lr in block_lrs.items():
        assert lr == pytest.approx(base * chosen.get(name, 1.0), rel=1e-12), name
