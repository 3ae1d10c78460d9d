"""Train one config under several parallel layouts and check that the loss curves agree.

    python tools/loss_compare.py --preset tiny --layouts single dp2 tp2,sp pp2 tp2,pp2 \\
        --steps 10 data.path='[data/fwe_text_document]' data.tokenizer_model=tok.model

Layouts are megaloop.scale.layout strings (tpN, ppN, dpN, epN, sp, recompute, selrecompute,
single); the first is the reference. Every layout runs ``megaloop.train`` under torchrun (as many processes as it needs)
from the same seed checkpoint, written first by one process. The tolerances are those of
megaloop.scale.loss_compare. Prints JSON (curves and disagreements); exits 1 when the curves
disagree, 2 on bad input (fewer than two layouts, one layout twice, an ``--out`` that holds an
earlier comparison, an override of a setting the tool makes itself: the parallel layout, the
run's length, directories and checkpoints, a ``parallel.pipeline_split`` that a pipelined layout
cannot take or no layout pipelines; what megaloop-train refuses at start-up, such as a vocabulary
smaller than the tokenizer's or data it cannot split, found before any layout runs). What a
--config sets that the tool replaces (its parallel layout and recomputation by each layout's, its
train.train_steps by --steps, its checkpoint settings by the seed checkpoint's) is named in a
note; its ``pipeline_split`` is kept for the layouts of as many stages, and its other parallel
settings (data-parallel overlap, bucket size, timeout) for every layout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from megaloop.cli import (child_failure, default_model_note, int_at_least, quiet_third_party_warnings,
                          refuse_overrides_of, replaced_settings, set_by, train_config_args,
                          with_settings)


def run_settings(steps) -> dict[str, object]:
    """What the tool sets in the config before any layout (``section.field: value``): the run's
    length, and no TensorBoard or long evaluations, which the comparison does not read."""
    return {"train.train_steps": steps, "train.tensorboard": False, "train.eval_iters": 1}


def set_by_the_tool() -> dict[str, str | None]:
    """For refuse_overrides_of: every field the tool sets (``run_settings``, the layouts' parallel
    section, ``seed_settings``) and what sets it; an override of one would be silently replaced.
    parallel.pipeline_split is kept (Layout.apply) or refused (check_pipeline_split)."""
    import dataclasses

    from megaloop.config import ParallelConfig
    from megaloop.scale.layout import LAYOUT_FIELDS
    from megaloop.scale.loss_compare import seed_settings

    settings = {**run_settings("--steps"), **seed_settings("seed", "--out/layout")}
    kept = {f"parallel.{f.name}": None for f in dataclasses.fields(ParallelConfig)
            if f.name not in LAYOUT_FIELDS}  # Layout.apply keeps them (data-parallel overlap)
    return {"parallel.*": "--layouts (e.g. tp2,sp or dp2,recompute)", **kept,
            "parallel.pipeline_split": None,
            **set_by(settings, ("--steps", "--out"),
                     "the tool for every layout (all start from one seed checkpoint)")}


def layout_configs(cfg, layouts: list, steps: int, out: Path) -> list:
    """The config each layout runs: ``cfg`` with ``run_settings``, the layout's parallel section
    and ``seed_settings`` (the seed checkpoint in ``out``/seed)."""
    from megaloop.scale.loss_compare import seeded_config

    cfg = with_settings(cfg, run_settings(steps))
    seed = str(out / "seed" / "checkpoints")
    return [seeded_config(cfg, layout, seed, str(run_dir(out, layout))) for layout in layouts]


def run_dir(out: Path, layout) -> Path:
    """Where ``layout``'s run writes in ``out``."""
    return out / layout.name.replace(",", "_")


def check_pipeline_split(cfg, texts: list[str], layouts: list) -> None:
    """Refuses (ConfigError) a config's ``parallel.pipeline_split`` that a pipelined layout has
    another number of stages for, or that no layout pipelines: it would be left out for the
    balanced split without a word. Megatron-LM likewise refuses uneven-pipeline arguments its
    stages cannot take rather than fall back to an even split; a one-stage layout has no split to
    take, so it runs the whole model as the split's layouts do."""
    from megaloop.config import ConfigError

    split = cfg.parallel.pipeline_split
    if not split:
        return
    stages = len(split)
    for text, layout in zip(texts, layouts):
        if layout.pipeline > 1 and layout.pipeline * layout.virtual != stages:
            raise ConfigError(
                f"parallel.pipeline_split={split}: cuts {stages} stages, layout {text!r} has "
                f"{layout.pipeline * layout.virtual}; compare layouts of {stages} stages (pp x vp)"
                " and one-stage ones, or leave the split out (each layout then splits evenly)")
    if all(layout.pipeline == 1 for layout in layouts):
        raise ConfigError(f"parallel.pipeline_split={split}: none of --layouts {' '.join(texts)} "
                          f"is pipelined; add one of {stages} stages (e.g. pp{stages}) or leave "
                          "the split out")


