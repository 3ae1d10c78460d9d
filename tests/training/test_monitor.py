import json
import math
import subprocess
import sys
import types

import pytest

from megaloop.training.monitor import Monitor, peak_tflops, read_metrics


@pytest.fixture
def no_nvml(monkeypatch):
    """NVML fails as on a machine without the NVIDIA driver, whatever this machine has."""
    import pynvml

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)


def _fake_pynvml(names, power_supported=True):
    """A stand-in for nvidia-ml-py on a node with the given GPUs; power can be unsupported (MIG)."""
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    fake.NVMLError = NVMLError
    fake.shutdown_calls = 0
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetCount = lambda: len(names)
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetName = lambda h: names[h]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 2**30, total=141 * 2**30)
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=90 + h)

    def power(h):
        if not power_supported:
            raise NVMLError("Not Supported")
        return 650_000 + h * 1000

    fake.nvmlDeviceGetPowerUsage = power

    def shutdown():
        fake.shutdown_calls += 1

    fake.nvmlShutdown = shutdown
    return fake


def _monitor(tmp_path, **overrides):
    kwargs = dict(is_writer=True, total_steps=10, tokens_per_step=8192, model_flops_per_token=6e9,
                  world_size=4, tensorboard=False, progress=False, log_interval=5)
    kwargs.update(overrides)
    return Monitor(tmp_path / "run", **kwargs)


def _lines(tmp_path):
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_step_record_has_exact_throughput_mfu_and_eta(tmp_path, no_nvml):
    with _monitor(tmp_path, peak_tflops_per_device=100.0) as m:
        m.log_step(1, loss=3.5, lr=1e-4, grad_norm=0.75, step_time_s=0.5, skipped=False)
        m.log_step(2, loss=3.25, lr=2e-4, grad_norm=0.5, step_time_s=0.25, skipped=False,
                   extra={"skipped_total": 0, "aux_loss": 0.125})
    first, second = _lines(tmp_path)
    # 8192 tokens in 0.5 s; 6e9 FLOPs/token over 4 devices -> 24.576 TFLOP/s each; peak 100.
    assert first["kind"] == "train" and first["step"] == 1 and first["skipped"] is False
    assert first["loss"] == 3.5 and first["lr"] == 1e-4 and first["grad_norm"] == 0.75
    assert first["tokens_per_s"] == 16384.0
    assert first["tflops_per_device"] == 24.576
    assert first["mfu"] == pytest.approx(0.24576, rel=1e-12)
    assert second["tokens_per_s"] == 32768.0 and second["mfu"] == pytest.approx(0.49152, rel=1e-12)
    # The first step of a process (warm-up) is left out of the ETA: 8 steps left at 0.25 s each.
    assert second["eta_s"] == 2.0
    assert second["skipped_total"] == 0 and second["aux_loss"] == 0.125


def test_tokens_in_the_loss_get_their_own_rate_where_the_mask_drops_some(tmp_path, capsys, no_nvml):
    with _monitor(tmp_path, log_interval=1) as m:
        m.log_step(1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.5, skipped=False,
                   loss_tokens=8192)  # pre-training: every position counts
        m.log_step(2, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.5, skipped=False,
                   loss_tokens=1024)  # fine-tuning: prompts and padding masked out
        m.log_step(3, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.5, skipped=False)
    records = _lines(tmp_path)
    assert [r["tokens_per_s"] for r in records] == [16384.0] * 3
    assert [r["loss_tokens_per_s"] for r in records] == [16384.0, 2048.0, None]
    rates = [line.split(" | ")[3] for line in capsys.readouterr().out.splitlines()
             if line.startswith("step ")]
    assert rates == ["16.4k tok/s", "16.4k tok/s (2.0k in the loss)", "16.4k tok/s"]


