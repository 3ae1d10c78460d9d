"""Training monitor: a rich progress bar or compact log lines, a JSONL metrics log, TensorBoard,
optional wandb, TFLOP/s and MFU from the analytical FLOPs, and GPU (NVML) or host (RSS) stats.

Every rank constructs a ``Monitor``; only the writer (global rank 0) opens files, NVML, TensorBoard
or wandb, so callers need no rank checks around it.

Steps count completed optimizer steps, 1..total_steps. ``metrics.jsonl`` in the run directory holds
one JSON object per line: ``{"kind": "train", "step": ...}`` per step, ``{"kind": "eval",
"step": ...}`` per evaluation and ``{"kind": "downstream", "step": ..., "task": ...}`` per task of a
downstream evaluation. Non-finite numbers (the NaN loss of a skipped step) are written as
null, so the file stays strict JSON that any reader accepts.

    monitor = Monitor(run_dir, is_writer=rank == 0, total_steps=1000, tokens_per_step=512 * 1024,
                      model_flops_per_token=model_flops_per_token(cfg), world_size=8,
                      resume_step=start_step)
    monitor.log_step(step, loss=2.31, lr=3e-4, grad_norm=0.8, step_time_s=1.2, skipped=False)
    monitor.log_eval(step, {"val_loss": 2.4, "val_ppl": 11.0})
    monitor.close()
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import numbers
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from megaloop.config import ConfigError
from megaloop.platform.files import atomic_open, write_text_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets, matched by substring
# of the NVML device name; the first match wins, so "H100 PCIe" precedes the SXM names. Parts not
# listed (H100 NVL, consumer cards) stay unknown and get a null MFU rather than a guessed one.
BF16_PEAK_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 80GB HBM3", 989.4),
    ("H100 SXM", 989.4),
    ("A100", 312.0),
)
FP8_CAPABLE = ("H100", "H200")  # Hopper's fp8 tensor cores double the bf16 peak; Ampere has none
# fp32 has no tensor-core peak unless TF32 is switched on, which PyTorch does not do for matmuls by
# default, so fp32 runs get no auto peak.
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")

# Keys a train record always carries; extra metrics may not shadow them.
TRAIN_FIELDS = ("kind", "step", "time", "loss", "lr", "grad_norm", "skipped", "step_time_s",
                "tokens_per_s", "loss_tokens_per_s", "tflops_per_device", "mfu", "eta_s")
# The first step a process runs includes warm-up (allocator growth, kernel autotuning), so it is left
# out of the window of recent step times that the ETA is estimated from.
ETA_WINDOW_STEPS = 50


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense tensor-core peak TFLOP/s of one device at ``precision``, or None if not known."""
    if precision == "fp32":
        return None
    for pattern, bf16 in BF16_PEAK_TFLOPS:
        if pattern in device_name:
            if precision != "fp8":
                return bf16
            return 2 * bf16 if any(arch in device_name for arch in FP8_CAPABLE) else None
    return None


def read_metrics(path: str | os.PathLike) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and how many lines could not be read.

    A crash can leave a half-written last line, and a file may be edited by hand: such lines are
    counted, not raised, so that a run can resume and plots can be drawn from what is intact."""
    records, malformed = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                malformed += 1
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                records.append(record)
            else:
                malformed += 1
    return records, malformed


def logged_kinds(out_dir: str | os.PathLike, step: int) -> set[str]:
    """The kinds of the records of ``step`` in ``out_dir``'s metrics.jsonl ("eval",
    "downstream", ...; none without the file)."""
    path = Path(out_dir) / METRICS_FILE
    return {record.get("kind") for record in read_metrics(path)[0]
            if record["step"] == step} if path.exists() else set()


def _json_number(value: float | int | bool | None) -> float | int | bool | None:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _checked_metrics(metrics: dict, reserved: tuple[str, ...], where: str) -> dict:
    """Numeric metrics as plain Python numbers; anything else is a one-line error naming the key."""
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key in reserved:
            raise ValueError(f"{where}: metric key {key!r} is reserved or not a string")
        if value is not None and not isinstance(value, numbers.Real):
            raise ValueError(f"{where}: metric {key!r} must be a number, got {type(value).__name__} "
                             f"{value!r}")
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, int)):
            value = float(value)  # numpy scalars are Real but not JSON-serialisable
        out[key] = _json_number(value)
    return out


def _scalars(prefix: str, record: dict) -> dict[str, float]:
    """TensorBoard/wandb scalars of a record: every number except the step and wall time."""
    return {f"{prefix}/{key}": float(value) for key, value in record.items()
            if key not in ("kind", "step", "time") and isinstance(value, (int, float))}


def _format_number(value: float | None, spec: str = ".5g") -> str:
    return "n/a" if value is None else format(value, spec)


def _format_rate(tokens_per_s: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{suffix}"
    return f"{tokens_per_s:.0f}"


def _format_eta(seconds: float | None) -> str:
    return "n/a" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def _visible_gpu_indices(count: int) -> list[int]:
    """NVML indices of the GPUs this job may use: NVML sees the whole node, CUDA_VISIBLE_DEVICES
    restricts the job. UUID or MIG identifiers are not mapped; every GPU is reported then."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    parts = [p.strip() for p in env.split(",") if p.strip()]
    if all(p.isdigit() for p in parts):
        return [int(p) for p in parts if int(p) < count]
    return list(range(count))


