"""What a resume keeps and what it takes from the new config: the LR schedule follows the config
(each change logged in one line) unless the checkpoint's is asked for, per-matrix LR multipliers
set by hand come back group by group, and changes that alter the sample order are warned about."""

import logging
import math
import shutil

import pytest

from megaloop.training.resume import SCHEDULE_FIELDS
from megaloop.training.trainer import Trainer
from tests.training.conftest import tiny_run

LR = 3e-3


@pytest.fixture(scope="module")
def run_at_step_4(mcore, pattern_data, tmp_path_factory):
    """A finished 4-step run (cosine to 0.1 x LR over 4 steps, Adam betas 0.9/0.95)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    Trainer(tiny_run(pattern_data, out, train={"train_steps": 4})).train()
    return out


@pytest.fixture(scope="module")
def run_stopped_at_step_4(mcore, pattern_data, tmp_path_factory):
    """An 8-step run whose latest checkpoint is that of step 4, as after a crash at step 5."""
    out = tmp_path_factory.mktemp("resume") / "run"
    Trainer(tiny_run(pattern_data, out, checkpoint={"save_interval": 4})).train()
    shutil.rmtree(out / "checkpoints" / "iter_0000008")
    (out / "checkpoints" / "latest").write_text("iter_0000004\n")
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


# Every schedule field changed; to warmup-stable-decay, whose decay takes the last 6 of 12 steps.
CHANGED = {"train_steps": 12, "warmup_fraction": 0.25, "lr": 2e-3, "min_lr_ratio": 0.5,
           "weight_decay": 0.05, "adam_beta1": 0.8, "adam_beta2": 0.99, "lr_schedule": "wsd",
           "wsd_decay_fraction": 0.5, "wsd_decay_style": "minus_sqrt"}


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
        assert "follows the config from step 5 " in lines[0]  # before: step 4, the checkpoint's
    # Before the fix, extending train_steps pinned the LR at the old floor (0.1 x 3e-3); step 5
    # is in the new schedule's stable phase.
    assert trainer.current_lr() == pytest.approx(2e-3, rel=1e-12)
    trainer.scheduler.step(5)  # step 10: 1 - sqrt(3/6) of the way from the floor to the peak
    assert trainer.current_lr() == pytest.approx(1e-3 + (1 - math.sqrt(0.5)) * 1e-3, rel=1e-12)
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


def test_keep_schedule_keeps_a_warmup_stable_decay_schedule_through_resumes(pattern_data,
                                                                            tmp_path):
    """megatron-core's scheduler state leaves out the WSD decay length and shape, so they are
    saved beside it. A run that kept a WSD schedule under a cosine config saves a checkpoint whose
    config has none: before, resuming from it failed at the first LR read (TypeError)."""
    out = tmp_path / "run"
    wsd = {"train_steps": 8, "lr_schedule": "wsd", "wsd_decay_fraction": 0.5,
           "warmup_fraction": 0.0}
    Trainer(tiny_run(pattern_data, out, train=wsd, checkpoint={"save_interval": 2})).train()
    for later in ("iter_0000006", "iter_0000008"):  # as if stopped after step 4's save
        shutil.rmtree(out / "checkpoints" / later)
    (out / "checkpoints" / "latest").write_text("iter_0000004\n")
    kept = {"keep_schedule": True}
    Trainer(tiny_run(pattern_data, out, train={"train_steps": 6}, checkpoint=kept)).train()
    with Trainer(tiny_run(pattern_data, out, train={"train_steps": 8},
                          checkpoint=kept)) as trainer:
        assert trainer.step == 6  # half-way through the decay over steps 5-8
        assert trainer.current_lr() == pytest.approx(0.55 * LR, rel=1e-12)


def test_an_unset_wsd_field_and_its_default_are_the_same_schedule(pattern_data, tmp_path,
                                                                   caplog):
    """Only a change of effect is named: a checkpoint's unset decay fraction and style are the
    defaults written out."""
    out = tmp_path / "run"
    wsd = {"train_steps": 4, "lr_schedule": "wsd", "warmup_fraction": 0.0}
    Trainer(tiny_run(pattern_data, out, train=wsd)).train()
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        Trainer(tiny_run(pattern_data, out, train={
            **wsd, "train_steps": 5, "wsd_decay_fraction": 0.2, "wsd_decay_style": "linear"}
        )).close()
    changes = [r.getMessage() for r in caplog.records if " changed from " in r.getMessage()]
    assert len(changes) == 1 and "train.train_steps changed from 4 to 5" in changes[0], changes


# The saved run's data.split, "90,10,0", spelt otherwise: megatron-core normalises the weights,
# and cuts the data alike (before: "data.split differs ...: the sample order ... is not the one").
SPLIT_RESPELT = ["90,10,0", "9, 1", "0.9/0.1/0"]


@pytest.mark.parametrize("split", SPLIT_RESPELT)
def test_an_unchanged_config_resumes_without_a_word(run_stopped_at_step_4, pattern_data,
                                                    tmp_path, caplog, split):
    out = _copy(run_stopped_at_step_4, tmp_path)
    cfg = tiny_run(pattern_data, out)
    cfg.data.split = split
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        trainer = Trainer(cfg)
    trainer.close()
    assert trainer.step == 4 and not trainer.complete
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("split", ["90,10,0", "0.9, 0.1"])
def test_a_finished_run_relaunched_says_so_and_adds_nothing(run_at_step_4, pattern_data,
                                                            tmp_path, caplog, monkeypatch, split):
    """Before the fix: exit 0 with no word, after a new validation and a duplicate eval row of
    step 4 in metrics.jsonl (and TensorBoard); then after building the datasets, whose index
    files (cache_dir) take minutes at scale. The saved split spelt otherwise is the same: before,
    "changed settings not applied: data.split"."""
    import megaloop.models.model as model_module

    def no_model(*a, **k):
        raise AssertionError("the model must not be built")

    def files():  # but the run and cache locks, which each start takes
        return {p: p.read_bytes() for p in out.rglob("*")
                if p.is_file() and not p.name.endswith(".lock")}

    out = _copy(run_at_step_4, tmp_path)
    shutil.rmtree(out / "cache")  # the dataset indexes: building the datasets writes them again
    before = files()
    monkeypatch.setattr(model_module, "LoopedLM", no_model)
    cfg = tiny_run(pattern_data, out, train={"train_steps": 4})
    cfg.data.split = split
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        result = Trainer(cfg).train()
    assert result == {"step": 4, "complete": True}
    path = out / "checkpoints" / "iter_0000004"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"{path}: the run is complete at step 4 (train.train_steps=4): nothing to "
                       "train (raise train.train_steps to continue it)")]
    assert files() == before  # metrics.jsonl included


@pytest.mark.parametrize("change, named, values", [
    (dict(model={"seq_length": 16}), "model.seq_length", "32 -> 16"),
    (dict(train={"seed": 7}), "train.seed", "1234 -> 7"),
    (dict(split="80,20,0"), "data.split", "'90,10,0' -> '80,20,0'"),
])
def test_a_change_of_the_sample_order_is_warned(run_stopped_at_step_4, pattern_data, tmp_path,
                                                caplog, change, named, values):
    out = _copy(run_stopped_at_step_4, tmp_path)
    cfg = tiny_run(pattern_data, out, model=change.get("model"), train=change.get("train"))
    cfg.data.split = change.get("split", cfg.data.split)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        Trainer(cfg).close()
    lines = [r.getMessage() for r in caplog.records if "sample order" in r.getMessage()]
    assert len(lines) == 1 and named in lines[0], caplog.text
    assert f"{named} differs from " in lines[0] and "from step 5 on" in lines[0]  # before: 4
    assert f"({named} {values}): " in lines[0], lines[0]  # before: neither value


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


# ----------------------------------------------------------- every other changed setting

def _checkpoint(tmp_path, **sections):
    """A run config and its checkpoint at step 4 (config.yaml and common.pt: all the settings
    check reads), in the run's own checkpoint directory."""
    import dataclasses

    import torch

    from megaloop.config import ModelConfig, RunConfig, save_yaml

    model = ModelConfig(arch="asymloop", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                        num_attention_heads=4, vocab_size=128).resolve()
    cfg = RunConfig(model=model)
    for name, values in sections.items():
        setattr(cfg, name, dataclasses.replace(getattr(cfg, name), **values))
    cfg.train.out_dir = str(tmp_path)
    path = tmp_path / "checkpoints" / "iter_0000004"
    path.mkdir(parents=True)
    save_yaml(cfg, path / "config.yaml")
    torch.save({"trainer": {"step": 4}}, path / "common.pt")
    # The run's final evaluation, logged (else a relaunch at step 4 would make it).
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 4, "val_loss": 1.0}\n')
    return path, cfg


