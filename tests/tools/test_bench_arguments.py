"""tools/bench/: a size or count below its minimum is an argparse error naming the flag, before
any work (it was a traceback, e.g. "no median for empty data" for --repeats 0); a stop signal
stops a bench that runs a Trainer in process."""

import sys

import pytest


@pytest.mark.parametrize("bench, flag", [
    ("alrs", "--reps"), ("preprocess", "--rounds"), ("pipeline_balance", "--steps"),
    ("latent_visit", "--repeats"), ("moe_layer", "--repeats"), ("joint_attention", "--repeats"),
    ("step_time", "--repeats"), ("train_throughput", "--rounds"), ("recompute", "--repeats"),
])
def test_a_count_below_one_is_refused_naming_the_flag(load_tool, monkeypatch, capsys, bench,
                                                      flag):
    main = load_tool(f"bench/{bench}").main
    monkeypatch.setattr(sys, "argv", [f"{bench}.py", flag, "0"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {flag}: 0: must be >= 1\n")


@pytest.mark.parametrize("bench, argv, message", [
    ("export_memory", ["--arch", "asym"], "model.arch='asym': must be one of 'dense', 'fullloop', "
                                          "'asymloop', 'latentloop'"),
    ("generate", ["--preset", "2B"], "preset '2B': unknown; choose one of tiny, 60M"),
    ("step_time", ["--preset", "2B"], "preset '2B': unknown; choose one of tiny, 60M"),
    ("checkpoint_save_memory", ["--preset", "2B"], "preset '2B': unknown; choose one of tiny"),
])
def test_an_unknown_preset_or_arch_is_one_argparse_line(load_tool, capsys, bench, argv, message):
    """Before: a ConfigError traceback (a bare KeyError for an unknown arch)."""
    with pytest.raises(SystemExit) as exit_:
        load_tool(f"bench/{bench}").main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err.splitlines()[-1] and "Traceback" not in err


def test_train_throughput_stops_on_sigterm(load_tool, monkeypatch, capsys):
    """Its dense row builds a Trainer, which holds SIGTERM for a loop the bench does not run:
    before, `timeout` or `kill` was taken and the bench ran its 50-odd steps to the end."""
    import signal

    from megaloop.training import signals
    from tests.training.process_groups import signal_this_process

    bench = load_tool("bench/train_throughput")
    steps = []

    def step_then_sigterm(self, data):  # one signal, as `timeout` sends, noticed in this step
        if not steps:
            signal_this_process(signal.SIGTERM, signals._installed[-1])  # the Trainer's
        steps.append(1)

    monkeypatch.setattr(bench.PlainGPTLoop, "step", step_then_sigterm)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--rows", "dense", "--hidden", "32", "--heads", "2", "--layers", "1",
                    "--seq", "32", "--vocab", "256", "--steps", "2", "--rounds", "1"])
    # Before: the bench's 6 steps with this patch (and 50-odd real ones) ran to the end.
    assert exit_.value.code == 128 + signal.SIGTERM and len(steps) == 1
    assert capsys.readouterr().err.endswith("stopped by signal 15\n")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the trainer's handlers are gone


def test_a_failed_launch_is_one_error_with_its_reason(load_tool):
    """The looped row's torchrun launch refuses 3 heads of a 256-wide model: before, a
    CalledProcessError traceback ('returned non-zero exit status 1'), the reason left unread."""
    with pytest.raises(SystemExit) as exit_:
        load_tool("bench/train_throughput").main(["--rows", "looped", "--heads", "3",
                                                  "--rounds", "1"])
    assert exit_.value.code == ("error: the single launch failed (exit 1): model.hidden_size=256: "
                                "must be a multiple of num_attention_heads=3 (or set head_dim)")


