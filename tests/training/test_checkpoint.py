"""Checkpoints a user can trust: a failed save never moves `latest`, damaged or unpointed
checkpoints are found before the model is built and named in one line, nothing is overwritten, and
what is written can be read by teammates."""

import errno
import logging
import os
import shutil
import stat

import pytest

from megaloop.config import ConfigError, RunConfig, save_yaml
from megaloop.training import checkpoint as ckpt
from megaloop.training import checkpoint_save
from megaloop.training.trainer import Trainer
from tests.training.conftest import one_line, resume_from, tiny_run, train_losses

STEPS = 4


def _cfg(data, out, **checkpoint):
    return tiny_run(data, out, train={"train_steps": STEPS},
                    checkpoint={"save_interval": 2, **checkpoint})


@pytest.fixture(scope="module")
def saved_run(mcore, pattern_data, tmp_path_factory):
    """A finished run with complete checkpoints at steps 2 and 4 (`latest` on 4)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    Trainer(_cfg(pattern_data, out)).train()
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _no_model(monkeypatch):
    import megaloop.models.model as model_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(model_module, "LoopedLM", refuse)


# ----------------------------------------------------------------------- atomic `latest` (13.5)

def _fail_rename_of_a_checkpoint(monkeypatch):
    """os.replace of `iter_N.tmp` -> `iter_N` fails (other renames, such as the temporary file
    of an atomic write, go through)."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(src).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint_save.os, "replace", replace)


def _fail_pointer_move(monkeypatch):
    real = checkpoint_save.write_text_atomic

    def write(path, text):
        if os.path.basename(path) == ckpt.LATEST:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, text)

    monkeypatch.setattr(checkpoint_save, "write_text_atomic", write)


@pytest.mark.parametrize("inject", [_fail_rename_of_a_checkpoint, _fail_pointer_move],
                         ids=["rename_fails", "pointer_move_fails"])
def test_a_failed_second_save_resumes_exactly_from_the_first(saved_run, pattern_data, tmp_path,
                                                             monkeypatch, inject):
    out = tmp_path / "run"
    trainer = Trainer(_cfg(pattern_data, out))
    save = trainer.save

    def save_then_break(*args, **kwargs):  # the first save (step 2) works, the next fails
        path = save(*args, **kwargs)
        inject(monkeypatch)
        return path

    trainer.save = save_then_break
    with pytest.raises(ckpt.CheckpointError) as error:
        trainer.train()
    message = one_line(error)
    assert str(out / "checkpoints") in message and "iter_0000002" in message, message
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(out / "checkpoints").name == "iter_0000002"
    resumed = Trainer(_cfg(pattern_data, out))
    assert resumed.step == 2
    resumed.train()
    expected, got = train_losses(saved_run), train_losses(out)
    assert [got[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]
    assert ckpt.latest_checkpoint(out / "checkpoints").name == "iter_0000004"


def test_the_next_save_removes_what_a_killed_pointer_move_left(saved_run, pattern_data,
                                                               tmp_path):
    """A process killed between writing the new `latest` and renaming it over the old one leaves
    the temporary file; the next save removes it, and nothing that only looks like one."""
    out = _copy(saved_run, tmp_path)
    checkpoints = out / "checkpoints"
    stale = checkpoints / ".latest-4242-0123abcd"
    others = [".latest-4242-0123abc", ".latest-4242-0123ABCD", ".latest-x-0123abcd",
              ".latest-4242-0123abcd.bak", "latest-4242-0123abcd", ".config.yaml-4242-0123abcd"]
    for name in [stale.name, *others]:
        (checkpoints / name).write_text("iter_0000002\n")
    Trainer(tiny_run(pattern_data, out, train={"train_steps": STEPS + 2},
                     checkpoint={"save_interval": 2})).train()
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000006"
    assert not stale.exists()
    assert [name for name in others if not (checkpoints / name).exists()] == []


def _mount_tmpfs(directory, size_bytes):
    import subprocess

    directory.mkdir(parents=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                             str(directory)], capture_output=True)
    if result.returncode != 0:
        pytest.skip("needs permission to mount a small tmpfs (a real full disk)")