def _changed(cfg, section, **values):
    import copy
    import dataclasses

    cfg = copy.deepcopy(cfg)
    setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    return cfg


def _check(path, cfg, caplog):
    from megaloop.training.resume import check_resume

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        check_resume(path, cfg)
    return [(r.levelno, r.getMessage()) for r in caplog.records]


@pytest.mark.parametrize("section, field, value, level", [
    ("model", "iterations", 5, logging.WARNING),
    ("parallel", "recompute", "full", logging.WARNING),
    ("train", "clip_grad", 0.5, logging.WARNING),
    ("train", "global_batch_size", 16, logging.WARNING),
    ("data", "eod_id", 5, logging.WARNING),
    ("train", "log_interval", 1, logging.INFO),
    ("checkpoint", "keep_last", 1, logging.INFO),
])
def test_a_change_a_resume_applies_is_one_line(tmp_path, caplog, section, field, value, level):
    path, cfg = _checkpoint(tmp_path, data={"eod_id": 0})
    assert _check(path, cfg, caplog) == []
    before = getattr(getattr(cfg, section), field)
    assert _check(path, _changed(cfg, section, **{field: value}), caplog) == [
        (level, f"resume from {path}: {section}.{field} changed from {before!r} to {value!r}; "
                "in effect from step 5")]