def test_latent_visit_refuses_a_stride_no_reduction_reads(load_tool, capsys):
    """Before: --stride 4 --reductions width timed the width reduction; the stride did nothing."""
    with pytest.raises(SystemExit) as exit_:
        load_tool("bench/latent_visit").main(["--stride", "4", "--reductions", "width,top_k"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --stride 4: only the sequence reduction reads it; --reductions width,top_k times none")


def test_pipeline_balance_stage_stops_after_its_step_on_sigterm(load_tool, mcore, monkeypatch, tmp_path):
    """A stage's Trainer holds SIGTERM for a loop the bench does not run: before, torchrun's
    SIGTERM was taken and the stage trained on until torchrun's SIGKILL 30 s later."""
    import signal

    from megaloop.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig, save_yaml
    from megaloop.training.trainer import Trainer
    from tests.training.process_groups import signal_this_process

    bench = load_tool("bench/pipeline_balance")
    prefix = load_tool("bench/train_throughput").write_dataset(tmp_path / "data", 256)
    cfg = RunConfig(model=ModelConfig(arch="asymloop", iterations=2, num_layers=2, hidden_size=32,
                                      ffn_hidden_size=64, num_attention_heads=2, vocab_size=256,
                                      seq_length=32),
                    train=TrainConfig(micro_batch_size=2, global_batch_size=2, train_steps=50,
                                      tensorboard=False, out_dir=str(tmp_path / "run")),
                    data=DataConfig(path=[prefix], split="100,0,0", eod_id=0),
                    checkpoint=CheckpointConfig(resume=False))
    save_yaml(cfg, tmp_path / "run.yaml")
    steps = []

    def step_then_sigterm(self, data):  # one signal, as torchrun forwards it, noticed in this step
        if not steps:
            signal_this_process(signal.SIGTERM, self.stop_signals)
        steps.append(1)

    monkeypatch.setattr(Trainer, "train_step", step_then_sigterm)
    with pytest.raises(SystemExit) as exit_:
        bench.worker(str(tmp_path / "run.yaml"), 50, 0, str(tmp_path / "busy.json"))
    assert exit_.value.code == 128 + signal.SIGTERM and len(steps) == 1


STOPPED_LAUNCH = """
import signal, sys
from tests.tool_scripts import load_tool
bench = load_tool("bench/pipeline_balance")
bench.STOP_GRACE_S = 1
signal.signal(signal.SIGTERM, bench.raise_stopped)
# A launcher whose worker ignores SIGTERM, as a stage's Trainer held it, and writes its pid.
worker = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)")
launcher = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}, "
            f"{sys.argv[1]!r}]); time.sleep(600)")
try:
    bench.launch([sys.executable, "-c", launcher])
except bench.Stopped as stop:
    sys.exit(128 + stop.signum)
"""


def test_pipeline_balance_stopped_ends_its_launcher_and_workers(tmp_path):
    """Before: SIGTERM ended the bench alone (Ctrl-C killed only torchrun with SIGKILL) and the
    stages trained on, orphaned."""
    import signal
    import subprocess
    import time
    from pathlib import Path

    pid_file = tmp_path / "worker.pid"
    driver = subprocess.Popen([sys.executable, "-c", STOPPED_LAUNCH, str(pid_file)],
                              cwd=Path(__file__).parents[2], text=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=30) == 128 + signal.SIGTERM, driver.stderr.read()
    time.sleep(0.5)
    try:  # gone, or a zombie waiting for whoever adopted it
        assert open(f"/proc/{worker}/stat").read().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        pass


def test_train_throughput_prints_json_alone_with_cpu_time_ratios(load_tool, capsys):
    """Before: the Trainer's progress lines went to stdout before the JSON, and only wall-time
    ratios were given, which waits for a core on a shared machine swing either way."""
    import json

    load_tool("bench/train_throughput").main([
        "--rows", "dense", "--hidden", "32", "--heads", "2", "--layers", "1", "--seq", "32",
        "--vocab", "256", "--steps", "1", "--rounds", "1"])
    dense = json.loads(capsys.readouterr().out)["dense"]
    for loop in ("sdpa", "local_spec"):
        assert dense[f"cpu_ratio_vs_plain_mcore_{loop}"] > 0


def test_step_time_gives_the_cpu_time_overhead_beside_the_wall_time_one(load_tool, capsys):
    """Before: wall time only, which read +97% at load 15-37 where the CPU time reads ~+33%."""
    import json

    load_tool("bench/step_time").main(["--hidden", "32", "--ffn", "64", "--heads", "2",
                                       "--layers", "2", "--seq", "64", "--vocab", "128",
                                       "--repeats", "1"])
    result = json.loads(capsys.readouterr().out)
    assert set(result["step_cpu_ms"]) == {"asymloop_k3", "fullloop_r2"}
    cpu = result["step_cpu_ms"]
    assert result["measured_cpu_overhead_pct"] == pytest.approx(
        100 * (cpu["asymloop_k3"] / cpu["fullloop_r2"] - 1))


def test_step_time_profile_names_the_operators_that_differ_most(load_tool, capsys):
    """--profile: one profiled step per model, operators ordered by how much their self time
    differs between the two (on the H200 it found the norms' elementwise kernels)."""
    import json

    load_tool("bench/step_time").main(["--hidden", "32", "--ffn", "64", "--heads", "2",
                                       "--layers", "2", "--seq", "64", "--vocab", "128",
                                       "--repeats", "1", "--profile", "1000"])
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["time"] == "cpu"
    assert all(ms > 0 for ms in profile["total_ms"].values())
    rows = profile["ms_by_op"]
    assert all(set(row) == {"asymloop_k3", "fullloop_r2"} for row in rows.values())
    spreads = [abs(row["asymloop_k3"] - row["fullloop_r2"]) for row in rows.values()]
    assert spreads == sorted(spreads, reverse=True) and spreads[0] > 0
    # Only AsymLoop runs the fused joint attention. (Where it ranks depends on the machine.)
    joint = rows["_JointFlashAttention"]
    assert joint["asymloop_k3"] > 0 and joint["fullloop_r2"] == 0
