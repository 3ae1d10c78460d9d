"""Layout parity through megaloop.scale.loss_compare: sequence parallelism trains to the tensor-
parallel losses, recomputation changes no bit, 4-rank combinations train to the single-process
losses; and the comparison itself catches what it must."""

import pytest

from megaloop.scale.loss_compare import compare_curves
from tests.data.conftest import SP_MODEL
from tests.scale.layouts import layout_curves
from tests.training.conftest import tiny_run, write_pattern_dataset

STEPS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Curves of the tiny AsymLoop run config under the given layouts, from one seed."""
    root = tmp_path_factory.mktemp("layouts")
    data = write_pattern_dataset(root / "pattern")
    cfg = tiny_run(data, root / "unused", train={"train_steps": STEPS, "global_batch_size": 8})
    runs = iter(range(100))
    return lambda *layouts: layout_curves(cfg, layouts, root / str(next(runs)), STEPS)


def test_sequence_parallel_trains_to_the_tensor_parallel_losses(mcore, run):
    # tp2 is the reference; "tp2,sp,recompute" and "tp2,sp,selrecompute" must equal "tp2,sp"
    # bit for bit at step 1.
    assert compare_curves(run("tp2", "tp2,sp", "tp2,sp,recompute", "tp2,sp,selrecompute")) == []


def test_selective_recompute_across_pipeline_stages_trains_to_its_twins_losses(mcore, run):
    # The loop unrolled over 2 stages: tied decoder copies, each call replayed on its stage.
    assert compare_curves(run("pp2", "pp2,selrecompute")) == []


def test_four_rank_layouts_train_to_the_single_process_losses(mcore, run):
    # dp2,pp2: the distributed optimizer over the data-parallel ranks of each stage, whose tied
    # decoder copies' gradients are summed before the data-parallel reduce-scatter.
    assert compare_curves(run("single", "tp2,pp2", "dp2,tp2,sp", "dp2,pp2")) == []


def test_compare_curves_catches_a_difference():
    reference = {1: 5.0, 2: 4.0}
    assert compare_curves({"single": reference, "dp2": {1: 5.0, 2: 4.0 + 1e-6}}) == []
    [line] = compare_curves({"single": reference, "dp2": {1: 5.0, 2: 4.00001}})
    assert line.startswith("dp2: step 2 loss 4.00001 vs single 4.0 (must agree to rtol=1e-06")
    # Pipeline stages alone change no forward arithmetic: the first step is exact.
    [line] = compare_curves({"single": reference, "pp2": {1: 5.000000000000001, 2: 4.0}})
    assert line.startswith("pp2: step 1") and "exactly at the first step (pipeline" in line
    assert compare_curves({"single": reference, "pp2": {1: 5.0, 2: 4.000000000000001}}) == []
    # Recomputation replays the first forward: one rounding step apart is a failure there.
    [line] = compare_curves({"single": reference, "tp2": reference,
                             "tp2,recompute": {1: 5.000000000000001, 2: 4.0}})
    assert line.startswith("tp2,recompute: step 1") and "exactly" in line
    [line] = compare_curves({"single": reference, "tp2": reference,
                             "tp2,selrecompute": {1: 5.000000000000001, 2: 4.0}})
    assert line.startswith("tp2,selrecompute: step 1 loss 5.000000000000001 vs tp2 5.0")
    [line] = compare_curves({"single": reference, "pp2": {1: 5.0}})
    assert line == "pp2: steps [1] differ from single's [1, 2]"
    # A skipped step: its loss is logged null (a TypeError before), a NaN passed as agreeing.
    for loss in (None, float("nan")):
        assert compare_curves({"single": reference, "dp2": {1: 5.0, 2: loss}}) == [
            f"dp2: step 2 loss {loss!r}: a skipped (NaN/Inf) step, nothing to compare"]
        assert compare_curves({"single": {1: loss, 2: 4.0}, "dp2": reference}) == [
            f"single: step 1 loss {loss!r}: a skipped (NaN/Inf) step, nothing to compare"]


def test_loss_compare_tool_runs_each_layout_under_torchrun(tmp_path, capsys):
    import json
    import subprocess
    import sys

    import yaml

    from megaloop.cli import refuse_overrides_of
    from megaloop.config import ConfigError, save_yaml, to_dict
    from megaloop.train import build_config
    from tools import loss_compare

    data = write_pattern_dataset(tmp_path / "pattern")
    # Every setting the tool makes holds another value here, so that the layouts' configs show it.
    user = tiny_run(data, tmp_path / "unused", train={"tensorboard": True, "eval_iters": 3},
                    checkpoint={"dir": str(tmp_path / "ckpt"), "save_interval": 1,
                                "load": str(tmp_path / "ckpt"), "resume": True})
    save_yaml(user, tmp_path / "run.yaml")
    tool = [sys.executable, "tools/loss_compare.py", "--config", str(tmp_path / "run.yaml"),
            "--steps", "2", "--out", str(tmp_path / "out")]
    result = subprocess.run(tool + ["train.log_interval=100", "--layouts", "single", "pp2"],
                            capture_output=True, text=True)  # an override before an option
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # Exact at the first step only: the unrolled loop's tied copies sum their gradients in
    # another order (megaloop.scale.loss_compare); step 2 differs by a rounding step (4.8e-7).
    assert report["agree"] and report["curves"]["pp2"]["1"] == report["curves"]["single"]["1"]
    assert list(report["curves"]["single"]) == ["1", "2"]
    # Every field the tool changed in a layout's config is one whose override it refuses (an
    # override of it would have been replaced without a word).
    given, changed = to_dict(build_config(["--config", str(tmp_path / "run.yaml")])[0]), set()
    for layout in ("single", "pp2"):
        ran = yaml.safe_load((tmp_path / "out" / layout / "layout.yaml").read_text())
        changed |= {f"{section}.{name}" for section, fields in given.items()
                    for name, value in fields.items() if ran[section][name] != value}
    assert {"train.train_steps", "train.eval_iters", "checkpoint.load",
            "parallel.pipeline"} <= changed
    for key in changed:
        with pytest.raises(ConfigError, match=rf"^override '{key}=1': set by "):
            refuse_overrides_of([f"{key}=1"], loss_compare.set_by_the_tool())
    # The refusals come before any process starts, so they run in this one (each subprocess
    # would import torch and megatron-core again).
    arguments = tool[2:]
    assert loss_compare.main(arguments + ["--layouts", "single", "tp2,sp,pp8"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith("error: parallel.pipeline=8: must be such that pipeline x "
                            "virtual_pipeline = 8 stages get at least one of the model's 6 "
                            "layer applications each")
    # Before the fixes: a rerun into the same --out was a traceback (its seed checkpoint is
    # refused), one layout "agreed" with nothing, a layout twice was compared with itself.
    for layouts, message in ((["single", "pp2"], f"--out {tmp_path / 'out'}: holds an earlier "
                                                 "comparison (seed, single, pp2); remove it or "
                                                 "give another --out"),
                             (["single"], "--layouts single: give at least two"),
                             (["tp2,sp", "sp,tp2"], "--layouts: 'tp2,sp' and 'sp,tp2' are the "
                                                    "same layout")):
        assert loss_compare.main(arguments + ["--layouts", *layouts]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(f"error: {message}"), error


@pytest.mark.parametrize("override, message", [
    # Before: silently replaced, each layout ran 10 steps / without recomputation.
    ("train.train_steps=50", "override 'train.train_steps=50': set by --steps"),
    ("parallel.recompute=full", "override 'parallel.recompute=full': set by --layouts (e.g. "
                                "tp2,sp or dp2,recompute)"),
    ("checkpoint.load=/ckpt", "override 'checkpoint.load=/ckpt': set by the tool for every layout "
                              "(all start from one seed checkpoint)"),
])
def test_loss_compare_refuses_overrides_of_what_it_sets(tmp_path, capsys, override, message):
    from tools import loss_compare

    argv = ["--preset", "tiny", "--layouts", "single", "dp2", "--out", str(tmp_path / "out"),
            "data.path=[unused]", "data.eod_id=0", override]
    assert loss_compare.main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_loss_compare_takes_the_parallel_settings_every_layout_keeps():
    from megaloop.cli import refuse_overrides_of
    from tools import loss_compare

    refuse_overrides_of(["parallel.overlap_grad_reduce=true", "parallel.ddp_bucket_size=8"],
                        loss_compare.set_by_the_tool())


@pytest.mark.parametrize("settings, message", [
    # Before: a traceback from the seed checkpoint's Trainer, exit 1 (after ~40 s under the tool).
    ([f"data.tokenizer_model={SP_MODEL}"], "model.vocab_size=4096: smaller than the tokenizer's "
                                           "32000 tokens"),
    (["data.eod_id=0", "data.split=969,30,1"], "split '969,30,1' gives the test split"),
])
def test_loss_compare_refuses_in_one_line_what_the_trainer_refuses(mcore, tmp_path, capsys,
                                                                  settings, message):
    from tools import loss_compare

    data = write_pattern_dataset(tmp_path / "pattern")
    argv = ["--preset", "tiny", "--layouts", "single", "dp2", "--out", str(tmp_path / "out"),
            f"data.path=[{data}]", *settings]
    assert loss_compare.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_loss_compare_names_every_setting_of_a_config_that_it_replaces(tmp_path):
    """Before: only the parallel fields were named; a config's train_steps=50 ran --steps' 10 and
    its checkpoint settings were replaced without a word."""
    from pathlib import Path

    from megaloop.config import RunConfig, run_config_from
    from megaloop.scale.layout import parse_layout
    from tools import loss_compare

    layouts = [parse_layout(t) for t in ("single", "tp2,sp")]
    out = Path("out")
    cfg = run_config_from({
        "parallel": {"tensor": 2, "sequence_parallel": True, "pipeline_split": [2]},
        "train": {"train_steps": 50, "eval_iters": 1, "lr": 1e-3},
        "checkpoint": {"save_interval": 100, "resume": False, "keep_last": 3}})

    def replaced(given, steps):
        return loss_compare.replaced_settings(
            given, loss_compare.layout_configs(given, layouts, steps, out),
            loss_compare.set_by_the_tool())

    assert replaced(cfg, 10) == (
        "parallel.tensor=2, parallel.sequence_parallel=True replaced by --layouts (e.g. tp2,sp "
        "or dp2,recompute); train.train_steps=50 replaced by --steps; checkpoint.save_interval=100"
        " replaced by the tool for every layout (all start from one seed checkpoint)")
    # The tool's own values (eval_iters=1, resume=false), what it keeps (lr, keep_last) and the
    # defaults are not named.
    assert replaced(cfg, 50).startswith(
        "parallel.tensor=2, parallel.sequence_parallel=True replaced by --layouts")
    assert "train_steps" not in replaced(cfg, 50)
    assert replaced(RunConfig(), 10) is None


@pytest.mark.parametrize("layouts, message", [
    # Before: pp3 ran the balanced split and was compared as if it were the config's.
    (["single", "pp2", "pp3"], "parallel.pipeline_split=[2, 4]: cuts 2 stages, layout 'pp3' has "
                               "3; compare layouts of 2 stages (pp x vp) and one-stage ones, or "
                               "leave the split out (each layout then splits evenly)"),
    (["single", "pp2,vp2"], "parallel.pipeline_split=[2, 4]: cuts 2 stages, layout 'pp2,vp2' has "
                            "4;"),
    # Before: no layout took the split, and none said so.
    (["single", "dp2"], "parallel.pipeline_split=[2, 4]: none of --layouts single dp2 is "
                        "pipelined; add one of 2 stages (e.g. pp2) or leave the split out"),
])
def test_loss_compare_refuses_a_pipeline_split_a_layout_cannot_take(tmp_path, capsys, layouts,
                                                                    message):
    from megaloop.config import save_yaml
    from megaloop.scale.layout import parse_layout
    from tools import loss_compare

    cfg = tiny_run(str(tmp_path / "data"), tmp_path / "unused",
                   parallel={"pipeline": 2, "pipeline_split": [2, 4]})
    save_yaml(cfg, tmp_path / "run.yaml")
    argv = ["--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "out"), "--layouts",
            *layouts]
    assert loss_compare.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    fitting = ["single", "pp2", "pp2,dp2"]  # one-stage layouts have no split to take
    loss_compare.check_pipeline_split(cfg, fitting, [parse_layout(t) for t in fitting])