def test_a_start_from_another_runs_weights_names_each_changed_model_setting(tmp_path, caplog):
    """checkpoint.load with load_optimizer=false: before, a checkpoint trained at iterations=6
    loaded into a run of iterations=3 without a word (a resume logs each change)."""
    from megaloop.training.checkpoint import CheckpointError

    path, cfg = _checkpoint(tmp_path, model={"iterations": 6, "init_std": 0.02})
    fresh = _changed(_changed(cfg, "checkpoint", load=str(path), load_optimizer=False),
                     "train", out_dir=str(tmp_path / "new"), clip_grad=0.5)  # train: its own
    assert _check(path, fresh, caplog) == []
    where = f"start from the weights of {path}: model"
    assert _check(path, _changed(fresh, "model", iterations=3, init_std=0.5), caplog) == [
        (logging.WARNING, f"{where}.iterations changed from 6 to 3; this run's value applies"),
        (logging.INFO, f"{where}.init_std changed from 0.02 to 0.5; no effect (it initialises "
                       "weights, and these come from the checkpoint)")]
    with pytest.raises(CheckpointError, match="different architecture: model.hidden_size"):
        _check(path, _changed(fresh, "model", hidden_size=64), caplog)


def test_check_resume_without_report_refuses_alike_and_logs_nothing(tmp_path, caplog):
    """megaloop.gsm8k checks a rerun before writing anything; its trainer logs the changes. Before:
    it silenced the megaloop.train logger around the trainer's checks, repeated there."""
    from megaloop.config import ConfigError
    from megaloop.training.resume import check_resume

    path, cfg = _checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        assert check_resume(path, _changed(cfg, "train", clip_grad=0.5),
                            report=False) == (False, ())
        with pytest.raises(ConfigError, match="^model.init_std=0.5: differs"):
            check_resume(path, _changed(cfg, "model", init_std=0.5), report=False)
    assert not caplog.records