def test_non_finite_loss_is_null_and_the_file_stays_strict_json(tmp_path, no_nvml):
    with _monitor(tmp_path) as m:
        m.log_step(1, loss=float("nan"), lr=1e-4, grad_norm=None, step_time_s=1.0, skipped=True)
        m.log_step(2, loss=2.0, lr=1e-4, grad_norm=float("inf"), step_time_s=1.0, skipped=False)
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    first, second = [json.loads(line, parse_constant=pytest.fail) for line in text.splitlines()]
    assert first["loss"] is None and first["grad_norm"] is None and first["skipped"] is True
    assert second["grad_norm"] is None


def test_no_gpu_line_printed_once_and_mfu_null(tmp_path, capsys, no_nvml):
    with _monitor(tmp_path) as m:
        for step in range(1, 11):
            m.log_step(step, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, skipped=False)
    out = capsys.readouterr().out
    assert out.count("gpu stats:") == 1
    no_gpu = "gpu stats: no NVIDIA GPU (NVML unavailable: NVML Shared Library Not Found) — logging CPU/RSS only"
    assert no_gpu in out.splitlines()
    records = _lines(tmp_path)
    assert all(r["mfu"] is None for r in records)
    # Host stats on report steps only: the first, every log_interval (5) and the last.
    assert [r["step"] for r in records if "rss_gib" in r] == [1, 5, 10]
    assert all(r["rss_gib"] > 0 and "cpu_pct" in r for r in records if "rss_gib" in r)
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/10", "5/10", "10/10"]
    assert "MFU n/a" in step_lines[0] and "rss " in step_lines[0]


def test_gpu_stats_and_peak_from_nvml(tmp_path, capsys, monkeypatch):
    fake = _fake_pynvml(["NVIDIA H200", "NVIDIA H200", "NVIDIA H200"], power_supported=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    with _monitor(tmp_path, precision="fp8") as m:
        assert m.peak_tflops_per_device == pytest.approx(2 * 989.4)
        m.log_step(1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.5, skipped=False)
    assert fake.shutdown_calls == 1
    (record,) = _lines(tmp_path)
    assert record["gpu0_mem_used_gib"] == 1.0 and record["gpu2_mem_used_gib"] == 3.0
    assert record["gpu2_mem_total_gib"] == 141.0 and record["gpu2_util_pct"] == 92.0
    assert "gpu1_mem_used_gib" not in record and "gpu0_power_w" not in record  # hidden; unsupported
    assert record["mfu"] == pytest.approx(24.576 / 1978.8)
    out = capsys.readouterr().out
    assert "gpu stats:" not in out and "gpu0 1.0/141 GiB 90%, gpu2 3.0/141 GiB 92%" in out


def test_unknown_gpu_gets_no_peak_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(["NVIDIA H100 NVL"]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with _monitor(tmp_path) as m:
        assert m.peak_tflops_per_device is None
    assert "mfu: no known bf16 peak for 'NVIDIA H100 NVL'" in capsys.readouterr().out


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(1978.8)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H200", "fp16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no fp8 tensor cores
    assert peak_tflops("NVIDIA H200", "fp32") is None
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None


def _write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))


def test_resume_drops_lines_at_or_after_resume_step_atomically(tmp_path, capsys, no_nvml):
    path = tmp_path / "run" / "metrics.jsonl"
    old = [json.dumps({"kind": "train", "step": s, "loss": 5.0 - s}) + "\n" for s in range(1, 7)]
    old.insert(4, json.dumps({"kind": "eval", "step": 4, "val_loss": 1.5}) + "\n")
    _write_lines(path, old + ['{"kind": "train", "step": 7, "lo'])  # the crash cut this line short
    with _monitor(tmp_path, resume_step=4) as m:
        assert [r["step"] for r in read_metrics(path)[0]] == [1, 2, 3]
        m.log_step(4, loss=0.5, lr=1e-3, grad_norm=1.0, step_time_s=0.1, skipped=False)
    records = _lines(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3),
                                                         ("train", 4)]
    assert records[2]["loss"] == 2.0 and records[3]["loss"] == 0.5
    assert [p.name for p in path.parent.iterdir()] == ["metrics.jsonl"]  # no .tmp left behind
    assert ("metrics: resuming at step 4: dropped 4 line(s) at step >= 4 and 1 unreadable line(s)"
            in capsys.readouterr().out)


