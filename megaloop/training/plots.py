"""Loss, learning-rate and throughput curves of training runs, from their metrics.jsonl files.

Used by ``tools/plot_metrics.py`` and by the quickstart. Unreadable lines (a crash can leave the last
one half-written) are skipped and counted; a missing or empty metrics.jsonl, or one without train
or eval records, is a one-line ``MetricsError``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megaloop.platform.files import atomic_path
from megaloop.training.monitor import METRICS_FILE, read_metrics


class MetricsError(Exception):
    """A run directory whose metrics cannot be plotted; the message is one line naming the file."""


def load_run(run_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Train and eval records of one run, each sorted by step."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"{path}: no such file (is {run_dir} a run directory?)")
    if path.stat().st_size == 0:
        raise MetricsError(f"{path}: file is empty")
    records, malformed = read_metrics(path)
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
    if not train and not evals:  # the error counts the malformed lines: no note before it
        raise MetricsError(f"{path}: no train or eval records ({len(records)} other, "
                           f"{malformed} malformed line(s))")
    if malformed:
        print(f"{path}: skipped {malformed} malformed line(s)", file=sys.stderr)
    return train, evals


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    # Null values (the loss of a skipped step) become NaN: a gap in the line, not a zero.
    points = [(r["step"], r[key]) for r in records if key in r]
    return ([s for s, _ in points],
            [float("nan") if not isinstance(v, (int, float)) else float(v) for _, v in points])


def run_labels(run_dirs: list[str]) -> list[str]:
    """Directory names, or whole paths where two runs share a name."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def plot_runs(runs: dict[str, tuple[list[dict], list[dict]]], out: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (loss_ax, lr_ax, rate_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, (label, (train, evals)) in enumerate(runs.items()):
        color = f"C{index % 10}"
        loss_ax.plot(*_series(train, "loss"), color=color, linewidth=1, label=f"{label} train")
        if evals:
            loss_ax.plot(*_series(evals, "val_loss"), "o--", color=color, markersize=4,
                         label=f"{label} eval")
        lr_ax.plot(*_series(train, "lr"), color=color, label=label)
        rate_ax.plot(*_series(train, "tokens_per_s"), color=color, linewidth=1, label=label)
    loss_ax.set(title="loss", xlabel="step", ylabel="cross-entropy")
    lr_ax.set(title="learning rate", xlabel="step", ylabel="LR")
    rate_ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    for ax in (loss_ax, lr_ax, rate_ax):
        if ax.lines:
            ax.legend(fontsize=8)
    save_figure(fig, out)


def save_figure(fig, out: str | os.PathLike) -> None:
    """Writes ``fig`` beside ``out`` and renames it, so that an existing plot is never left
    half-written and a failed write leaves no temporary; closes the figure. The format is the
    file name's suffix (PNG without one); one matplotlib cannot write is a ValueError."""
    import matplotlib.pyplot as plt

    out = Path(out)
    kind = out.suffix[1:].lower() or "png"
    supported = fig.canvas.get_supported_filetypes()
    if kind not in supported:
        plt.close(fig)
        raise ValueError(f"{out}: matplotlib writes no .{kind} files (it writes "
                         f"{', '.join(sorted(supported))})")
    fig.tight_layout()
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=120, format=kind)
    finally:
        plt.close(fig)