@pytest.mark.parametrize("sections, section, values, named", [
    ({}, "model", {"init_std": 0.5}, "model.init_std=0.5"),
    ({}, "checkpoint", {"load": "/runs/base"}, "checkpoint.load='/runs/base'"),
    ({}, "checkpoint", {"load_optimizer": False}, "checkpoint.load_optimizer=False"),
    ({"train": {"use_alrs": True}}, "train", {"use_alrs": False}, "train.use_alrs=False"),
    ({"train": {"use_alrs": True}}, "alrs", {"mode": "uniform"}, "alrs.mode='uniform'"),
    ({"train": {"use_alrs": True}}, "alrs", {"exclude": ("router",)}, "alrs.exclude=['router']"),
    # The allocation window of 100 steps ends at step 20: the saved multipliers are frozen.
    ({"train": {"use_alrs": True}}, "alrs", {"s2": 3.0}, "alrs.s2=3.0"),
    ({"train": {"use_alrs": True}}, "alrs", {"transition": 10}, "alrs.transition=10"),
    ({"train": {"use_alrs": True}, "alrs": {"mode": "decoder_boost"}}, "alrs",
     {"decoder_boost": 3.0}, "alrs.decoder_boost=3.0"),
    ({}, "train", {"use_alrs": True}, "train.use_alrs=True"),  # no allocation step left
])
def test_a_change_a_resume_cannot_apply_is_refused_in_one_line(tmp_path, caplog, sections,
                                                               section, values, named):
    from megaloop.config import ConfigError

    path, cfg = _checkpoint(tmp_path, **sections)
    with pytest.raises(ConfigError) as error:
        _check(path, _changed(cfg, section, **values), caplog)
    message = str(error.value)
    assert message.startswith(f"{named}: differs from ") and "\n" not in message
    assert f"in {path / 'config.yaml'}, and a resume cannot apply it (" in message
    assert not caplog.records  # nothing logged as if applied before the refusal


def test_log_eigenvalues_is_refused_up_front_while_the_runs_alrs_log_was_written_otherwise(
        tmp_path, caplog):
    """Before: logged as in effect, then refused by the ALRS log after the model build."""
    from megaloop.alrs.log import RUN_LOG, ALRSLog
    from megaloop.config import ConfigError

    path, cfg = _checkpoint(tmp_path, train={"use_alrs": True, "train_steps": 1000})
    on = _changed(cfg, "alrs", log_eigenvalues=True)
    applied = [(logging.INFO, f"resume from {path}: alrs.log_eigenvalues changed from False to "
                              "True; in effect from step 5")]
    assert _check(path, on, caplog) == applied  # no log yet: the run's first one stores them
    ALRSLog(tmp_path / RUN_LOG, ["w"], [(2, 2)], ["w"], log_eigenvalues=False)
    with pytest.raises(ConfigError) as error:
        _check(path, on, caplog)
    assert str(error.value) == (
        f"alrs.log_eigenvalues=True: differs from False in {path / 'config.yaml'}, and a resume "
        f"cannot apply it (the ALRS log {tmp_path / RUN_LOG} holds eigenvalues for no analysis, "
        "which cannot change within it; another train.out_dir starts a new log); set it back, "
        "or start a new run")
    moved = _changed(on, "train", out_dir=str(tmp_path / "new"))  # a new log there
    assert [line for _, line in _check(path, moved, caplog)][-1] == applied[0][1]


def test_a_resume_may_move_legacy_data_from_its_eod_id_to_the_legacy_tokenizer(tmp_path, caplog):
    """data.legacy_tokenizer changes the EOD id, as data.eod_id does: the data checks compare it
    with the data on every start, so a resume applies it (one line per change) and does not pin
    the workaround a run started with."""
    path, cfg = _checkpoint(tmp_path, data={"eod_id": 32002})
    legacy = _changed(cfg, "data", eod_id=None, tokenizer_model="tok.model", legacy_tokenizer=True)
    assert _check(path, legacy, caplog) == [
        (logging.WARNING, f"resume from {path}: data.{name} changed from {old!r} to {new!r}; "
                          "in effect from step 5")
        for name, old, new in (("tokenizer_model", None, "tok.model"),
                               ("legacy_tokenizer", False, True), ("eod_id", 32002, None))]