def test_a_failed_resume_rewrite_keeps_the_log_and_leaves_no_temporary(tmp_path, monkeypatch,
                                                                      no_nvml):
    import os

    path = tmp_path / "run" / "metrics.jsonl"
    old = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) + "\n" for s in range(1, 4)]
    _write_lines(path, old)

    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(OSError, match="No space left on device"):
        _monitor(tmp_path, resume_step=2)
    monkeypatch.undo()
    assert path.read_text() == "".join(old)
    # Before: metrics.jsonl.tmp stayed, beside a log that a fresh resume then rewrote again.
    assert [p.name for p in path.parent.iterdir()] == ["metrics.jsonl"]


def test_append_without_resume_starts_after_a_half_written_line(tmp_path, no_nvml):
    path = tmp_path / "run" / "metrics.jsonl"
    _write_lines(path, [json.dumps({"kind": "train", "step": 1}) + "\n", '{"kind": "tr'])
    with _monitor(tmp_path) as m:
        m.log_step(2, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, skipped=False)
    records, malformed = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2] and malformed == 1


def test_non_writer_ranks_write_nothing(tmp_path, capsys, no_nvml):
    with _monitor(tmp_path, is_writer=False, tensorboard=True, progress=True) as m:
        m.log_step(1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, skipped=False)
        m.log_eval(1, {"val_loss": 1.0})
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_eval_line_in_jsonl_and_printed(tmp_path, capsys, no_nvml):
    with _monitor(tmp_path) as m:
        m.log_eval(5, {"val_loss": 3.25, "val_ppl": math.exp(3.25), "val_loss_k1": 4.0})
    (record,) = _lines(tmp_path)
    assert record["kind"] == "eval" and record["step"] == 5
    assert record["val_loss"] == 3.25 and record["val_ppl"] == math.exp(3.25)
    assert "eval step 5 | val_loss 3.25 | val_ppl 25.79 | val_loss_k1 4" in capsys.readouterr().out


def test_bad_metrics_and_arguments_are_one_line_errors(tmp_path, no_nvml):
    with pytest.raises(ValueError, match="log_interval must be a positive integer, got 0"):
        _monitor(tmp_path, log_interval=0)
    with pytest.raises(ValueError, match="precision must be one of"):
        _monitor(tmp_path, precision="int4")
    with _monitor(tmp_path) as m:
        with pytest.raises(ValueError, match="metric key 'loss' is reserved"):
            m.log_step(1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, skipped=False,
                       extra={"loss": 2.0})
        with pytest.raises(ValueError, match="metric 'val_loss' must be a number, got str 'low'"):
            m.log_eval(1, {"val_loss": "low"})
        with pytest.raises(ValueError, match="step_time_s must be > 0, got 0"):
            m.log_step(1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0, skipped=False)


def test_tensorboard_event_file_holds_the_scalars(tmp_path, no_nvml):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _monitor(tmp_path, tensorboard=True, run_config={"model": {"hidden_size": 64}}) as m:
        for step in (1, 2, 3):
            m.log_step(step, loss=4.0 - step, lr=1e-3, grad_norm=1.0, step_time_s=0.5, skipped=False)
        m.log_eval(3, {"val_loss": 1.5})
    tb_dir = tmp_path / "run" / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [e.value for e in events.Scalars("train/tokens_per_s")] == [16384.0] * 3
    assert [(e.step, e.value) for e in events.Scalars("eval/val_loss")] == [(3, 1.5)]


