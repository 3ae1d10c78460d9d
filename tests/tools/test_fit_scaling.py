"""tools/fit_scaling.py: power-law fits of validation NLL against training compute, the compute each
architecture needs for a target NLL and its saving against a baseline, from run directories."""

import dataclasses
import json
import os

import pytest

from megaloop.config import ConfigError, RunConfig, TrainConfig, save_yaml
from megaloop.models.flops import model_flops_per_token
from megaloop.presets import preset

# Ground truth L(C) = E + A C^-alpha per architecture (LatentLoop reaches a loss with less compute).
TRUTH = {"moe_base": (1.8, 40.0, 0.12), "latentloop": (1.8, 38.0, 0.12)}
MODELS = {"moe_base": ("tiny", dict(arch="dense", num_experts=8, moe_top_k=2)),
          "latentloop": ("latentloop-tiny", {})}


BATCH = 800
STEP_SECONDS = 0.5


def _write_run(path, label, steps):
    """A run of ``steps`` steps at global batch BATCH, a train record per step (as the trainer
    logs them) and evaluations at half and at the end."""
    name, fields = MODELS[label]
    cfg = RunConfig(model=preset(name, **fields),
                    train=TrainConfig(global_batch_size=BATCH, micro_batch_size=BATCH))
    path.mkdir(parents=True)
    save_yaml(cfg, path / "config.yaml")
    tokens = BATCH * cfg.model.seq_length
    per_step = model_flops_per_token(cfg.model) * tokens
    e, a, alpha = TRUTH[label]
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"kind": "train", "step": step, "loss": 9.0,
                                "step_time_s": STEP_SECONDS,
                                "tokens_per_s": tokens / STEP_SECONDS}) + "\n")
            if step in (steps // 2, steps):
                loss = e + a * (per_step * step) ** -alpha
                f.write(json.dumps({"kind": "eval", "step": step, "val_loss": loss}) + "\n")
    return per_step


@pytest.fixture
def runs(tmp_path):
    paths = []
    for label in TRUTH:
        for steps in (10, 40, 160, 640, 2560):
            run = tmp_path / f"{label}_{steps}"
            _write_run(run, label, steps)
            paths.append(str(run))
    return paths


def test_fit_recovers_the_power_law_and_the_saving(load_tool, runs, tmp_path):
    tool = load_tool("fit_scaling")
    target = 2.2
    result = tool.analyse(runs, target=target, baseline="moe_base", all_evals=False)
    fits = result["fits"]
    assert sorted(fits) == ["latentloop", "moe_base"], "labels come from the run configs"
    for label, (e, a, alpha) in TRUTH.items():
        assert fits[label]["irreducible"] == pytest.approx(e, abs=0.01)
        assert fits[label]["exponent"] == pytest.approx(alpha, rel=0.05)
    needed = {label: (a / (target - e)) ** (1 / alpha) for label, (e, a, alpha) in TRUTH.items()}
    saving = 100 * (1 - needed["latentloop"] / needed["moe_base"])
    assert fits["latentloop"]["saving_vs_baseline_pct"] == pytest.approx(saving, abs=1.0)
    assert fits["moe_base"]["saving_vs_baseline_pct"] == 0.0
    plot = tmp_path / "fit.png"
    assert tool.main(runs + ["--target", "2.2", "--baseline", "moe_base", "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 0


def test_labels_can_be_given_and_a_target_below_the_floor_is_unreachable(load_tool, runs):
    tool = load_tool("fit_scaling")
    labelled = [f"x={run}" for run in runs if "latentloop" in run]
    fits = tool.analyse(labelled, target=1.5, baseline=None, all_evals=True)["fits"]
    assert list(fits) == ["x"] and fits["x"]["compute_for_target"] is None


def test_a_run_directory_may_hold_an_equals_sign(load_tool, runs, tmp_path):
    # Before: "runs/lr=3e-4" was read as label "runs/lr" of a directory "3e-4".
    tool = load_tool("fit_scaling")
    sweep = []
    for i, run in enumerate(run for run in runs if "moe_base" in run):
        sweep.append(str(tmp_path / f"lr=3e-4_{i}"))
        os.rename(run, sweep[-1])
    assert list(tool.analyse(sweep, None, None, False)["fits"]) == ["moe_base"]
    assert list(tool.analyse([f"a={p}" for p in sweep], None, None, False)["fits"]) == ["a"]


def test_runs_are_labelled_by_architecture_and_first_visit_reduction(load_tool):
    tool = load_tool("fit_scaling")
    labels = {reduction: tool.label_of(RunConfig(model=preset(
        "latentloop-tiny", latent_reduction=reduction, moe_top_k=4)))
        for reduction in ("sequence", "top_k", "width", "expert_ffn")}
    assert labels == {"sequence": "latentloop", "top_k": "latentloop_top_k",
                      "width": "latentloop_width", "expert_ffn": "latentloop_expert_ffn"}
    assert tool.label_of(RunConfig(model=preset("moe-loop-1.3B"))) == "moe_loop"


@pytest.mark.parametrize("args, message", [
    # Before: a path without "=" was split into the label "{missing}" and the path "" (the
    # current directory, whose run was read instead).
    (["{missing}"], "{missing}: does not exist"),
    (["x={missing}"], "x={missing}: not a directory, nor is '{missing}' after the label 'x'"),
    (["{config}"], "{config}: not a directory"),
    (["{empty}"], "{empty}: no config.yaml (not a megaloop run directory)"),
    (["{one}"], "label 'latentloop': 1 distinct compute values"),
    (["{runs}", "--target", "2", "--baseline", "moe"], "--baseline='moe': no such label"),
    (["{runs}", "--baseline", "moe_base"], "--baseline needs --target"),
    # Before the fixes: a traceback after the fits; the run's points counted twice.
    (["{runs}", "--plot", "/dev/null/x.png"],
     "--plot /dev/null/x.png: cannot be written (/dev/null is not a writable directory)"),
    (["{runs}", "{one}"], "_2560: given twice"),
])
def test_bad_inputs_are_one_line_errors(load_tool, runs, tmp_path, capsys, monkeypatch, args,
                                       message):
    tool = load_tool("fit_scaling")
    values = {"missing": str(tmp_path / "nope"), "one": runs[-1],
              "config": f"{runs[-1]}/config.yaml", "empty": str(tmp_path)}
    monkeypatch.chdir(runs[0])  # a run directory: one an empty path would read
    argv = []
    for arg in args:
        argv += runs if arg == "{runs}" else [arg.format(**values)]
    assert tool.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(**values) in err and "\n" not in err


@pytest.mark.parametrize("loss, shown", [(float("nan"), "nan"), (None, "null (NaN/Inf)")])
def test_a_diverged_run_is_named_instead_of_fitting_nan(load_tool, runs, capsys, loss, shown):
    """null: what megaloop.training.monitor writes for a NaN/Inf loss. Before, such an evaluation
    was skipped, and the run's earlier one taken as its point, exit 0."""
    tool = load_tool("fit_scaling")
    metrics = f"{runs[0]}/metrics.jsonl"
    with open(metrics, "a") as f:
        f.write(json.dumps({"kind": "eval", "step": 2_000, "val_loss": loss}) + "\n")
    assert tool.main(runs) == 2  # was exit 0 with "L(C) = nan + nan * C^-nan"
    assert capsys.readouterr().err.strip() == (f"error: {metrics}: val_loss={shown} at step 2000 "
                                               "(a diverged run: leave it out)")


def test_a_saving_that_cannot_be_computed_says_so(load_tool, runs, capsys):
    tool = load_tool("fit_scaling")
    with pytest.raises(SystemExit):
        tool.main(runs + ["--target", "nan"])  # was "C(nan) = unreachable"
    assert "argument --target: nan: must be > 0" in capsys.readouterr().err
    # The fitted floors: moe_base 1.7985 reaches 1.8, latentloop (1.8018) never does.
    assert tool.main(runs + ["--target", "1.8", "--baseline", "moe_base"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[1].endswith("C(1.8) = unreachable | saving vs moe_base: n/a"), lines
    assert out.err == ""  # every step's tokens are logged: no note


def _run_dir(tmp_path, global_batch_size: int):
    """A run directory holding the tiny preset's config.yaml (and no metrics yet)."""
    run = tmp_path / "run"
    cfg = RunConfig(model=preset("tiny"), train=TrainConfig(global_batch_size=global_batch_size))
    run.mkdir()
    save_yaml(cfg, run / "config.yaml")
    return run, cfg


def test_compute_sums_each_steps_logged_tokens_across_a_batch_change(load_tool, tmp_path):
    """A run resumed at step 4 with twice the batch: config.yaml holds the final batch, the
    metrics each step's tokens. Before, every step was counted at config.yaml's batch."""
    tool = load_tool("fit_scaling")
    run, cfg = _run_dir(tmp_path, global_batch_size=16)
    seq = cfg.model.seq_length
    records = [{"kind": "train", "step": step, "step_time_s": 0.25,
                "tokens_per_s": (8 if step <= 4 else 16) * seq / 0.25} for step in range(1, 9)]
    records.insert(4, {"kind": "eval", "step": 4, "val_loss": 3.0})
    records.append({"kind": "eval", "step": 8, "val_loss": 2.5})
    records.append(records[-1])  # the final evaluation, logged twice: one point
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    label, points, note = tool.run_points(run, all_evals=True)
    flops = model_flops_per_token(cfg.model)
    assert label == "asymloop" and note is None
    assert points == [(flops * 4 * 8 * seq, 3.0), (flops * (4 * 8 + 4 * 16) * seq, 2.5)]
    # Steps 1-2 lost from the metrics: counted at config.yaml's batch, and said so.
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[2:]))
    _, points, note = tool.run_points(run, all_evals=False)
    assert points == [(flops * (2 * 16 + 2 * 8 + 4 * 16) * seq, 2.5)]
    assert note == (f"{run / 'metrics.jsonl'}: 2 of the 8 steps have no train record with "
                    f"tokens_per_s and step_time_s; counted at config.yaml's global_batch_size x "
                    f"seq_length = {16 * seq} tokens each")


def test_the_last_evaluation_is_the_highest_steps_last_record(load_tool, tmp_path):
    """A metrics.jsonl whose lines are not in step order (the trainer keeps its own in order, but
    one joined from several need not be: here steps 6-10 follow step 10): the point is step 10's
    last evaluation, and --all-evals' points are in step order. Before, the file's order: step
    7's evaluation was the run's point."""
    tool = load_tool("fit_scaling")
    run, cfg = _run_dir(tmp_path, global_batch_size=8)
    seq = cfg.model.seq_length

    def steps(first, last, evals):
        for step in range(first, last + 1):
            yield {"kind": "train", "step": step, "step_time_s": 0.25,
                   "tokens_per_s": 8 * seq / 0.25}
            if step in evals:
                yield {"kind": "eval", "step": step, "val_loss": evals[step]}

    records = [*steps(1, 10, {5: 3.0, 10: 2.6}), *steps(6, 10, {7: 2.9, 10: 2.5})]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    flops = model_flops_per_token(cfg.model) * 8 * seq
    assert tool.run_points(run, all_evals=False)[1] == [(flops * 10, 2.5)]
    assert tool.run_points(run, all_evals=True)[1] == [(flops * 5, 3.0), (flops * 7, 2.9),
                                                       (flops * 10, 2.5)]


def test_a_run_whose_model_changed_across_resumes_is_refused(load_tool, tmp_path):
    """Resumed at step 4 on 4 processes instead of 8, then (another run) also at depth 3 instead
    of 2: config.yaml holds the last start's model. A new world size leaves the compute right; a
    new depth would have counted steps 1-3 at the deeper model's FLOPs per token."""
    tool = load_tool("fit_scaling")
    run = tmp_path / "run"
    run.mkdir()
    shallow = preset("tiny", iterations=2)
    deep = dataclasses.replace(shallow, iterations=3)
    tokens = 8 * shallow.seq_length

    def write(first_model, last_model):
        save_yaml(RunConfig(model=last_model, train=TrainConfig(global_batch_size=8)),
                  run / "config.yaml")
        records = []
        for step in range(1, 7):
            model, world = (first_model, 8) if step <= 3 else (last_model, 4)
            rate = tokens / 0.25  # tflops_per_device as megaloop.training.monitor logs it
            records.append({"kind": "train", "step": step, "step_time_s": 0.25,
                            "tokens_per_s": rate,
                            "tflops_per_device": rate * model_flops_per_token(model) / world
                            / 1e12})
        records.append({"kind": "eval", "step": 6, "val_loss": 2.5})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write(shallow, shallow)
    _, points, _ = tool.run_points(run, all_evals=False)
    assert points == [(model_flops_per_token(shallow) * 6 * tokens, 2.5)]
    write(shallow, deep)
    with pytest.raises(ConfigError) as refused:
        tool.run_points(run, all_evals=False)
    assert str(refused.value).startswith(
        f"{run / 'metrics.jsonl'}: step 1 was trained at {model_flops_per_token(shallow) / 8:.6g}"
        f" FLOPs per token per process, which config.yaml's model "
        f"({model_flops_per_token(deep):.6g} per token) gives on no whole number of processes: "
        "the model changed across resumes")


def _rewrite(run, change):
    """Rewrites the run's metrics.jsonl with ``change`` applied to each record."""
    metrics = f"{run}/metrics.jsonl"
    with open(metrics) as f:
        records = [change(json.loads(line)) for line in f]
    with open(metrics, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return metrics


@pytest.mark.parametrize("field, value, message", [
    ("val_loss", 0.0, "val_loss=0.0 at step 10: a validation NLL is a number > 0"),
    ("val_loss", -0.5, "val_loss=-0.5 at step 10: a validation NLL is a number > 0"),
    ("val_loss", "2.1", "val_loss='2.1' at step 10: a validation NLL is a number > 0"),
    ("tokens_per_s", -100.0, "step 1 logs tokens_per_s=-100.0 x step_time_s=0.5, not a positive "
                             "number of tokens"),
    ("tokens_per_s", 0.0, "step 1 logs tokens_per_s=0.0 x step_time_s=0.5, not a positive number "
                          "of tokens"),
])
def test_a_loss_or_token_count_no_run_logs_is_named_instead_of_fitting_nan(
        load_tool, runs, capsys, field, value, message):
    """Before: "L(C) = 0.0000 + nan * C^-nan" and exit 0, or a LinAlgError traceback."""
    tool = load_tool("fit_scaling")
    metrics = _rewrite(runs[0], lambda r: {**r, field: value} if field in r else r)
    assert tool.main(runs) == 2
    assert capsys.readouterr().err.strip() == f"error: {metrics}: {message}"


def test_a_loss_equal_at_every_compute_is_no_power_law(load_tool, runs, capsys):
    """Before: "L(C) = 2.0000 + 1.99 * C^-0.0000" and exit 0."""
    tool = load_tool("fit_scaling")
    for run in runs[:5]:  # every moe_base run
        _rewrite(run, lambda r: {**r, "val_loss": 2.5} if "val_loss" in r else r)
    assert tool.main(runs) == 2
    assert capsys.readouterr().err.strip() == ("error: label 'moe_base': validation loss 2.5 at "
                                               "every compute: no power law to fit")


@pytest.mark.parametrize("e, a, alpha", [(1.7923, 50.0, 0.15), (2.1337, 20.0, 0.1)])
def test_an_irreducible_loss_between_grid_points_is_found_to_extrapolate_right(load_tool, e, a,
                                                                                alpha):
    """E between two points of the search grid (min loss / 400 apart) was taken at the nearer
    one; extrapolated to an NLL below every run's, that put the compute 5.3% and 2.0% off the
    law's, more than the savings' differences the tool reports. Noise-free points of a known law
    now give it back to 0.1%."""
    tool = load_tool("fit_scaling")
    compute = [1e18 * 10 ** (3 * i / 7) for i in range(8)]
    points = [(c, e + a * c ** -alpha) for c in compute]
    target = e + 0.7 * (points[-1][1] - e)  # below the last point's loss: extrapolated
    fit = tool.fit_power_law(points)
    assert fit.irreducible == pytest.approx(e, rel=1e-4)
    assert fit.compute_for(target) == pytest.approx((a / (target - e)) ** (1 / alpha), rel=1e-3)


def test_an_evaluation_before_any_training_is_named_instead_of_a_traceback(load_tool, runs,
                                                                             capsys):
    """An evaluation at step 0 (of the initial weights, logged by hand or by another tool) has no
    training compute: log(0) in the fit was a LinAlgError traceback. (Without --all-evals a run's
    point is its highest step's: the step-0 evaluation, last in the file, is not used.)"""
    tool = load_tool("fit_scaling")
    metrics = f"{runs[0]}/metrics.jsonl"
    with open(metrics, "a") as f:
        f.write(json.dumps({"kind": "eval", "step": 0, "val_loss": 9.0}) + "\n")
    assert tool.main(runs) == 0
    capsys.readouterr()
    assert tool.main(runs + ["--all-evals"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {metrics}: an evaluation at step 0, before any training (C = 0 FLOPs, which "
        "a power law in C cannot take); leave it out")
