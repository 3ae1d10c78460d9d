"""train.profile: the steps asked for are traced (a Chrome trace whose ProfilerStep#N are those
training steps, and an operator table), atomically; a range the run never reaches, or a rank it
does not have, is said in one line rather than tracing nothing without a word."""

import dataclasses
import gzip
import json
import logging
import re
import signal

import pytest

from megaloop.config import ConfigError, ProfileConfig
from megaloop.training.trainer import Trainer
from tests.training.conftest import one_line, tiny_run


def profiled(pattern_data, tmp_path, steps, train_steps=4, **settings):
    cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": train_steps})
    cfg.train.profile = ProfileConfig(steps=steps, **settings)
    return cfg


def traced_steps(trace_file) -> list[int]:
    events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    return sorted({int(m.group(1)) for e in events
                   if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", "")))})


def test_the_steps_asked_for_are_traced(pattern_data, tmp_path, caplog):
    cfg = profiled(pattern_data, tmp_path, [2, 3])
    with caplog.at_level(logging.INFO, "megaloop.train"):
        assert Trainer(cfg).train()["step"] == 4
    profile = tmp_path / "run" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank0_steps2-3.ops.txt",
                                                         "rank0_steps2-3.trace.json.gz"]
    # Step 1 warms the profiler up and step 4 comes after the range: neither is in the trace.
    assert traced_steps(profile / "rank0_steps2-3.trace.json.gz") == [2, 3]
    table = (profile / "rank0_steps2-3.ops.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    assert any("steps 2-3 traced" in r.getMessage() for r in caplog.records)


def test_a_stop_signal_writes_the_steps_traced_so_far(pattern_data, tmp_path):
    """A run stopped (SIGTERM, SLURM preemption) inside the range writes the steps it ran."""
    cfg = profiled(pattern_data, tmp_path, [1, 4], train_steps=4)
    trainer = Trainer(cfg)
    step = trainer.train_step

    def signalled_during_step_2(data):
        outcome = step(data)
        if trainer.step == 2:
            trainer.stop_signals.received = signal.SIGTERM
        return outcome

    trainer.train_step = signalled_during_step_2
    assert trainer.train()["stopped_by_signal"] == signal.SIGTERM and trainer.step == 2
    [trace] = (tmp_path / "run" / "profile").glob("*.trace.json.gz")
    assert trace.name == "rank0_steps1-2.trace.json.gz" and traced_steps(trace) == [1, 2]


def test_a_resume_past_the_range_says_nothing_is_traced(pattern_data, tmp_path, caplog):
    cfg = profiled(pattern_data, tmp_path, [1, 2], train_steps=2)
    cfg.train.profile = ProfileConfig()
    Trainer(cfg).train()
    resumed = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, train_steps=3, profile=ProfileConfig(steps=[1, 2])))
    with caplog.at_level(logging.WARNING, "megaloop.train"):
        Trainer(resumed).train()
    assert any("train.profile.steps=[1, 2]: the run resumes after step 2, so nothing is traced"
               in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "run" / "profile").exists()


def test_a_rank_the_run_has_not_is_one_line_before_the_datasets(pattern_data, tmp_path,
                                                                 monkeypatch):
    import megaloop.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "build_datasets",
                        lambda *a: pytest.fail("datasets built before the refusal"))
    cfg = profiled(pattern_data, tmp_path, [1, 2], ranks=[0, 3])
    with pytest.raises(ConfigError) as error:
        Trainer(cfg)
    assert one_line(error) == ("train.profile.ranks=[0, 3]: rank 3 is not in this run of 1 "
                               "rank(s)")


@pytest.mark.parametrize("settings, message", [
    ({"steps": [3, 2]}, "train.profile.steps=[3, 2]: must be [first, last] with 1 <= first <= "
                        "last <= train.train_steps=4"),
    ({"steps": [0, 2]}, "train.profile.steps=[0, 2]"),
    ({"steps": [2, 5]}, "train.profile.steps=[2, 5]"),
    ({"steps": [2]}, "train.profile.steps=[2]"),
    ({"steps": [1, 2], "ranks": []}, "train.profile.ranks=[]: must be a list of distinct"),
    ({"steps": [1, 2], "ranks": [0, 0]}, "train.profile.ranks=[0, 0]"),
    ({"steps": [1, 2], "ranks": [-1]}, "train.profile.ranks=[-1]"),
    # Off (no steps) with another field set: the field would be ignored.
    ({"memory": True}, "train.profile.steps=[]: must be [first, last] (the steps to trace) when "
                       "train.profile.memory is set"),
    ({"ranks": [1]}, "train.profile.steps=[]"),
])
def test_bad_settings_are_one_line(pattern_data, tmp_path, settings, message):
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 4})
    cfg.train.profile = ProfileConfig(**settings)
    with pytest.raises(ConfigError) as error:
        cfg.validate()
    assert one_line(error).startswith(message)
