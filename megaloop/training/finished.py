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

# What the final validation (val_loss and the eval_depths table) reads besides the checkpoint's
# weights: the model the relaunch builds, the layout and precision it runs in, the held-out
# samples (their data, split and shuffle seed, batched by the batch sizes) and where it is
# logged (metrics.jsonl in train.out_dir, which is a location, and these two).
VALIDATION_READS = (
    "model.iterations", "model.joint_attention", "model.rotary_base", "model.norm_eps",
    "model.moe_top_k", "model.residual_scale_init",
    "parallel.tensor", "parallel.pipeline", "parallel.expert", "parallel.sequence_parallel",
    "parallel.virtual_pipeline", "parallel.pipeline_split", "parallel.distributed_timeout_minutes",
    "train.seed", "train.micro_batch_size", "train.global_batch_size", "train.precision",
    "train.fp8_recipe", "train.eval_iters", "train.eval_depths", "train.tensorboard",
    "train.wandb_project",
    "data.path", "data.split", "data.tokenizer_type", "data.tokenizer_model",
    "data.legacy_tokenizer", "data.eod_id", "data.eod_mask_loss", "data.format",
    "data.sft_prompt", "data.sft_solution")


def missing_records(cfg: RunConfig, step: int) -> tuple[str, ...]:
    """The final records of ``step`` that metrics.jsonl in ``train.out_dir`` lacks: ("eval",)
    where ``data.split`` gives the validation split a weight and no eval record of ``step`` is
    there; () otherwise. Read where called (``check_resume``: on rank 0, shared)."""
    from megaloop.training.monitor import logs_evaluation

    if not split_weights(str(cfg.data.split))[1]:  # validated: three weights
        return ()  # no validation data: a finished run logged no evaluation
    return () if logs_evaluation(cfg.train.out_dir, step) else ("eval",)


def complete_lines(path: Path, cfg: RunConfig, step: int, changed: list[str],
                   missing: tuple[str, ...]) -> list[tuple[int, str]]:
    """The log lines of a finished run relaunched from its checkpoint ``path`` at ``step``:
    what of its final evaluation is missing (made now), then that it is complete, naming each of
    the ``changed`` settings as applied by that evaluation or not applied."""
    from megaloop.training.monitor import METRICS_FILE

    lines = []
    reads: set[str] = set()
    if missing:
        lines.append((logging.WARNING, f"{path}: no final evaluation of step {step} in "
                                       f"{Path(cfg.train.out_dir) / METRICS_FILE} (the run was "
                                       "stopped during it): making it now"))
        reads.update(VALIDATION_READS)
    applied = [name for name in changed if name in reads]
    unused = [name for name in changed if name not in reads]
    notes = "".join([
        f"; changed settings applied by the final evaluation made now: {', '.join(applied)}"
        if applied else "",
        f"; {'not applied' if applied else 'changed settings not applied'}: {', '.join(unused)}"
        if unused else ""])
    lines.append((logging.WARNING if unused else logging.INFO,
                  f"{path}: the run is complete at step {step} (train.train_steps={step}): "
                  f"nothing to train (raise train.train_steps to continue it){notes}"))
    return lines