def test_fewer_steps_than_the_checkpoint_has_taken_are_refused(tmp_path, caplog):
    from megaloop.config import ConfigError

    path, cfg = _checkpoint(tmp_path, train={"train_steps": 8})
    # Before the fix: no step run, exit 0.
    with pytest.raises(ConfigError, match=r"^train.train_steps=3: .*iter_0000004 is at step 4 "
                                          r"already; a resume trains up to train.train_steps "
                                          r"\(give 4 or more\)$"):
        _check(path, _changed(cfg, "train", train_steps=3), caplog)


def test_a_finished_run_relaunched_is_complete_and_names_what_it_did_not_apply(tmp_path,
                                                                              caplog):
    from megaloop.config import ConfigError
    from megaloop.training.resume import check_resume

    path, cfg = _checkpoint(tmp_path, train={"train_steps": 4})
    done = f"{path}: the run is complete at step 4 (train.train_steps=4): nothing to train"
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        assert check_resume(path, cfg) == (True, ())
        # A change a resume would apply is named as not applied: nothing runs.
        assert check_resume(path, _changed(cfg, "model", rotary_base=5e5)) == (True, ())
        assert check_resume(path, _changed(cfg, "train", train_steps=5)) == (False, ())
        # One no resume could apply is refused even here: the relaunch is not the run asked for.
        with pytest.raises(ConfigError, match="model.init_std=0.5: differs"):
            check_resume(path, _changed(cfg, "model", init_std=0.5))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"{done} (raise train.train_steps to continue it)"),
        (logging.WARNING, f"{done} (raise train.train_steps to continue it); changed settings "
                          "not applied: model.rotary_base")]  # train_steps: resume_schedule's
    # Another run's checkpoint, continued with its optimizer, is copied as this run's step 4.
    elsewhere = _changed(cfg, "checkpoint", dir=str(tmp_path / "new"), load=str(path))
    assert check_resume(path, elsewhere) == (False, ())


def test_alrs_options_apply_at_the_next_allocation_while_alrs_allocates(tmp_path, caplog):
    # 1000 steps: ALRS allocates every 100 steps up to step 200.
    path, cfg = _checkpoint(tmp_path, train={"use_alrs": True, "train_steps": 1000})
    assert _check(path, _changed(cfg, "alrs", s2=3.0), caplog) == [
        (logging.WARNING, f"resume from {path}: alrs.s2 changed from 5.0 to 3.0; in effect from "
                          "ALRS's next allocation, at step 100")]
    path, cfg = _checkpoint(tmp_path / "off", train={"train_steps": 1000})
    assert _check(path, _changed(cfg, "train", use_alrs=True), caplog) == [
        (logging.WARNING, f"resume from {path}: train.use_alrs changed from False to True; in "
                          "effect from ALRS's next allocation, at step 100")]


@pytest.mark.parametrize("mode, embedding_head, field, old, new", [
    ("uniform", "pin_s2", "s2", 5.0, 3.0), ("decoder_boost", "pin_s2", "transition", 50, 10),
    ("alrs", "pin_s2", "decoder_boost", 2.0, 4.0),
    ("alrs", "include", "embedding_head_prefixes", ["embedding.", "output_layer."], ["emb."]),
])
def test_a_changed_alrs_option_the_mode_does_not_read_is_noted_without_effect(
        tmp_path, caplog, mode, embedding_head, field, old, new):
    """One config serves both arms of a comparison. Before: s2 changed for a uniform run was
    refused ("ALRS allocates no more"), decoder_boost changed for an alrs run said "in effect"."""
    path, cfg = _checkpoint(tmp_path, train={"use_alrs": True, "train_steps": 1000},
                            alrs={"mode": mode, "embedding_head": embedding_head})
    assert _check(path, _changed(cfg, "alrs", **{field: new}), caplog) == [
        (logging.INFO, f"resume from {path}: alrs.{field} changed from {old!r} to {new!r}; "
                       f"alrs.mode={mode!r}"
                       + (" with alrs.embedding_head='include'" if embedding_head == "include"
                          else "") + " does not read it (no effect on this run)")]