def _unmount(directory):
    """dist_checkpointing's writer process may still be closing its files for a moment."""
    import subprocess
    import time

    for _ in range(20):
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode == 0:
            return
        time.sleep(0.25)
    subprocess.run(["umount", "--lazy", str(directory)], check=True)


def test_a_full_disk_at_save_time_is_one_line_naming_the_path(saved_run, pattern_data, tmp_path):
    one_checkpoint = sum(f.stat().st_size for f in (saved_run / "checkpoints" /
                                                    "iter_0000004").iterdir())
    disk = tmp_path / "small_disk"
    _mount_tmpfs(disk, int(1.5 * one_checkpoint))  # room for the first checkpoint, not a second
    try:
        cfg = _cfg(pattern_data, tmp_path / "run", dir=str(disk))
        with pytest.raises(ckpt.CheckpointError) as error:
            Trainer(cfg).train()
        message = one_line(error)
        # torch's writer reports ENOSPC in its own words ("unexpected pos"): the free space says it.
        assert message.startswith(f"{disk}/iter_0000004.tmp: saving step 4 failed"), message
        assert "free on its filesystem" in message
        assert "latest is still iter_0000002" in message
        assert ckpt.latest_checkpoint(disk).name == "iter_0000002"
        assert not (disk / "iter_0000004.tmp").exists(), "the failed save's files are removed"
    finally:
        _unmount(disk)


