"""A finished run relaunched (its own latest checkpoint at ``train.train_steps``): what of its final
evaluation its metrics.jsonl lacks, which the relaunch makes, and what its changed settings do.

With ``checkpoint.save_interval`` dividing ``train.train_steps`` the last step's checkpoint is
saved before the final evaluation, so a job killed during it (SIGKILL, a node lost) leaves a run
complete without its record. The relaunch trains no step and saves nothing: a changed setting is
applied only where that evaluation reads it, and the line saying the run is complete names which.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megaloop.config import RunConfig
from megaloop.data.blend import split_weights

# What the final evaluations read of the model the relaunch builds, besides the checkpoint's
# weights, and where they are logged (metrics.jsonl in train.out_dir, a location, and these two).
_MODEL_AND_LOGS = (
    "model.iterations", "model.joint_attention", "model.rotary_base", "model.norm_eps",
    "model.moe_top_k", "model.residual_scale_init", "train.precision", "train.tensorboard",
    "train.wandb_project")
# The final validation (val_loss and the eval_depths table) reads, besides: the layout it runs
# in and the held-out samples (their data, split and shuffle seed, batched by the batch sizes).
VALIDATION_READS = (
    *_MODEL_AND_LOGS,
    "parallel.tensor", "parallel.pipeline", "parallel.expert", "parallel.sequence_parallel",
    "parallel.virtual_pipeline", "parallel.pipeline_split", "parallel.distributed_timeout_minutes",
    "train.seed", "train.micro_batch_size", "train.global_batch_size", "train.fp8_recipe",
    "train.eval_iters", "train.eval_depths",
    "data.path", "data.split", "data.tokenizer_type", "data.tokenizer_model",
    "data.legacy_tokenizer", "data.eod_id", "data.eod_mask_loss", "data.format",
    "data.sft_prompt", "data.sft_solution")
# The final downstream evaluation (train.downstream_eval) reads, besides: its own settings and the
# tokenizer it gives the harness; it runs on rank 0 alone, on an fp32 copy of the model.
DOWNSTREAM_READS = (
    *_MODEL_AND_LOGS, "train.downstream_eval", "data.tokenizer_type", "data.tokenizer_model",
    "data.legacy_tokenizer")
# Each final record's kind in metrics.jsonl: what the lines call it, what making it reads.
_RECORDS = {"eval": ("evaluation", VALIDATION_READS),
            "downstream": ("downstream evaluation", DOWNSTREAM_READS)}


def missing_records(cfg: RunConfig, step: int) -> tuple[str, ...]:
    """The final records of ``step`` that metrics.jsonl in ``train.out_dir`` lacks, of those the
    run makes: "eval" where ``data.split`` gives the validation split a weight, "downstream"
    where ``train.downstream_eval`` names tasks. Read where called (``check_resume``: on rank 0,
    shared)."""
    from megaloop.training.monitor import logged_kinds

    made = [kind for kind, asked in (("eval", split_weights(str(cfg.data.split))[1]),
                                     ("downstream", cfg.train.downstream_eval.tasks)) if asked]
    if not made:  # a run without validation data nor downstream tasks logged no evaluation
        return ()
    logged = logged_kinds(cfg.train.out_dir, step)
    return tuple(kind for kind in made if kind not in logged)


def complete_lines(path: Path, cfg: RunConfig, step: int, changed: list[str],
                   missing: tuple[str, ...]) -> list[tuple[int, str]]:
    """The log lines of a finished run relaunched from its checkpoint ``path`` at ``step``:
    what of its final evaluation is missing (made now), then that it is complete, naming each of
    the ``changed`` settings as applied by that evaluation or not applied."""
    from megaloop.training.monitor import METRICS_FILE

    names = [_RECORDS[kind][0] for kind in missing]
    lines = [] if not missing else [(
        logging.WARNING, f"{path}: no final {' nor '.join(names)} of step {step} in "
                         f"{Path(cfg.train.out_dir) / METRICS_FILE} (the run was stopped during "
                         "it, it failed, or the run had not asked for it): making it now")]
    reads = {name for kind in missing for name in _RECORDS[kind][1]}
    applied = [name for name in changed if name in reads]
    unused = [name for name in changed if name not in reads]
    notes = (f"; changed settings applied by the final {' and '.join(names)} made now: "
             f"{', '.join(applied)}" if applied else "")
    if unused:
        notes += f"; {'not applied' if applied else 'changed settings not applied'}: " \
                 f"{', '.join(unused)}"
    lines.append((logging.WARNING if unused else logging.INFO,
                  f"{path}: the run is complete at step {step} (train.train_steps={step}): "
                  f"nothing to train (raise train.train_steps to continue it){notes}"))
    return lines