def check_layouts_and_out(texts: list[str], layouts: list, out: Path) -> None:
    """Refuses (ConfigError) a comparison with nothing to compare, the same layout twice, and an
    ``out`` holding an earlier comparison (its checkpoints would be refused mid-way)."""
    from megaloop.config import ConfigError

    if len(layouts) < 2:
        raise ConfigError(f"--layouts {' '.join(texts)}: give at least two (the first is the "
                          "reference the others are compared with)")
    names = [layout.name for layout in layouts]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"--layouts: {texts[names.index(name)]!r} and {texts[i]!r} are "
                              "the same layout")
    earlier = [d for d in ["seed", *(n.replace(",", "_") for n in names)] if (out / d).exists()]
    if earlier:
        raise ConfigError(f"--out {out}: holds an earlier comparison ({', '.join(earlier)}); "
                          "remove it or give another --out")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", required=True, help="e.g. single dp2 tp2,sp pp2")
    parser.add_argument("--steps", type=int_at_least(1), default=10)
    parser.add_argument("--preset", help="model size preset (as megaloop-train)")
    parser.add_argument("--config", help="YAML run config (as megaloop-train)")
    parser.add_argument("--out", default="runs/loss_compare", help="work directory")
    parser.add_argument("overrides", nargs="*", help="section.field=value, as megaloop-train")
    args = parser.parse_intermixed_args(argv)  # overrides before or after options

    from megaloop.config import save_yaml
    from megaloop.scale.layout import parse_layout
    from megaloop.scale.loss_compare import compare_curves, read_curve, save_seed_checkpoint
    from megaloop.train import bad_input_errors, build_config

    quiet_third_party_warnings()
    try:
        refuse_overrides_of(args.overrides, set_by_the_tool())
        layouts = [parse_layout(text) for text in args.layouts]
        given, _ = build_config(train_config_args(args.preset, args.config) + args.overrides)
        cfg = with_settings(given, run_settings(args.steps))
        check_pipeline_split(cfg, args.layouts, layouts)
        out = Path(args.out)
        configs = layout_configs(given, layouts, args.steps, out)
        for layout_cfg in configs:
            layout_cfg.validate()
        check_layouts_and_out(args.layouts, layouts, out)
        from megaloop.training.data import dataset_tokenizer

        dataset_tokenizer(cfg)  # as the dry run does: a vocabulary too small for it, at once
        note = default_model_note(args.preset, args.config, cfg.model)
        if note:
            print(f"note: {note}", file=sys.stderr)
        replaced = replaced_settings(given, configs, set_by_the_tool())
        if replaced:
            print(f"note: {args.config}: {replaced}", file=sys.stderr)
        # The seed checkpoint is the trainer's start-up on this one process: its checks of the
        # data come before any layout's torchrun, refused in one line as megaloop-train does.
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON report only
            seed = save_seed_checkpoint(cfg, str(out / "seed"))
    except bad_input_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    assert Path(seed) == out / "seed" / "checkpoints"  # where layout_configs load it from
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    curves = {}
    for text, layout, layout_cfg in zip(args.layouts, layouts, configs):
        directory = run_dir(out, layout)
        directory.mkdir(parents=True)
        config_path = directory / "layout.yaml"
        save_yaml(layout_cfg, config_path)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={layout.world_size}", "-m", "megaloop.train",
                   "--config", str(config_path)]
        failure = child_failure(subprocess.run(command, env=env, capture_output=True, text=True),
                                f"layout {text!r}")
        if failure:
            print(f"error: {failure}", file=sys.stderr)
            return 1
        curves[text] = read_curve(directory)
    problems = compare_curves(curves)
    print(json.dumps({"layouts": args.layouts, "steps": args.steps, "curves": curves,
                      "agree": not problems, "problems": problems}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