def test_a_background_write_that_fails_ends_the_run_in_one_line(saved_run, pattern_data,
                                                                 tmp_path):
    """checkpoint.async_save: the full disk fails the write of step 4 in the background (step
    4's common.pt, written before, fits); the run ends at its next step, status 2."""
    import subprocess
    import sys

    from tests.training.process_groups import script_env

    one_checkpoint = sum(f.stat().st_size for f in (saved_run / "checkpoints" /
                                                    "iter_0000004").iterdir())
    disk = tmp_path / "small_disk"
    _mount_tmpfs(disk, int(1.5 * one_checkpoint))
    try:
        cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 8},
                       checkpoint={"save_interval": 2, "async_save": True, "dir": str(disk)})
        save_yaml(cfg, tmp_path / "run.yaml")
        run = subprocess.run([sys.executable, "-m", "megaloop.train", "--config",
                              str(tmp_path / "run.yaml")], env=script_env(), capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 2, run.stderr[-2000:]
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert errors[0].startswith(f"error: {disk}/iter_0000004.tmp: saving step 4 failed in "
                                    "its background write ("), errors[0]
        assert errors[0].endswith("free on its filesystem); latest is still iter_0000002")
        assert ckpt.latest_checkpoint(disk).name == "iter_0000002"
        assert not (disk / "iter_0000004.tmp").exists(), "the failed save's files are removed"
        # Found by a step's poll, or by the next save's wait at the latest.
        assert max(train_losses(tmp_path / "run")) in (5, 6)
    finally:
        _unmount(disk)


# ----------------------------------------------------------------------- damaged checkpoints

def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("name, damage", [
    ("__0_0.distcp", _truncate), ("__0_0.distcp", os.remove),
    (".metadata", _truncate), (".metadata", os.remove),
    ("common.pt", _truncate), ("common.pt", os.remove),
    ("metadata.json", os.remove), ("config.yaml", os.remove),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(saved_run, pattern_data, tmp_path,
                                                          monkeypatch, name, damage):
    out = _copy(saved_run, tmp_path)
    damaged = out / "checkpoints" / "iter_0000004" / name
    damage(damaged)
    _no_model(monkeypatch)
    with pytest.raises(ckpt.CheckpointError) as error:
        Trainer(_cfg(pattern_data, out))
    message = one_line(error)
    assert message.startswith(str(damaged)), message
    assert "checkpoint.fallback_to_previous=true resumes from iter_0000002" in message


@pytest.mark.parametrize("damage", [_truncate, os.remove], ids=["truncated", "removed"])
def test_a_damaged_index_read_for_the_rng_entrys_kind_is_one_line_naming_it(saved_run, tmp_path,
                                                                           damage):
    from megaloop.training.checkpoint_state import rng_saved_by_expert_rank

    path = _copy(saved_run, tmp_path) / "checkpoints" / "iter_0000004"
    assert rng_saved_by_expert_rank(path) is False  # saved without expert parallelism
    damage(path / ".metadata")
    # Read before load_checkpoint on an expert-parallel resume; before the fix megatron-core's
    # or pickle's traceback (EOFError, FileNotFoundError).
    with pytest.raises(ckpt.CheckpointError) as error:
        rng_saved_by_expert_rank(path)
    message = one_line(error)
    assert message.startswith(f"{path / '.metadata'}: missing or unreadable ("), message


@pytest.mark.parametrize("content, reason", [
    (b"model: [1, 2\nparallel: {}\n", r"invalid YAML at line 2, column 9: expected ',' or ']', "
                                        r"but got ':'"),
    (b"", "no model and parallel sections"), (b"- 1\n", "no model and parallel sections"),
    (b"model: {}\n", "no model and parallel sections"), (b"\xff\xfe", "not UTF-8 text"),
])
def test_a_damaged_checkpoint_config_is_one_line_saying_what_is_wrong(tmp_path, content, reason):
    config = tmp_path / "iter_0000001" / "config.yaml"
    config.parent.mkdir()
    config.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.saved_config(config.parent)
    # Before: YAML's message over six lines; "'NoneType' object has no attribute 'get'".
    message = str(error.value)
    assert message.startswith(f"{config}: unreadable checkpoint config ({reason}")
    assert "\n" not in message


def test_fallback_resumes_from_the_previous_complete_checkpoint(saved_run, pattern_data,
                                                                tmp_path, caplog):
    out = _copy(saved_run, tmp_path)
    checkpoints = out / "checkpoints"
    shard = checkpoints / "iter_0000004" / "__0_0.distcp"
    _truncate(shard)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        trainer = Trainer(_cfg(pattern_data, out, fallback_to_previous=True))
    assert trainer.step == 2
    assert any(str(shard) in r.message and "resuming from iter_0000002" in r.message
               for r in caplog.records), caplog.text
    set_aside = [p.name for p in checkpoints.iterdir() if ".damaged" in p.name]
    assert len(set_aside) == 1 and set_aside[0].startswith("iter_0000004.damaged")
    assert ckpt.latest_checkpoint(checkpoints).name == "iter_0000002"
    trainer.train()
    expected, got = train_losses(saved_run), train_losses(out)
    assert [got[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]


def test_a_directory_named_latest_is_one_line_with_fallback_too(saved_run, pattern_data,
                                                                 tmp_path):
    """Before: fallback_to_previous wrote the pointer over it, an IsADirectoryError traceback."""
    out = _copy(saved_run, tmp_path)
    pointer = out / "checkpoints" / "latest"
    pointer.unlink()
    (pointer / "notes").mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.resume_source(_cfg(pattern_data, out, fallback_to_previous=True),
                           out / "checkpoints")
    assert one_line(error).startswith(f"{pointer}: a directory where the 'latest' pointer file "
                                       "belongs")
    assert (pointer / "notes").is_dir() and (out / "checkpoints" / "iter_0000004").is_dir()


# ----------------------------------------------------------------------- lost `latest`

def test_a_lost_latest_resumes_from_the_newest_complete_checkpoint(saved_run, pattern_data,
                                                                   tmp_path, caplog):
    out = _copy(saved_run, tmp_path)
    checkpoints = out / "checkpoints"
    (checkpoints / "latest").unlink()
    shutil.copytree(checkpoints / "iter_0000004", checkpoints / "iter_0000006.tmp")  # killed
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        trainer = Trainer(tiny_run(pattern_data, out, train={"train_steps": 6},
                                   checkpoint={"save_interval": 2}))
    assert trainer.step == 4, "resumed from the newest complete checkpoint, not from scratch"
    assert "no 'latest' pointer; resuming from the newest complete checkpoint iter_0000004" \
        in caplog.text
    trainer.train()
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("iter")) == \
        ["iter_0000002", "iter_0000004", "iter_0000006"]


def test_a_directory_holding_only_an_interrupted_save_starts_over_saying_so(tmp_path, caplog):
    from megaloop.config import DataConfig

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "iter_0000002.tmp").mkdir(parents=True)  # the first save, killed
    (checkpoints / "iter_0000001.damaged-1700000000").mkdir()
    cfg = RunConfig(data=DataConfig(path=["x"], eod_id=0))
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        assert ckpt.resume_source(cfg, checkpoints) is None
    # Before the fix: a silent start from step 0.
    assert [r.getMessage() for r in caplog.records] == [
        f"{checkpoints} holds no complete checkpoint, only iter_0000001.damaged-1700000000, "
        "iter_0000002.tmp; the run starts from step 0"]


def test_resume_false_refuses_a_directory_holding_checkpoints(saved_run, pattern_data, tmp_path,
                                                               monkeypatch):
    out = _copy(saved_run, tmp_path)
    (out / "checkpoints" / "latest").unlink()
    _no_model(monkeypatch)
    with pytest.raises(ConfigError) as error:
        Trainer(_cfg(pattern_data, out, resume=False))
    assert "checkpoint.resume=false" in one_line(error) and "iter_0000004" in str(error.value)


def test_a_changed_checkpoint_dir_with_nothing_to_resume_is_refused_naming_both(
        saved_run, pattern_data, tmp_path, monkeypatch):
    """Before the fix the run started at step 0 in the old out_dir, and its metrics.jsonl was
    started over with only a "dropped N lines" notice."""
    out = _copy(saved_run, tmp_path)
    metrics = (out / "metrics.jsonl").read_bytes()
    elsewhere = tmp_path / "elsewhere"
    _no_model(monkeypatch)
    with pytest.raises(ConfigError) as error:
        Trainer(_cfg(pattern_data, out, dir=str(elsewhere)))
    assert one_line(error) == (
        f"checkpoint.dir={str(elsewhere)!r}: {elsewhere} holds no checkpoint to resume, but "
        f"train.out_dir={str(out)!r} is the run whose checkpoints are in {out / 'checkpoints'} "
        f"(newest iter_0000004; {out / 'config.yaml'}); set checkpoint.dir back to resume it, "
        "or start a new run in another train.out_dir (or in this one with "
        "checkpoint.resume=false, which starts its metrics.jsonl over)")
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert not elsewhere.exists(), "the refused set-up removes the directory it made"


def test_a_run_continued_into_another_checkpoint_dir_with_its_optimizer_keeps_its_metrics(
        saved_run, pattern_data, tmp_path):
    """checkpoint.load of the run's own checkpoints with load_optimizer=true (checkpoints moved to
    new storage mid-run) continues at the loaded step, so nothing in out_dir starts over: not
    refused. Before the fix this was refused as a changed checkpoint.dir."""
    out = _copy(saved_run, tmp_path)
    before = train_losses(out)
    elsewhere = tmp_path / "elsewhere"
    cfg = _cfg(pattern_data, out, dir=str(elsewhere), load=str(out / "checkpoints"))
    cfg.train.train_steps = STEPS + 1
    Trainer(cfg).train()
    after = train_losses(out)
    assert sorted(after) == list(range(1, STEPS + 2))
    assert {step: after[step] for step in before} == before
    assert ckpt.step_of(ckpt.latest_checkpoint(elsewhere)) == STEPS + 1
    # Another run's checkpoint, or this one's without its optimizer, would start the metrics of
    # this out_dir over or splice another run's onto them: refused as before.
    other = tmp_path / "other"
    shutil.copytree(out / "checkpoints", other)
    for load, load_optimizer in ((other, True), (elsewhere, False)):
        cfg = _cfg(pattern_data, out, dir=str(tmp_path / "third"), load=str(load),
                   load_optimizer=load_optimizer)
        with pytest.raises(ConfigError, match="holds no checkpoint to resume, but train.out_dir"):
            ckpt.resume_source(cfg, tmp_path / "third")


def test_a_new_run_with_another_checkpoint_dir_goes_ahead_when_asked_for(tmp_path):
    """checkpoint.resume=false in the same out_dir, or another out_dir: the two deliberate ways.
    The config the previous run saved in out_dir names its checkpoint directory."""
    from megaloop.config import CheckpointConfig, DataConfig, TrainConfig

    out, old, new = tmp_path / "run", tmp_path / "old", tmp_path / "new"
    (old / "iter_0000002").mkdir(parents=True)
    (old / "iter_0000002" / "config.yaml").write_text("{}")
    out.mkdir()
    save_yaml(RunConfig(checkpoint=CheckpointConfig(dir=str(old))), out / "config.yaml")

    def cfg(out_dir, **checkpoint):
        return RunConfig(data=DataConfig(path=["x"], eod_id=0),
                         train=TrainConfig(out_dir=str(out_dir)),
                         checkpoint=CheckpointConfig(dir=str(new), **checkpoint))

    with pytest.raises(ConfigError, match=f"checkpoints are in {old} "):
        ckpt.resume_source(cfg(out), new)
    assert ckpt.resume_source(cfg(out, resume=False), new) is None
    assert ckpt.resume_source(cfg(tmp_path / "another"), new) is None
    save_yaml(RunConfig(checkpoint=CheckpointConfig(dir=str(new))), out / "config.yaml")
    assert ckpt.resume_source(cfg(out), new) is None, "its own directory, still empty"


def test_a_config_yaml_in_out_dir_that_no_run_saved_names_no_previous_run(tmp_path):
    """A config the user wrote into train.out_dir (``--config <out_dir>/config.yaml``) lacks the
    sections a saved run config has: it names no checkpoint directory, so the run starts, rather
    than being refused as an unreadable checkpoint config."""
    from megaloop.config import DataConfig, TrainConfig

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("model:\n  arch: asymloop\ntrain:\n  train_steps: 10\n")
    cfg = RunConfig(data=DataConfig(path=["x"], eod_id=0), train=TrainConfig(out_dir=str(out)))
    assert ckpt.resume_source(cfg, out / "checkpoints") is None


def test_a_runs_out_dir_without_a_checkpoint_is_no_checkpoint(tmp_path):
    """Before its first save a run's out_dir holds only its config.yaml: named, it is no
    checkpoint (one line saying what was expected), not a checkpoint missing metadata.json. An
    iter_N directory missing its metadata.json is still a (damaged) checkpoint, for
    verify_checkpoint to name the file."""
    from megaloop.config import TrainConfig

    out = tmp_path / "run"
    out.mkdir()
    save_yaml(RunConfig(train=TrainConfig(out_dir=str(out))), out / "config.yaml")
    assert ckpt.named_checkpoint(out) is None
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint there \(expected an iter_N "):
        ckpt.find_checkpoint(out)
    damaged = out / "checkpoints" / "iter_0000002"
    damaged.mkdir(parents=True)
    save_yaml(RunConfig(), damaged / "config.yaml")
    assert ckpt.named_checkpoint(damaged) == damaged


@pytest.mark.parametrize("content, reason", [
    (b"\xff\xfeiter\n", "not UTF-8 text"), (b" \n", "empty"),
    (b"iter_0000001\ngarbage\n", "holds 'iter_0000001\\ngarbage', not a checkpoint name"),
    (b"x" * 500, "holds 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...', not a checkpoint name"),
])
def test_an_unreadable_latest_is_one_line_naming_it_for_every_reader(tmp_path, content, reason):
    """Before: a UnicodeDecodeError traceback from each reader of a non-UTF-8 ``latest``."""
    from megaloop.config import CheckpointConfig, TrainConfig

    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    (checkpoints / "iter_0000001").mkdir(parents=True)
    save_yaml(RunConfig(train=TrainConfig(out_dir=str(out))), out / "config.yaml")
    save_yaml(RunConfig(), checkpoints / "iter_0000001" / "config.yaml")
    pointer = checkpoints / "latest"
    pointer.write_bytes(content)
    elsewhere = RunConfig(train=TrainConfig(out_dir=str(tmp_path / "new")),
                          checkpoint=CheckpointConfig(load=str(checkpoints)))
    readers = {  # api.load, export and evaluation find their checkpoint as find_checkpoint does
        "find_checkpoint": lambda: ckpt.find_checkpoint(checkpoints),
        "find_checkpoint of out_dir": lambda: ckpt.find_checkpoint(out),
        "resume": lambda: ckpt.resume_source(RunConfig(train=TrainConfig(out_dir=str(out))),
                                             checkpoints),
        "checkpoint.load": lambda: ckpt.resume_source(elsewhere, tmp_path / "new" / "ckpts"),
    }
    for reader, read in readers.items():
        with pytest.raises(ckpt.CheckpointError) as error:
            read()
        assert one_line(error).startswith(f"{pointer}: {reason}"), reader


# ----------------------------------------------------------------------- permissions

def test_latest_and_config_are_readable_by_others_like_the_shards(saved_run, pattern_data,
                                                                  tmp_path):
    previous = os.umask(0o022)
    try:
        Trainer(tiny_run(pattern_data, tmp_path, train={"train_steps": 1})).train()
    finally:
        os.umask(previous)
    checkpoint = tmp_path / "checkpoints" / "iter_0000001"

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(checkpoint / "__0_0.distcp") == 0o644
    for path in (tmp_path / "checkpoints" / "latest", checkpoint / "config.yaml"):
        assert mode(path) == 0o644, path


# ----------------------------------------------------------------------- seed checkpoints

def _weights_and_adam_state(trainer) -> dict:
    state = {f"w.{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()
             if hasattr(v, "is_floating_point") and v.is_floating_point()}
    for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for i, param_state in enumerate(inner.optimizer.state.values()):
            state.update({f"adam{i}.{k}": v.detach().clone() for k, v in param_state.items()})
    return state


def test_a_seed_checkpoint_changes_nothing_in_the_training_after_it(mcore, pattern_data, tmp_path):
    """Saving at step 0 materialises the optimizer state by a dummy step; without warmup the
    scheduler's LR at step 0 is the peak LR, and that step must still move no weight (decoupled
    weight decay) and count no step (Adam's bias correction): the run that saved a seed, and a run
    resumed from that seed, end bit-exactly where the run without a seed ends."""
    import torch

    def cfg(name):
        return tiny_run(pattern_data, tmp_path / name,
                        train={"train_steps": 2, "warmup_fraction": 0.0})

    plain = Trainer(cfg("plain"))
    plain.train()
    seeded = Trainer(cfg("seeded"))
    seeded.save()
    seeded.train()
    resume_from(tmp_path / "seeded", tmp_path / "resumed", 0)
    resumed = Trainer(cfg("resumed"))
    resumed.train()
    expected = _weights_and_adam_state(plain)
    assert any(k.endswith(".step") for k in expected)
    for trainer in (seeded, resumed):
        got = _weights_and_adam_state(trainer)
        assert got.keys() == expected.keys()
        assert [k for k in got if not torch.equal(got[k], expected[k])] == []
