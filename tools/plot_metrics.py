"""Curves of training runs from their metrics.jsonl (written by ``megaloop.training.monitor``):
loss (train, and eval ``val_loss`` as markers), learning rate and throughput (tokens/s) against step,
one colour per run, labelled by the run directory's name.

    python tools/plot_metrics.py runs/dense runs/asymloop --out curves.png

Unreadable lines (a crash can leave the last one half-written) are skipped and counted on stderr; a
missing or empty metrics.jsonl or one without train or eval records, a run directory given twice,
and an ``--out`` that cannot be written, are one-line errors on stderr (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaloop.cli import unwritable
from megaloop.training.plots import MetricsError, load_run, plot_runs, run_labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PNG curves of loss, LR and tokens/s of runs",
                                     allow_abbrev=False)
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default="curves.png",
                        help="image file to write; its suffix sets the format (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    try:
        problem = unwritable(args.out)
        if problem is not None:
            raise MetricsError(f"--out {args.out}: cannot be written ({problem})")
        seen = set()
        for run_dir in args.run_dirs:  # a glob overlapping another: its curves twice
            if Path(run_dir).resolve() in seen:
                raise MetricsError(f"{run_dir}: given twice")
            seen.add(Path(run_dir).resolve())
        runs = {label: load_run(d) for label, d in zip(run_labels(args.run_dirs), args.run_dirs)}
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            plot_runs(runs, args.out)
        except (OSError, ValueError) as error:  # ValueError: an image format matplotlib lacks
            raise MetricsError(f"--out {args.out}: cannot be written "
                               f"({getattr(error, 'strerror', None) or error})") from None
    except MetricsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
