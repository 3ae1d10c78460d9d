"""Curves of training runs from their metrics.jsonl (written by ``megaloop.training.monitor``):
loss (train, and eval ``val_loss`` as markers), learning rate and throughput (tokens/s) against step,
one colour per run, labelled by the run directory's name.

    python tools/plot_metrics.py runs/dense runs/asymloop --out curves.png

Unreadable lines (a crash can leave the last one half-written) are skipped and counted on stderr; a
missing, empty or wholly unreadable metrics.jsonl, and an ``--out`` that cannot be written, are
one-line errors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megaloop.cli import run_tool, unwritable
from megaloop.training.plots import MetricsError, load_run, plot_runs, run_labels


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description="Curves of loss, LR and tokens/s of runs")
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default="curves.png",
                        help="image file to write; its suffix sets the format (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    problem = unwritable(args.out)
    if problem is not None:
        raise SystemExit(f"plot_metrics: --out {args.out}: cannot be written ({problem})")
    try:
        runs = {label: load_run(d) for label, d in zip(run_labels(args.run_dirs), args.run_dirs)}
    except MetricsError as error:
        raise SystemExit(f"plot_metrics: {error}") from None
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        plot_runs(runs, args.out)
    except (OSError, ValueError) as error:  # ValueError: an image format matplotlib lacks
        raise SystemExit(f"plot_metrics: --out {args.out}: cannot be written "
                         f"({getattr(error, 'strerror', None) or error})") from None
    print(args.out)
    return args.out


if __name__ == "__main__":
    run_tool(main)
