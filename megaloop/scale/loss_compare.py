"""Layout parity: one config trained under several parallel layouts gives the same loss curve.

Every layout starts from the same seed checkpoint (the initial weights saved by one process:
initialisation draws differ between layouts, since each pipeline stage and tensor-parallel rank
seeds its own part) and reads the same global batches, so the losses may differ only by the
order of floating-point sums:

- a layout that differs from the first only in its pipeline (and virtual pipeline) size must agree
  with it bit for bit at the first step: the stages run the same forward operations in the same
  order, only on other processes. After that it agrees to ``RTOL``: a pipeline that unrolls a loop
  holds tied copies of decoder layers, whose gradients (one partial sum per copy) are added in
  another order than one process accumulates them (Dense, without tied copies, stays bit-exact;
  measured on the tiny Full Loop config: one rounding step, 4.8e-7, at step 8 of 10);
- a layout and the same layout with ``recompute`` or ``selrecompute`` must agree bit for bit at
  the first step (recomputation replays the same forward on the same weights); after that they
  may differ by rounding, since recomputing layer by layer changes the order in which the
  gradients of the K applications of a weight-tied layer and of the Global KV are summed;
- every other step and layout agrees with the first layout to ``RTOL`` relative. Data parallelism
  sums gradients across ranks and tensor / sequence parallelism sums partial matmuls and norm
  gradients in another order than one process does. Measured on the tiny test configs (fp32, 10
  steps): DP=2, TP=2 and TP=2 + SP stay within 1.1e-7 (one rounding step) of one process, while a
  sequence-parallel norm whose gradient is not reduced over the tensor-parallel ranks is off by
  7e-6 by step 6. Rounding differences grow as training goes on, so the tolerance is meant for
  short runs (tens of steps) of small models.

``train_curve`` trains on the calling processes (any launcher, or tests.distributed's workers);
``compare_curves`` checks a set of curves; tools/loss_compare.py launches one torchrun per layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from megaloop.cli import with_settings
from megaloop.config import RunConfig
from megaloop.scale.layout import Layout, parse_layout

RTOL = 1e-6


def seed_settings(seed_checkpoint: str, out_dir: str) -> dict[str, object]:
    """What every layout's run is given (``section.field: value``): it writes to ``out_dir`` and
    starts from the seed checkpoint's weights, with a fresh optimizer and no saved progress, so
    every layout starts alike."""
    return {"train.out_dir": out_dir, "checkpoint.dir": str(Path(out_dir) / "checkpoints"),
            "checkpoint.load": seed_checkpoint, "checkpoint.load_optimizer": False,
            "checkpoint.resume": False, "checkpoint.save_interval": 0}


def seeded_config(cfg: RunConfig, layout: Layout, seed_checkpoint: str, out_dir: str) -> RunConfig:
    """``cfg`` under ``layout`` with ``seed_settings``."""
    return with_settings(layout.apply(cfg), seed_settings(seed_checkpoint, out_dir))


def save_seed_checkpoint(cfg: RunConfig, out_dir: str) -> str:
    """Saves ``cfg``'s initial weights (one process, no layout) and returns the checkpoint dir."""
    from megaloop.training.trainer import Trainer

    seed = dataclasses.replace(
        cfg, parallel=Layout().parallel_config(),
        train=dataclasses.replace(cfg.train, out_dir=out_dir),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=None, load=None, resume=False))
    with Trainer(seed) as trainer:
        trainer.save()
    return str(Path(out_dir) / "checkpoints")


def read_curve(out_dir: str | Path) -> dict[int, float]:
    """Training losses by step from a run's metrics.jsonl."""
    curve = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            curve[record["step"]] = record["loss"]
    return curve


def train_curve(rank: int, world_size: int, cfg: RunConfig, layout: str, seed_checkpoint: str,
                out_dir: str) -> dict[int, float] | None:
    """Trains ``cfg`` under ``layout`` on the ``world_size`` calling processes; rank 0 returns the
    loss curve. (The signature is tests.distributed.run_distributed's.)"""
    from megaloop.training.trainer import Trainer

    parsed = parse_layout(layout)
    if parsed.world_size != world_size:
        raise ValueError(f"layout {layout!r} needs {parsed.world_size} processes, got {world_size}")
    Trainer(seeded_config(cfg, parsed, seed_checkpoint, out_dir)).train()
    return read_curve(out_dir) if rank == 0 else None


def _finite(loss) -> bool:
    return isinstance(loss, (int, float)) and math.isfinite(loss)


def _without_recompute(layout: str) -> str:
    return dataclasses.replace(parse_layout(layout), recompute="none").name


def compare_curves(curves: dict[str, dict[int, float]], rtol: float = RTOL) -> list[str]:
    """Checks the curves of several layouts against the first; returns one line per disagreement,
    empty when all agree (the rules are in the module docstring)."""
    names = list(curves)
    reference, first = curves[names[0]], parse_layout(names[0])
    by_layout = {parse_layout(name).name: name for name in names}
    # A skipped step logs loss null; a NaN would compare as within tolerance of anything.
    problems = []
    for name, curve in curves.items():
        skipped = [step for step in sorted(curve) if not _finite(curve[step])]
        if skipped:
            problems.append(f"{name}: step {skipped[0]} loss {curve[skipped[0]]!r}: a skipped "
                            "(NaN/Inf) step, nothing to compare")
    if problems:
        return problems
    for name in names[1:]:
        curve = curves[name]
        if curve.keys() != reference.keys():
            problems.append(f"{name}: steps {sorted(curve)} differ from {names[0]}'s "
                            f"{sorted(reference)}")
            continue
        twin = by_layout.get(_without_recompute(name))
        if twin not in (None, name) and curve[min(curve)] != curves[twin][min(curve)]:
            step = min(curve)
            problems.append(f"{name}: step {step} loss {curve[step]!r} vs {twin} "
                            f"{curves[twin][step]!r} (recomputation must agree exactly at the "
                            "first step)")
        pipeline_only = dataclasses.replace(parse_layout(name), pipeline=first.pipeline,
                                            virtual=first.virtual) == first
        for step in sorted(reference):
            want, got = reference[step], curve[step]
            exact = pipeline_only and step == min(reference)
            rule = ("exactly at the first step (pipeline stages only)" if exact
                    else f"to rtol={rtol:g}")
            if got != want if exact else abs(got - want) > rtol * abs(want):
                problems.append(f"{name}: step {step} loss {got!r} vs {names[0]} {want!r} (must "
                                f"agree {rule}; difference {got - want:.3g})")
                break
    return problems