@pytest.mark.parametrize("mode, steps, line", [
    ("alrs", 5000, "ALRS allocates up to alrs.fraction x train.train_steps = 1000 (was 200); next "
                   "allocation at step 100"),
    ("alrs", 10, "ALRS allocates up to alrs.fraction x train.train_steps = 2 (was 200); none is "
                 "left: the multipliers saved in the checkpoint hold"),
    ("uniform", 5000, None),  # no allocations to move
])
def test_a_changed_train_steps_names_where_alrs_allocations_now_end(tmp_path, caplog, mode, steps,
                                                                     line):
    """The window is a fraction of train_steps. Before, a longer run reopened allocations after
    the freeze, and a shorter one froze them, with only the LR schedule's note."""
    path, cfg = _checkpoint(tmp_path, train={"use_alrs": True, "train_steps": 1000},
                            alrs={"mode": mode})
    changed = _changed(cfg, "train", train_steps=steps)
    assert _check(path, changed, caplog) == ([(logging.WARNING, f"resume from {path}: {line}")]
                                             if line else [])


def test_latentloop_residual_scale_init_applies_only_to_fixed_scales(tmp_path, caplog):
    from megaloop.config import ConfigError

    model = {"arch": "latentloop", "num_layers": 4, "iterations": 2, "encoder_layers": None,
             "prelude_layers": 1, "coda_layers": 1, "num_experts": 4, "moe_ffn_hidden_size": 16}
    path, cfg = _checkpoint(tmp_path, model={**model, "residual_scale": "fixed"})
    assert _check(path, _changed(cfg, "model", residual_scale_init=[0.5, 1.0]), caplog)[0][0] \
        == logging.WARNING
    path, cfg = _checkpoint(tmp_path / "learned", model={**model, "residual_scale": "learned"})
    with pytest.raises(ConfigError, match="learned residual scales are weights"):
        _check(path, _changed(cfg, "model", residual_scale_init=[0.5, 1.0]), caplog)


def test_latentloop_iterations_are_refused_before_the_model_is_built(tmp_path, caplog):
    """LatentLoop runs exactly its own number of visits (ModelConfig.depth_refusal): before the
    fix a changed model.iterations was logged as applied, then the load failed after the model
    build with a 7,000-character list of state-dict keys."""
    from megaloop.config import ConfigError

    model = {"arch": "latentloop", "num_layers": 4, "iterations": 2, "encoder_layers": None,
             "prelude_layers": 1, "coda_layers": 1}
    path, cfg = _checkpoint(tmp_path, model=model)
    with pytest.raises(ConfigError) as error:
        _check(path, _changed(cfg, "model", iterations=3), caplog)
    message = str(error.value)
    assert message.startswith("model.iterations=3: differs from 2 in ") and "\n" not in message
    assert "arch=latentloop runs exactly its iterations=2 visits" in message
    assert not caplog.records
    # Nor does a new run start from its weights at another depth. Before: a warning ("this
    # run's value applies"), then fewer visits dropped the others' weights without a word, and
    # more failed after the model build with a 2,000-character list of state-dict keys.
    fresh = _changed(cfg, "checkpoint", load=str(path), load_optimizer=False)
    fresh.train.out_dir = str(tmp_path / "new")
    for iterations in (1, 3):
        with pytest.raises(ConfigError) as error:
            _check(path, _changed(fresh, "model", iterations=iterations), caplog)
        assert str(error.value) == (
            f"model.iterations={iterations}: differs from 2 in {path / 'config.yaml'}, whose "
            "weights this run starts from (arch=latentloop runs exactly its iterations=2 visits "
            "(each has its own scales)); set it back, or start from a checkpoint of this depth")
    # The looped models run any depth: there the change applies from the next step.
    path, cfg = _checkpoint(tmp_path / "fullloop", model={"arch": "fullloop", "iterations": 2,
                                                          "encoder_layers": None})
    assert _check(path, _changed(cfg, "model", iterations=4), caplog) == [
        (logging.WARNING, f"resume from {path}: model.iterations changed from 2 to 4; in effect "
                          "from step 5")]