def test_downstream_rows_in_jsonl_and_tensorboard(tmp_path, capsys, no_nvml):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _monitor(tmp_path, tensorboard=True) as m:
        m.log_downstream(4, "piqa", {"acc": 0.5, "acc_stderr": 0.25, "samples": 4},
                         num_fewshot=0, iterations=3)
        m.log_downstream(4, "mmlu", {"acc": 0.75}, num_fewshot=5, iterations=None)
        with pytest.raises(ValueError, match="metric key 'task' is reserved"):
            m.log_downstream(4, "piqa", {"task": 1.0}, num_fewshot=0, iterations=None)
    records = _lines(tmp_path)
    assert records[0] == {"kind": "downstream", "step": 4, "time": records[0]["time"],
                          "task": "piqa", "num_fewshot": 0, "iterations": 3, "acc": 0.5,
                          "acc_stderr": 0.25, "samples": 4}
    assert (records[1]["task"], records[1]["iterations"]) == ("mmlu", None)
    assert "downstream step 4 | piqa_0shot_k3 | acc 0.5 | samples 4" in capsys.readouterr().out
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("downstream/piqa_0shot_k3/acc")] == [
        (4, 0.5)]
    assert [e.value for e in events.Scalars("downstream/mmlu_5shot/acc")] == [0.75]
    assert "downstream/piqa_0shot_k3/num_fewshot" not in events.Tags()["scalars"]


def test_progress_bar_replaces_log_lines_on_a_terminal(tmp_path, capsys, monkeypatch, no_nvml):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    with _monitor(tmp_path, log_interval=1, progress=True) as m:
        m.log_step(1, loss=2.5, lr=3e-4, grad_norm=1.0, step_time_s=0.5, skipped=False)
        m.log_eval(1, {"val_loss": 2.75})
    out = capsys.readouterr().out
    assert "loss 2.5000 | lr 3.000e-04 | 16.4k tok/s | MFU n/a" in out
    assert "eval step 1 | val_loss 2.75" in out and "gpu stats: no NVIDIA GPU" in out
    assert "step 1/10" not in out


def test_missing_wandb_is_a_clear_error(tmp_path, monkeypatch, no_nvml):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RuntimeError, match="wandb_project='exp' is set but wandb is not installed"):
        _monitor(tmp_path, wandb_project="exp")
    assert not (tmp_path / "run").exists()  # failed before anything was created


def test_wandb_run_is_continued_on_resume(tmp_path, monkeypatch, no_nvml):
    calls = []
    run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", step, data)),
                                finish=lambda: calls.append(("finish",)))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    for resume_step in (None, 2):
        with _monitor(tmp_path, wandb_project="exp", run_config={"lr": 1e-3}, resume_step=resume_step) as m:
            m.log_step(1, loss=2.0, lr=1e-3, grad_norm=1.0, step_time_s=0.5, skipped=False)
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert inits[0]["project"] == "exp" and inits[0]["config"] == {"lr": 1e-3}
    logs = [c for c in calls if c[0] == "log"]
    assert logs[0][1] == 1 and logs[0][2]["train/loss"] == 2.0 and "train/step" not in logs[0][2]
    assert [c[0] for c in calls].count("finish") == 2


def test_a_fresh_start_in_a_run_directory_is_a_new_wandb_run(tmp_path, monkeypatch, no_nvml,
                                                              capsys):
    """Continued, the earlier run's wandb history would swallow this one's first steps (wandb
    ignores steps below those logged)."""
    inits = []
    run = types.SimpleNamespace(log=lambda data, step: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kwargs: inits.append(kwargs["id"]) or run))
    for resume_step in (1, 5, 1):  # a run, its resume, a new run from step 0 in the same place
        _monitor(tmp_path, wandb_project="exp", resume_step=resume_step).close()
    assert inits[0] == inits[1] != inits[2]
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == inits[2]
    assert (f"wandb: this run starts at step 1: a new wandb run, not {inits[0]} (the earlier run "
            f"in {tmp_path / 'run'})") in capsys.readouterr().out


def test_importing_the_module_does_not_load_torch():
    # tools/plot_metrics imports it; torch and tensorboard should load only when a writer needs them.
    code = ("import sys, megaloop.training.monitor; "
            "print(sorted(m for m in ('torch', 'tensorboard') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