def import_summary_writer(field: str = "tensorboard"):
    """torch's SummaryWriter; a missing package is a RuntimeError naming ``field``, the setting
    that asked for it (the Trainer checks under the config's name before its set-up)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise RuntimeError(f"{field}=True needs the tensorboard package (pip install tensorboard, "
                           f"or set {field}=false): {error}") from None
    return SummaryWriter


def import_wandb(project: str, field: str = "wandb_project"):
    """The wandb module; a missing package is a RuntimeError naming ``field``, as above."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError(f"{field}={project!r} is set but wandb is not installed (pip install "
                           f"wandb, or leave {field} unset)") from None
    return wandb


class DeviceStats:
    """Memory, utilization and power of this node's visible GPUs through NVML, or the process's RSS
    and CPU use when NVML or a GPU is unavailable (``unavailable_reason`` says why)."""

    def __init__(self):
        import psutil

        self._process = psutil.Process()
        self._nvml = None
        self.handles: list[tuple[int, Any]] = []
        self.device_name: str | None = None
        self.unavailable_reason: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            self.unavailable_reason = "nvidia-ml-py is not installed"
            return
        except pynvml.NVMLError as error:
            self.unavailable_reason = str(error)
            return
        self._nvml = pynvml
        indices = _visible_gpu_indices(pynvml.nvmlDeviceGetCount())
        self.handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        if not self.handles:
            self.unavailable_reason = "no visible devices"
            return
        name = pynvml.nvmlDeviceGetName(self.handles[0][1])
        self.device_name = name.decode() if isinstance(name, bytes) else name  # older bindings: bytes

    @property
    def has_gpu(self) -> bool:
        return self.unavailable_reason is None

    def _nvml_reading(self, read, handle):
        # A reading a device does not support (power under MIG, for one) is left out, not fatal.
        try:
            return read(handle)
        except self._nvml.NVMLError:
            return None

    def sample(self) -> dict[str, float]:
        stats = {"rss_gib": self._process.memory_info().rss / 2**30}
        if not self.has_gpu:
            # Percent of one core since the previous sample (the first call reads 0).
            stats["cpu_pct"] = self._process.cpu_percent(interval=None)
            return stats
        nvml = self._nvml
        for index, handle in self.handles:
            memory = self._nvml_reading(nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                stats[f"gpu{index}_mem_used_gib"] = memory.used / 2**30
                stats[f"gpu{index}_mem_total_gib"] = memory.total / 2**30
            utilization = self._nvml_reading(nvml.nvmlDeviceGetUtilizationRates, handle)
            if utilization is not None:
                stats[f"gpu{index}_util_pct"] = float(utilization.gpu)
            milliwatts = self._nvml_reading(nvml.nvmlDeviceGetPowerUsage, handle)
            if milliwatts is not None:
                stats[f"gpu{index}_power_w"] = milliwatts / 1000
        return stats

    def summary(self, stats: dict[str, float]) -> str:
        """Short text of a sample for a log line."""
        if not self.has_gpu:
            return f"rss {stats['rss_gib']:.2f} GiB cpu {stats['cpu_pct']:.0f}%"
        parts = []
        for index, _ in self.handles:
            used, total = stats.get(f"gpu{index}_mem_used_gib"), stats.get(f"gpu{index}_mem_total_gib")
            text = f"gpu{index}"
            if used is not None:
                text += f" {used:.1f}/{total:.0f} GiB"
            if f"gpu{index}_util_pct" in stats:
                text += f" {stats[f'gpu{index}_util_pct']:.0f}%"
            if f"gpu{index}_power_w" in stats:
                text += f" {stats[f'gpu{index}_power_w']:.0f} W"
            parts.append(text)
        return ", ".join(parts)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


class Monitor:
    """Progress, metrics log, TensorBoard/wandb and device stats of one training run.

    Args:
        out_dir: run directory; metrics.jsonl, tensorboard/ and wandb files go here.
        is_writer: True on global rank 0 only; every other rank's Monitor does nothing.
        total_steps: steps of the whole run, for the bar and the ETA.
        tokens_per_step: tokens in one optimizer step across all data-parallel ranks.
        model_flops_per_token: analytical training FLOPs per token (3x forward,
            ``megaloop.models.flops.model_flops_per_token``).
        world_size: devices the step's FLOPs are spread over, for TFLOP/s per device.
        precision: one of PRECISIONS, choosing the peak when ``peak_tflops_per_device`` is None.
        peak_tflops_per_device: the MFU denominator; None looks it up from the NVML device name,
            and MFU is null where that is unknown (CPU, unlisted GPUs, fp32).
        tensorboard: write TensorBoard scalars under out_dir/tensorboard.
        wandb_project: log to this wandb project too (needs the wandb package).
        run_config: the run's configuration, shown as text in TensorBoard and given to wandb.
        progress: a rich progress bar when stdout is a terminal; otherwise, and when False, a
            compact line every ``log_interval`` steps.
        log_interval: steps between log lines and device stats samples.
        resume_step: the first step this process will log. Lines at or after it in an existing
            metrics.jsonl (and TensorBoard events) came from a crashed run past its checkpoint and
            are dropped; pass the first step of a fresh run too, to clear an older run's lines
            (and start a new wandb run). None appends to whatever is there.
    """

    def __init__(self, out_dir: str | os.PathLike, *, is_writer: bool, total_steps: int,
                 tokens_per_step: int, model_flops_per_token: float, world_size: int,
                 precision: str = "bf16", peak_tflops_per_device: float | None = None,
                 tensorboard: bool = True, wandb_project: str | None = None,
                 run_config: dict | None = None, progress: bool = True, log_interval: int = 10,
                 resume_step: int | None = None):
        for name, value in (("total_steps", total_steps), ("tokens_per_step", tokens_per_step),
                            ("world_size", world_size), ("log_interval", log_interval)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Monitor: {name} must be a positive integer, got {value!r}")
        if not model_flops_per_token > 0:
            raise ValueError(f"Monitor: model_flops_per_token must be > 0, got {model_flops_per_token!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"Monitor: precision must be one of {PRECISIONS}, got {precision!r}")
        if peak_tflops_per_device is not None and not peak_tflops_per_device > 0:
            raise ValueError(f"Monitor: peak_tflops_per_device must be > 0, got {peak_tflops_per_device!r}")
        self.is_writer = is_writer
        self.out_dir = Path(out_dir)
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.model_flops_per_token = model_flops_per_token
        self.world_size = world_size
        self.log_interval = log_interval
        self.peak_tflops_per_device = peak_tflops_per_device
        self._closed = not is_writer
        if not is_writer:
            return
        # Missing packages fail here, before a bar, NVML or a file is opened.
        summary_writer = import_summary_writer() if tensorboard else None
        wandb = import_wandb(wandb_project) if wandb_project else None

        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / METRICS_FILE
        self._bar = None
        self._bar_task = None
        if progress and sys.stdout.isatty():
            self._start_bar(first_step=resume_step or 1)
        self.device_stats = DeviceStats()
        if not self.device_stats.has_gpu:
            self._print(f"gpu stats: no NVIDIA GPU (NVML unavailable: {self.device_stats.unavailable_reason})"
                        " — logging CPU/RSS only")
        if peak_tflops_per_device is None and self.device_stats.has_gpu:
            self.peak_tflops_per_device = peak_tflops(self.device_stats.device_name, precision)
            if self.peak_tflops_per_device is None:
                self._print(f"mfu: no known {precision} peak for {self.device_stats.device_name!r}; "
                            "set train.peak_tflops (peak_tflops_per_device of a Monitor of "
                            "your own) to report MFU")

        if resume_step is not None:
            self._drop_lines_from(resume_step)
        self._metrics_file = self._open_for_append(self.metrics_path)
        self._tensorboard = (self._open_tensorboard(summary_writer, resume_step, run_config)
                             if summary_writer else None)
        self._wandb = (self._open_wandb(wandb, wandb_project, run_config, resume_step)
                       if wandb else None)
        self._recent_step_times: collections.deque[float] = collections.deque(maxlen=ETA_WINDOW_STEPS)
        self._steps_logged = 0

    # ----------------------------------------------------------------------------------- set-up

    def _start_bar(self, first_step: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[status]}"),
                             console=Console(file=sys.stdout, force_terminal=True))
        self._bar_task = self._bar.add_task("train", total=self.total_steps,
                                            completed=first_step - 1, status="")
        self._bar.start()

    def _drop_lines_from(self, resume_step: int) -> None:
        """Rewrite metrics.jsonl atomically with only the lines before ``resume_step``."""
        if not self.metrics_path.exists():
            return
        records, malformed = read_metrics(self.metrics_path)
        kept = [r for r in records if r["step"] < resume_step]
        with atomic_open(self.metrics_path) as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        dropped = len(records) - len(kept)
        if dropped or malformed:
            self._print(f"metrics: resuming at step {resume_step}: dropped {dropped} line(s) at step >= "
                        f"{resume_step} and {malformed} unreadable line(s) from {self.metrics_path}")

    @staticmethod
    def _open_for_append(path: Path):
        # A crash mid-write can leave a last line without its newline; start on a fresh line so the
        # first new record is not glued onto the broken one.
        needs_newline = False
        if path.exists() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        f = open(path, "a", encoding="utf-8")
        if needs_newline:
            f.write("\n")
        return f

    def _open_tensorboard(self, summary_writer, resume_step: int | None, run_config: dict | None):
        # purge_step hides events at or after resume_step left by the crashed run, as for the JSONL.
        writer = summary_writer(log_dir=str(self.out_dir / TENSORBOARD_DIR), purge_step=resume_step)
        if run_config:
            text = json.dumps(run_config, indent=2, default=str)
            # Four-space indentation makes TensorBoard's markdown show it verbatim.
            writer.add_text("run_config", "\n".join("    " + line for line in text.splitlines()),
                            global_step=resume_step or 0)
        return writer

    def _open_wandb(self, wandb, project: str, run_config: dict | None, resume_step: int | None):
        # The run id is kept in the run directory so that a resumed job continues the same wandb
        # run. A run starting at step 1 gets a new one: wandb ignores steps below those a run has
        # logged, so the earlier run's would hide this one's.
        id_path = self.out_dir / WANDB_ID_FILE
        if id_path.exists() and resume_step != 1:
            run_id = id_path.read_text().strip()
        else:
            if id_path.exists():
                self._print(f"wandb: this run starts at step 1: a new wandb run, not "
                            f"{id_path.read_text().strip()} (the earlier run in {self.out_dir})")
            run_id = uuid.uuid4().hex[:8]
            write_text_atomic(id_path, run_id + "\n")
        return wandb.init(project=project, name=self.out_dir.name, id=run_id, resume="allow",
                          dir=str(self.out_dir), config=run_config or {})

    # ----------------------------------------------------------------------------------- logging

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def _write(self, record: dict, scalars: dict[str, float] | None = None) -> None:
        """``scalars``: TensorBoard/wandb tags and values (default: every number of the record
        under its kind)."""
        # Flushed per line so the log survives a crash of the process up to its last step.
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if scalars is None:
            scalars = _scalars(record["kind"], record)
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, global_step=record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def _is_report_step(self, step: int) -> bool:
        # The first step of a process is reported too: it shows a job is alive before log_interval.
        return step % self.log_interval == 0 or step == self.total_steps or self._steps_logged == 1

    def log_step(self, step: int, *, loss: float, lr: float, grad_norm: float | None,
                 step_time_s: float, skipped: bool, loss_tokens: int | None = None,
                 extra: dict | None = None) -> None:
        """Record one optimizer step; ``step_time_s`` is its wall time, data loading included.
        ``loss_tokens``: the tokens of the step the loss counts. ``tokens_per_s`` counts every
        position processed (padding and prompts included: the rate the hardware sustains, as
        Megatron-LM reports it); where the loss mask drops some, as in fine-tuning,
        ``loss_tokens_per_s`` is the rate of tokens trained on."""
        if not self.is_writer:
            return
        if not step_time_s > 0:
            raise ValueError(f"Monitor.log_step: step_time_s must be > 0, got {step_time_s!r} at step {step}")
        self._steps_logged += 1
        if self._steps_logged > 1:
            self._recent_step_times.append(step_time_s)
        mean_step_s = (sum(self._recent_step_times) / len(self._recent_step_times)
                       if self._recent_step_times else step_time_s)
        tokens_per_s = self.tokens_per_step / step_time_s
        loss_tokens_per_s = None if loss_tokens is None else loss_tokens / step_time_s
        tflops_per_device = tokens_per_s * self.model_flops_per_token / self.world_size / 1e12
        mfu = (tflops_per_device / self.peak_tflops_per_device
               if self.peak_tflops_per_device is not None else None)
        record = {
            "kind": "train", "step": step, "time": round(time.time(), 3),
            "loss": _json_number(float(loss)), "lr": float(lr),
            "grad_norm": None if grad_norm is None else _json_number(float(grad_norm)),
            "skipped": bool(skipped), "step_time_s": step_time_s, "tokens_per_s": tokens_per_s,
            "loss_tokens_per_s": loss_tokens_per_s,
            "tflops_per_device": tflops_per_device, "mfu": mfu,
            "eta_s": max(self.total_steps - step, 0) * mean_step_s,
        }
        report = self._is_report_step(step)
        stats = self.device_stats.sample() if report else {}
        record.update(stats)
        if extra:
            record.update(_checked_metrics(extra, TRAIN_FIELDS + tuple(stats), "Monitor.log_step extra"))
        self._write(record)

        rate = f"{_format_rate(tokens_per_s)} tok/s"
        if loss_tokens is not None and loss_tokens < self.tokens_per_step:
            rate += f" ({_format_rate(loss_tokens_per_s)} in the loss)"
        status = (f"loss {_format_number(record['loss'], '.4f')} | lr {lr:.3e} | {rate}"
                  f" | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
                  f" | ETA {_format_eta(record['eta_s'])}")
        if self._bar is not None:
            self._bar.update(self._bar_task, completed=step, status=status)
        elif report:
            line = (f"step {step}/{self.total_steps} | {status} | gnorm "
                    f"{_format_number(record['grad_norm'], '.4g')} | "
                    f"{tflops_per_device:.1f} TFLOP/s/dev | {self.device_stats.summary(stats)}")
            self._print(line + (" | skipped (non-finite)" if skipped else ""))

    def log_eval(self, step: int, metrics: dict) -> None:
        """Record evaluation metrics at ``step``, e.g. {"val_loss": .., "val_ppl": .., "val_loss_k1": ..}."""
        if not self.is_writer:
            return
        if not metrics:
            raise ValueError(f"Monitor.log_eval: no metrics given at step {step}")
        checked = _checked_metrics(metrics, ("kind", "step", "time"), "Monitor.log_eval")
        self._write({"kind": "eval", "step": step, "time": round(time.time(), 3), **checked})
        self._print(f"eval step {step} | " + " | ".join(f"{key} {_format_number(value)}"
                                                         for key, value in checked.items()))

    def log_downstream(self, step: int, task: str, metrics: dict, *, num_fewshot: int,
                       iterations: int | None) -> None:
        """Record one task's downstream metrics at ``step`` (a ``kind: downstream`` line; tags
        ``downstream/<task>_<n>shot[_k<K>]/<metric>``), e.g. {"acc": 0.61, "acc_norm": 0.64}."""
        if not self.is_writer:
            return
        if not metrics:
            raise ValueError(f"Monitor.log_downstream: no metrics given for {task} at step {step}")
        checked = _checked_metrics(metrics, ("kind", "step", "time", "task", "num_fewshot",
                                             "iterations"), "Monitor.log_downstream")
        record = {"kind": "downstream", "step": step, "time": round(time.time(), 3),
                  "task": task, "num_fewshot": num_fewshot, "iterations": iterations, **checked}
        setting = f"{task}_{num_fewshot}shot" + ("" if iterations is None else f"_k{iterations}")
        self._write(record, {f"downstream/{setting}/{key}": float(value)
                             for key, value in checked.items() if value is not None})
        self._print(f"downstream step {step} | {setting} | " + " | ".join(
            f"{key} {_format_number(value)}" for key, value in checked.items()
            if not key.endswith("_stderr")))

    def close(self) -> None:
        """Stop the bar and close the log, TensorBoard, wandb and NVML; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.stop()
        self._metrics_file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        self.device_stats.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_logging_packages(train) -> None:
    """Refuses train.tensorboard / train.wandb_project without its package, in one line before
    set-up: the Monitor that imports them is built last, after the model and the checkpoint load.
    Every rank checks, so that all stop here alike."""
    try:
        if train.tensorboard:
            import_summary_writer("train.tensorboard")
        if train.wandb_project:
            import_wandb(train.wandb_project, "train.wandb_project")
    except RuntimeError as e:
        raise ConfigError(str(e)) from None