def test_another_runs_checkpoint_is_compared_whole_only_when_its_optimizer_state_is_loaded(
        tmp_path, caplog):
    path, cfg = _checkpoint(tmp_path)
    elsewhere = _changed(cfg, "checkpoint", dir=str(tmp_path / "new"), load=str(path),
                         load_optimizer=False)
    elsewhere.model.init_std = 0.5
    # A new run from the weights: only its model settings are compared, each noted.
    assert _check(path, elsewhere, caplog) == [
        (logging.INFO, f"start from the weights of {path}: model.init_std changed from 0.02 to "
                       "0.5; no effect (it initialises weights, and these come from the "
                       "checkpoint)")]
    elsewhere.checkpoint.load_optimizer = True
    elsewhere.model.init_std = cfg.model.init_std
    elsewhere.train.clip_grad = 0.5
    assert [m for _, m in _check(path, elsewhere, caplog)] == [
        f"resume from {path}: train.clip_grad changed from 1.0 to 0.5; in effect from step 5"]


def test_a_changed_setting_is_checked_before_the_model_is_built(run_stopped_at_step_4,
                                                                pattern_data, tmp_path, caplog):
    from megaloop.config import ConfigError

    out = _copy(run_stopped_at_step_4, tmp_path)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        Trainer(tiny_run(pattern_data, out, train={"clip_grad": 0.5})).close()
    assert [r.getMessage() for r in caplog.records] == [
        f"resume from {out / 'checkpoints' / 'iter_0000004'}: train.clip_grad changed from 1.0 "
        "to 0.5; in effect from step 5"]
    with pytest.raises(ConfigError, match=r"^model.init_std=0.5: differs from 0.02 in "):
        Trainer(tiny_run(pattern_data, out, model={"init_std": 0.5}))


def _check_where_rank0_sees_another_checkpoint(rank, world_size, root):
    """Each rank's own copy of the 'same' run, as without a shared filesystem: rank 0's config
    differs in a setting no resume applies."""
    from pathlib import Path

    from megaloop.config import ConfigError
    from megaloop.training.resume import check_resume

    path, cfg = _checkpoint(Path(root) / f"rank{rank}", model={"init_std": 0.5 if rank else 0.02})
    cfg.model.init_std = 0.5
    try:
        return check_resume(path, cfg)
    except ConfigError as e:
        return str(e)


def test_every_rank_takes_rank_zeros_verdict_on_a_resume(tmp_path):
    """Before: each rank decided alone, and rank 0 raised while rank 1 went on into the next
    collective, where it waited for rank 0 until the process-group timeout."""
    from tests.distributed import run_distributed

    verdicts = run_distributed(_check_where_rank0_sees_another_checkpoint, world_size=2,
                               root=str(tmp_path))
    assert verdicts[0] == verdicts[1]
    assert verdicts[0].startswith(f"model.init_std=0.5: differs from 0.02 in {tmp_path / 'rank0'}")


def test_a_changed_optimizer_format_reads_the_checkpoint_in_its_own(run_stopped_at_step_4,
                                                                    pattern_data, tmp_path):
    """checkpoint.optimizer_format is that of the saves from the resume on. Before: the resume
    read the dp_reshardable checkpoint as fully_reshardable, a CheckpointError holding
    megatron-core's list of every missing key."""
    from megaloop.training.checkpoint import saved_config
    from tests.training.conftest import train_losses

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    same, changed = _copy(run_stopped_at_step_4, tmp_path / "a"), _copy(run_stopped_at_step_4,
                                                                        tmp_path / "b")
    Trainer(tiny_run(pattern_data, same)).train()
    Trainer(tiny_run(pattern_data, changed,
                     checkpoint={"optimizer_format": "fully_reshardable"})).train()
    assert train_losses(changed) == train_losses(same)
    saved = saved_config(changed / "checkpoints" / "iter_0000008")
    assert saved["checkpoint"]["optimizer_format"] == "fully_reshardable"
