"""What a resume does with each setting that differs from the config saved with its checkpoint.

Every field of ``RunConfig`` has one rule (tests hold the tables below to the dataclasses, so that
a new field has to be placed):

- the architecture (``checkpoint.ARCHITECTURE_FIELDS``): refused by ``check_compatible``;
- the LR schedule: applied by ``resume_schedule`` unless ``checkpoint.keep_schedule``, each
  change one warning line; what decides the sample order: ``report_sample_order`` (and the
  data's contents, not a setting: ``report_data_changes``). Every rank runs these three and
  comes to the same lines (the settings are rank 0's everywhere, the files the same), so their
  warnings are shown from rank 0 alone (``ALIKE_ON_EVERY_RANK``), not once per rank;
- ``APPLIED``: in effect from the next step, each change one warning line;
- ``BOOKKEEPING`` (logging, evaluation, saving, communication overlap): in effect, each change
  one info line (``alrs.log_eigenvalues`` refused while the run's ALRS log was written otherwise;
  ``parallel.overlap_grad_reduce``/``ddp_bucket_size`` refused by ``check_bucket_layout`` once the
  model is built, where they cut the DDP buckets of dp_reshardable optimizer state anew). A
  ``checkpoint.dir`` changed so that the run finds nothing there to resume, while the config the
  last run saved in ``train.out_dir`` names a directory holding checkpoints, is refused before
  this (``checkpoint.resume_source``): it would start that run over, metrics included (not so
  with ``checkpoint.load`` of one of them and its optimizer, which continues the run);
- ``NOT_APPLICABLE``: read only when a run starts from scratch, so a change cannot take effect
  and is refused in one line naming the field;
- the ALRS switches and options, ``checkpoint.load`` / ``load_optimizer``,
  ``model.residual_scale_init`` and ``model.iterations`` (applied where the saved model can run
  the new depth, ``ModelConfig.depth_refusal``): rules of their own below.

A run that takes only the weights of another run's checkpoint (``checkpoint.load`` with
``load_optimizer=false``) starts afresh: the architecture is compared, and each other model
setting that differs from the checkpoint's is one line (``_weight_load_notes``). One that continues
another run's checkpoint with its optimizer is a resume, except that its checkpoint section and
``train.out_dir`` are its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from megaloop.alrs.schedule import ALLOCATION_OPTIONS, BOOST_OPTIONS
from megaloop.cli import ALIKE_ON_EVERY_RANK, decided_on_every_rank
from megaloop.config import ConfigError, RunConfig, TrainConfig, to_dict
from megaloop.data.blend import parse_blend, split_weights
from megaloop.data.readers import DataError
from megaloop.training import checkpoint as ckpt
from megaloop.training.checkpoint_files import one_line
from megaloop.training.collective import any_rank, first_error, rank0_decides
from megaloop.training.finished import complete_lines, missing_records

log = logging.getLogger("megaloop.train")

# Train fields that shape the LR schedule and the optimizer's update (``resume_schedule``).
SCHEDULE_FIELDS = ("train_steps", "warmup_fraction", "lr", "min_lr_ratio", "weight_decay",
                   "adam_beta1", "adam_beta2", "lr_schedule", "wsd_decay_fraction",
                   "wsd_decay_style")

# What decides which samples the steps after a resume read (``report_sample_order``).
SAMPLE_ORDER = ("train.seed", "model.seq_length", "data.path", "data.split", "data.eod_mask_loss")

REPORTED_BY_TRAINER = (
    *(f"train.{name}" for name in SCHEDULE_FIELDS), "checkpoint.keep_schedule", *SAMPLE_ORDER)
APPLIED = (
    "model.joint_attention", "model.rotary_base", "model.norm_eps",
    "model.moe_top_k", "model.moe_aux_loss_coeff", "model.moe_z_loss_coeff",
    # Layouts the optimizer state cannot move to are refused by checkpoint.check_optimizer_state.
    "parallel.tensor", "parallel.pipeline", "parallel.expert", "parallel.sequence_parallel",
    "parallel.recompute", "parallel.recompute_modules", "parallel.virtual_pipeline",
    "parallel.pipeline_split",
    "train.micro_batch_size", "train.global_batch_size", "train.clip_grad", "train.precision",
    "train.fp8_recipe", "train.distributed_optimizer", "train.max_nonfinite_steps",
    # What sets the EOD id is checked against the data on every start (training.data), not
    # against the checkpoint: a resume may so move legacy-tokenized data from the data.eod_id
    # workaround to data.legacy_tokenizer, or correct an EOD id the data never held.
    "data.tokenizer_type", "data.tokenizer_model", "data.legacy_tokenizer", "data.eod_id",
    "data.format", "data.sft_prompt", "data.sft_solution",
    "alrs.interval", "alrs.fraction", "alrs.eig_method")
BOOKKEEPING = (
    "train.out_dir", "train.log_interval", "train.eval_interval", "train.eval_iters",
    "train.eval_depths", "train.tensorboard", "train.wandb_project", "train.peak_tflops",
    "train.downstream_eval", "train.profile", "parallel.distributed_timeout_minutes",
    "parallel.overlap_grad_reduce", "parallel.overlap_param_gather", "parallel.ddp_bucket_size",
    "data.cache_dir", "checkpoint.dir", "checkpoint.save_interval", "checkpoint.keep_last",
    "checkpoint.resume", "checkpoint.fallback_to_previous", "checkpoint.optimizer_format",
    # When a save's write runs, not what it writes: the checkpoints and the losses are the same.
    "checkpoint.async_save",
    "alrs.log_eigenvalues", "alrs.monitor_after_freeze")
# Where a run's files are: changed when a run directory is moved, in effect as soon as it starts.
LOCATIONS = ("train.out_dir", "data.cache_dir", "checkpoint.dir")
NOT_APPLICABLE = {
    "model.init_std": "it initialises the weights of a run that starts from scratch",
    "alrs.mode": "the multipliers saved in the checkpoint would stay in effect",
    "alrs.granularity": "the matrices ALRS scales are those saved in the checkpoint",
    "alrs.exclude": "the matrices ALRS scales are those saved in the checkpoint",
}
# Read only when ALRS allocates (alrs.mode=alrs): in effect at the next allocation, refused once
# the multipliers are frozen. decoder_boost and decoder_prefix set the multipliers of
# alrs.mode=decoder_boost once, at the start of a run. Either, changed for a run of a mode that
# does not read it (ALRSConfig.read_options), is noted as without effect.
AT_NEXT_ALLOCATION = tuple(f"alrs.{name}" for name in ALLOCATION_OPTIONS)
AT_START = tuple(f"alrs.{name}" for name in BOOST_OPTIONS)
OWN_RULES = ("model.iterations", "model.residual_scale_init", "train.use_alrs",
             "checkpoint.load", "checkpoint.load_optimizer")


def _flat(section: dict, prefix: str) -> dict:
    """{"section.field": value}; train.downstream_eval and train.profile stay one entry each."""
    return {f"{prefix}.{k}": v for k, v in section.items()}


def next_allocation(step: int, cfg: RunConfig) -> int | None:
    """The first step after ``step`` at which ALRS allocates, or None when none is left."""
    alrs, total = cfg.alrs, cfg.train.train_steps
    if alrs.mode != "alrs":
        return None
    if step == 0:
        return 1
    candidate = (step // alrs.interval + 1) * alrs.interval
    return candidate if alrs.allocates_at(candidate, total) else None


def check_resume(path: Path, cfg: RunConfig, report: bool = True
                 ) -> tuple[bool, tuple[str, ...]]:
    """The checks of a run starting from checkpoint ``path`` (``Trainer._set_up``, and
    megaloop.gsm8k before it writes anything), in one CheckpointError or ConfigError line: the
    architecture (``check_compatible``), the optimizer state (``check_optimizer_state``), then
    each changed setting, by the rules above. ``report``: log each change accepted in one line
    (False: refuse only, for a caller whose trainer logs them when it resumes). Returns
    (complete, missing): complete when ``path`` is the run's own checkpoint at
    ``train.train_steps`` already (a finished run relaunched: nothing to train or save), missing
    the final records its metrics.jsonl lacks, which the relaunch makes; that is logged instead,
    naming each changed setting as applied by that evaluation or not (``finished``).

    Decided on rank 0 and shared (``rank0_decides``), as the other start-up checks: these read
    files (the checkpoint's, the ALRS log in ``train.out_dir``) that a rank without a shared
    filesystem may see otherwise, and a refusal on some ranks only would leave the others waiting
    in the next collective."""
    return rank0_decides(lambda: _check_resume(path, cfg, report),
                         (ckpt.CheckpointError, ConfigError))


def _check_resume(path: Path, cfg: RunConfig, report: bool) -> tuple[bool, tuple[str, ...]]:
    ckpt.check_compatible(path, cfg)
    ckpt.check_optimizer_state(path, cfg)
    answer, lines = _changed_settings(path, cfg)
    if report:
        for level, line in lines:
            log.log(level, "%s", line)
    return answer


def _changed_settings(path: Path, cfg: RunConfig
                      ) -> tuple[tuple[bool, tuple[str, ...]], list[tuple[int, str]]]:
    """(``check_resume``'s answer, the log lines of the accepted changes); a ConfigError for one
    refused."""
    own = ckpt.is_own_checkpoint(path, cfg)
    if not own and not cfg.checkpoint.load_optimizer:
        return (False, ()), _weight_load_notes(path, cfg)
    if not ckpt.holds_training_state(path):
        return (False, ()), []  # Trainer._load's refusal
    before, changed = _differences(path, cfg, ("model", "parallel", "train", "data",
                                               "checkpoint", "alrs"))
    if not own:  # another run's checkpoint: its directory options and out_dir are its own
        changed = {k: v for k, v in changed.items()
                   if not k.startswith("checkpoint.") and k != "train.out_dir"}
    step = ckpt.step_of(path)
    if cfg.train.train_steps < step:  # the loop would run no step and exit 0
        raise ConfigError(f"train.train_steps={cfg.train.train_steps}: {path} is at step {step} "
                          f"already; a resume trains up to train.train_steps (give {step} or "
                          "more)")
    where = f"resume from {path}"
    first = next_allocation(step, cfg)
    alrs_on = cfg.train.use_alrs and before["train.use_alrs"]
    if not alrs_on:  # the alrs section is read only while ALRS runs
        changed = {k: v for k, v in changed.items() if not k.startswith("alrs.")}
    # Options for another mode than the run's (which a resume cannot change): no effect either way.
    unread = {f"alrs.{name}" for name in ALLOCATION_OPTIONS + BOOST_OPTIONS
              if name not in cfg.alrs.read_options()}
    for name, (old, new) in changed.items():
        if name in unread:
            continue
        reason = None
        if name in NOT_APPLICABLE:
            reason = NOT_APPLICABLE[name]
        elif name in AT_NEXT_ALLOCATION and first is None:
            reason = (f"ALRS allocates no more after step {step} (alrs.mode={cfg.alrs.mode!r}, "
                      f"every alrs.interval={cfg.alrs.interval} steps up to alrs.fraction x "
                      f"train.train_steps = {cfg.alrs.fraction * cfg.train.train_steps:g}): the "
                      "multipliers saved in the checkpoint hold")
        elif name in AT_START and cfg.alrs.mode == "decoder_boost":
            reason = "the multipliers saved in the checkpoint hold"
        elif name == "alrs.log_eigenvalues":
            reason = _eigenvalue_log_refusal(cfg)
        elif name == "model.iterations":  # the saved weights are those of a model with ``old``
            reason = dataclasses.replace(cfg.model, iterations=old).depth_refusal(new)
        elif name == "model.residual_scale_init":
            reason = cfg.model.replaced_by_loaded_weights().get("residual_scale_init")
        elif name == "checkpoint.load":
            reason = (f"{path.parent} holds this run's own checkpoints, which a resume continues; "
                      "to start from another checkpoint use another checkpoint.dir")
        elif name == "checkpoint.load_optimizer":
            reason = (f"it concerns checkpoint.load; this run's own checkpoints in {path.parent} "
                      "always resume with their optimizer state and progress")
        elif name == "train.use_alrs" and old:
            reason = ("the ALRS multipliers saved in the checkpoint would stay in effect; to "
                      "train without ALRS start from its weights (checkpoint.load, "
                      "load_optimizer=false)")
        elif name == "train.use_alrs" and cfg.alrs.mode == "alrs" and first is None:
            reason = (f"ALRS would never allocate: it allocates every alrs.interval="
                      f"{cfg.alrs.interval} steps up to alrs.fraction x train.train_steps = "
                      f"{cfg.alrs.fraction * cfg.train.train_steps:g}, and the run is at step "
                      f"{step}")
        if reason is not None:
            raise ConfigError(f"{name}={new!r}: differs from {old!r} in {path / 'config.yaml'}, "
                              f"and a resume cannot apply it ({reason}); set it back, or start "
                              "a new run")
    # A finished run relaunched (not so one continuing another run's checkpoint at
    # train.train_steps, which evaluates and saves it as its own). After the refusals: a setting
    # no resume can apply is refused even here, since the relaunch would not be the run asked for.
    if own and cfg.train.train_steps == step:
        missing = missing_records(cfg, step)
        return (True, missing), complete_lines(path, cfg, step,
                                               [k for k in changed if k not in LOCATIONS], missing)
    lines = []
    for name, (old, new) in changed.items():
        if name in REPORTED_BY_TRAINER:
            continue
        if name in unread:
            lines.append((logging.INFO, _change_line(
                where, name, old, new,
                f"{cfg.alrs.reader()} does not read it (no effect on this run)")))
            continue
        when = f"from step {step + 1}"
        if name in AT_NEXT_ALLOCATION or (name == "train.use_alrs" and cfg.alrs.mode == "alrs"):
            when = f"from ALRS's next allocation, at step {first}"
        lines.append((logging.INFO if name in BOOKKEEPING else logging.WARNING,
                      _change_line(where, name, old, new, f"in effect {when}")))
    window = _allocation_window(cfg, before, first) if alrs_on else None
    if window is not None:
        lines.append((logging.WARNING, f"{where}: {window}"))
    return (False, ()), lines


def _differences(path: Path, cfg: RunConfig, sections: tuple[str, ...]) -> tuple[dict, dict]:
    """({"section.field": value} of checkpoint ``path``'s config.yaml, {"section.field": (saved,
    this run's)} for each that differs), over ``sections``. A field the saved config lacks
    (saved before it existed) had its default."""
    saved = ckpt.saved_config(path)
    defaults, now = to_dict(RunConfig()), to_dict(cfg)
    before, after = {}, {}
    for section in sections:
        before.update(_flat({**defaults[section], **(saved.get(section) or {})}, section))
        after.update(_flat(now[section], section))
    return before, {k: (before[k], after[k]) for k in after
                    if not _same_setting(k, before.get(k), after[k], cfg)}


def _saved_setting(saved: dict, name: str):
    """Setting ``name`` ("section.field") of a checkpoint's config ``saved``: its default where
    that config lacks it (saved before the field existed, the run had the default)."""
    section, field = name.split(".")
    return (saved.get(section) or {}).get(field, to_dict(RunConfig())[section][field])


def _same_setting(name: str, old, new, cfg: RunConfig) -> bool:
    """Whether setting ``name`` of a checkpoint's config (``old``) and of this run (``new``,
    ``cfg``'s) is the same: data.path and data.split are compared as the data they cut, so that
    another spelling of the same value is no change (``_blend``, ``_split_cut``), and
    model.latent_visits as the set it is (a checkpoint may hold it unsorted)."""
    if name == "model.latent_visits":
        return sorted(old) == sorted(new)
    if name == "data.path":
        return _blend(old) == _blend(new)
    if name == "data.split":
        return _split_cut(old, cfg.data.format) == _split_cut(new, cfg.data.format)
    return old == new


def _change_line(where: str, name: str, old, new, effect: str) -> str:
    return f"{where}: {name} changed from {old!r} to {new!r}; {effect}"


def _weight_load_notes(path: Path, cfg: RunConfig) -> list[tuple[int, str]]:
    """One line per model setting of a run starting from the weights of another run's checkpoint
    ``path`` that differs from its config.yaml: the run's own applies (a depth other than the
    trained one, say), or has no effect where the weights replace it. The architecture is
    refused before this (``check_compatible``); the other sections are the new run's own. A
    ConfigError for a depth the weights cannot run: LatentLoop's visits each have weights of
    their own (residual scale, writeback, untied blocks), which fewer visits would drop and more
    would lack, as in a resume."""
    where, replaced = f"start from the weights of {path}", cfg.model.replaced_by_loaded_weights()
    lines = []
    for name, (old, new) in _differences(path, cfg, ("model",))[1].items():
        field = name.removeprefix("model.")
        if field not in ckpt.RESUMABLE_MODEL_FIELDS:  # equal once resolved (check_compatible)
            continue
        if field == "iterations" and (
                reason := dataclasses.replace(cfg.model, iterations=old).depth_refusal(new)):
            raise ConfigError(f"{name}={new!r}: differs from {old!r} in {path / 'config.yaml'}, "
                              f"whose weights this run starts from ({reason}); set it back, or "
                              "start from a checkpoint of this depth")
        if field in replaced:
            lines.append((logging.INFO, _change_line(where, name, old, new,
                                                     f"no effect ({replaced[field]})")))
        else:
            lines.append((logging.WARNING, _change_line(where, name, old, new,
                                                        "this run's value applies")))
    return lines


def check_bucket_layout(path: Path, cfg: RunConfig, optimizer) -> None:
    """Collective, before a resume loads distributed-optimizer state saved in
    checkpoint.optimizer_format=dp_reshardable: that state is flat per megatron-core DDP bucket,
    and reloads only into buckets cut as the saved ones (megatron-core asserts it after the load,
    when the load itself has not already failed on a bucket's size). Where this run's ``optimizer``
    cut them otherwise (a changed parallel.overlap_grad_reduce or ddp_bucket_size does, unless
    every cut falls where it did: a model that fits one bucket either way, a pipeline rank after
    the first, which megatron-core never cuts), or holds them in other dtypes (a changed
    train.precision: megatron-core keys the buckets by their weights' and gradients' dtypes),
    every rank raises one line: a ConfigError naming the changed setting, else a
    CheckpointError. The bucket sizes compared are those the
    checkpoint records (megatron-core's ``per_bucket_numel_unpadded``), per pipeline rank."""
    saved = ckpt.saved_config(path)
    if (not cfg.train.distributed_optimizer
            or (saved.get("checkpoint") or {}).get("optimizer_format",
                                                   "dp_reshardable") != "dp_reshardable"
            or not (cfg.checkpoint.load_optimizer or ckpt.is_own_checkpoint(path, cfg))
            or not ckpt.holds_training_state(path)):
        return
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.api import CheckpointException

    # The keys megatron-core's DistributedOptimizer and ChainedOptimizer save them under.
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    keyed = {(f"chained_{i}." if len(parts) > 1 else "") + "optimizer.distributed.dp_group_idx_"
             f"{part.data_parallel_group_idx}.per_bucket_numel_unpadded": part
             for i, part in enumerate(parts)}
    live = {key: part.per_bucket_numel_unpadded for key, part in keyed.items()}
    try:
        recorded = dist_checkpointing.load(
            {key: ShardedObject(key, None, (1,), (0,), replica_id=(
                part.distributed_optimizer_instance_id, 0, part.data_parallel_group.rank()))
             for key, part in keyed.items()}, str(path))
    except (Exception, CheckpointException) as e:  # any failure to read them, in one line
        raise ckpt.CheckpointError(f"{path}: cannot read the DDP bucket sizes of its "
                                   f"distributed-optimizer state ({one_line(e)})") from None

    def sizes(layout):  # bucket sizes per grad buffer
        return [buckets for buffer in layout for buckets in buffer.values()]

    def dtypes(layout):  # what megatron-core keys each grad buffer by besides its sizes
        return ", ".join(f"{str(weights).removeprefix('torch.')} weights with "
                         f"{str(grads).removeprefix('torch.')} gradients"
                         for buffer in layout for weights, grads in buffer)

    error = next((f"{path} holds distributed-optimizer state in checkpoint.optimizer_format="
                  f"dp_reshardable, flat per megatron-core DDP bucket, of {sizes(recorded[key])} "
                  f"elements on rank {torch.distributed.get_rank()}, where this run cuts "
                  f"{sizes(layout)}" + ("" if dtypes(recorded[key]) == dtypes(layout) else
                                        f" (its buckets hold {dtypes(recorded[key])}, this "
                                        f"run's {dtypes(layout)})")
                  for key, layout in live.items() if recorded[key] != layout), None)
    error = first_error(error)
    if error is None:
        return
    # Collective, every rank being here: train.precision is named only where it recast a
    # bucket ("auto" and "fp32" on CPU, "auto" and "bf16" on GPU hold the same dtypes).
    recast = any_rank(any(dtypes(recorded[key]) != dtypes(layout)
                          for key, layout in live.items()))
    # The settings that cut the buckets, and train.precision, which sets their dtypes.
    before, now = {}, {}
    for name in ("parallel.overlap_grad_reduce", "parallel.ddp_bucket_size",
                 *(["train.precision"] if recast else [])):
        section, field = name.split(".")
        before[name] = _saved_setting(saved, name)
        now[name] = getattr(getattr(cfg, section), field)
    changed = [name for name in now if before[name] != now[name]]
    if changed:
        raise decided_on_every_rank(ConfigError(
            ", ".join(f"{n}={now[n]!r}" for n in changed)
            + f": differs from {', '.join(repr(before[n]) for n in changed)} in "
            f"{path / 'config.yaml'}, and a resume cannot apply it ({error}); set it back, or "
            "start a new run"))
    raise decided_on_every_rank(ckpt.CheckpointError(
        f"{error} (another data-parallel size with megatron-core's default "
        "parallel.ddp_bucket_size, or another megaloop or megatron-core version); resume as it "
        "was saved, or start a new run from its weights (checkpoint.load, "
        "checkpoint.load_optimizer=false)"))


def _allocation_window(cfg: RunConfig, before: dict, first: int | None) -> str | None:
    """What a changed train.train_steps (or alrs.fraction) does to ALRS's allocations
    (alrs.mode=alrs), which end at alrs.fraction x train.train_steps whether the LR schedule is
    kept or not: a longer run may allocate again after its multipliers froze, a shorter one
    freeze them now. None when the window stays where it was."""
    old = before["alrs.fraction"] * before["train.train_steps"]
    new = cfg.alrs.fraction * cfg.train.train_steps
    if cfg.alrs.mode != "alrs" or old == new:
        return None
    return (f"ALRS allocates up to alrs.fraction x train.train_steps = {new:g} (was {old:g}); "
            + (f"next allocation at step {first}" if first is not None else
               "none is left: the multipliers saved in the checkpoint hold"))


def resumed_progress(path: Path, cfg: RunConfig) -> tuple[int, int]:
    """(step, consumed samples) at which a run starting from checkpoint ``path`` goes on; (0, 0)
    for one that takes only its weights (or lacks the progress, which ``Trainer._load``
    refuses). Read on rank 0 and shared, as ``check_resume``."""
    if not ckpt.is_own_checkpoint(path, cfg) and not cfg.checkpoint.load_optimizer:
        return 0, 0

    def read() -> tuple[int, int]:
        common = torch.load(path / "common.pt", map_location="cpu", weights_only=True)
        trainer = common.get("trainer")
        return (trainer["step"], trainer["consumed_samples"]) if trainer else (0, 0)

    return rank0_decides(read, (ckpt.CheckpointError,))


def _eigenvalue_log_refusal(cfg: RunConfig) -> str | None:
    """Why ``alrs.log_eigenvalues`` cannot change: the run's ALRS log holds eigenvalues for
    every analysis or for none. None where no log is there yet (a new ``train.out_dir``)."""
    from megaloop.alrs.log import RUN_LOG, eigenvalue_setting_fixed, stores_eigenvalues

    path = Path(cfg.train.out_dir) / RUN_LOG
    stored = stores_eigenvalues(path)
    if stored is None or stored == cfg.alrs.log_eigenvalues:
        return None
    return f"{eigenvalue_setting_fixed(path, stored)}; another train.out_dir starts a new log"


def report_sample_order(saved: dict, cfg: RunConfig, path: Path, step: int) -> None:
    """Warns, in one line, of the settings that decide which samples the steps after ``step``
    read and that differ from those of ``saved``, the config of checkpoint ``path``."""
    changed, values = [], []
    for name in SAMPLE_ORDER:
        section, field = name.split(".")
        before, now = _saved_setting(saved, name), getattr(getattr(cfg, section), field)
        if not _same_setting(name, before, now, cfg):
            changed.append(name)
            if name != "data.path":  # a blend may list thousands of prefixes: not in one line
                values.append(f"{name} {before!r} -> {now!r}")
    if changed:
        log.warning("resume: %s differ%s from %s's%s: the sample order from step %d on is not "
                    "the one the saved run would have seen", ", ".join(changed),
                    "" if len(changed) > 1 else "s", path,
                    f" ({'; '.join(values)})" if values else "", step + 1,
                    extra=ALIKE_ON_EVERY_RANK)


def _blend(data_path):
    """``data.path`` as the datasets it names: the weights as numbers, each prefix (or file) by
    its real path from this run's working directory, so that another spelling of the same blend
    ("data/x", "./data/x", its absolute path) is no change; a value that is no blend, as it is."""
    try:
        prefixes, weights = parse_blend(data_path or [])
    except DataError:
        return data_path
    return [os.path.realpath(prefix) for prefix in prefixes], weights


def _split_cut(split, data_format: str):
    """``data.split`` as the shares its data is cut by: megatron-core normalises the weights, so
    that "99,1,0", "99, 1", "990/10/0" and "0.99,0.01,0" cut alike and are no change. In the
    floats it cuts by (``data_format`` sft: the records' edges, data.sft), compared exactly:
    "0.7,0.2,0.1" sums to 0.9999999999999999 there, and cuts 15 documents otherwise than
    "7,2,1". A spelling now refused, in a checkpoint saved before (indexed data: megatron-core
    read its digits, "1e2" as 1,2), as megatron-core cut by it; a value that is no split, as it
    is."""
    import numpy as np
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    weights = split_weights(str(split))
    if data_format == "sft":  # whose reader (split_edges) always refused other spellings
        from megaloop.data.sft import split_edges

        return split if weights is None else split_edges(weights)
    try:
        with np.errstate(invalid="ignore"):  # no digits ("abc"): 0/0, its shares NaN
            shares = parse_and_normalize_split(str(split))
    except AssertionError:  # more than three parts
        return split
    return shares if all(map(np.isfinite, shares)) else split


# What a resume cannot see where a checkpoint's data fingerprint lacks an entry, by the entry.
UNRECORDED_CHANGES = {"bin_sample_md5": "data rewritten with the same sequence lengths",
                      "tokenizer_sha256": "a tokenizer rewritten under its name"}


def report_data_changes(recorded: dict | None, now: dict, saved: dict, cfg: RunConfig,
                        path: Path, step: int) -> None:
    """Warns, in one line per dataset, of training data that holds other contents than it did
    when checkpoint ``path`` (of config ``saved``) was written, under the same name: the steps
    after ``step`` read other samples. ``recorded``: the fingerprints ``path`` holds, ``now``:
    this run's (``data.data_fingerprint``). A warning, as ``report_sample_order``'s for the
    settings: data is rewritten on purpose too (a corrupt shard replaced, a corpus cleaned), and
    no setting could say so, where a refusal would leave only a new run. A dataset new or gone
    while data.path changed is that warning's; one gone whose fingerprint a new one has moved,
    and its samples are the same; a fine-tuning run's tokenizer is one more entry (its file
    read as the records are). ``recorded`` None (a checkpoint saved before they were recorded):
    one line says no change can be seen; fingerprints lacking an entry this run's have
    (``UNRECORDED_CHANGES``, recorded since) are compared on the rest, and one line names what
    goes unchecked."""
    if recorded is None:
        log.info("resume: %s records no fingerprint of its training data (saved by an older "
                 "megaloop): a change of the data since then is not detected", path)
        return
    path_changed = _blend((saved.get("data") or {}).get("path")) != _blend(cfg.data.path)
    # A file spelt otherwise (./data/x for data/x, as _blend allows) is compared with itself: else
    # two swapped under a respelt blend were each taken for the other moved.
    spelt = {os.path.realpath(name): name for name in now}
    recorded = {spelt.get(os.path.realpath(name), name): entry for name, entry in recorded.items()}
    unrecorded = set()
    if not any("tokenizer_sha256" in entry for entry in recorded.values()):
        tokenizers = [name for name, entry in now.items() if "tokenizer_sha256" in entry]
        if tokenizers:  # a fine-tuning checkpoint saved before its tokenizer was recorded
            unrecorded.add("tokenizer_sha256")
            now = {name: entry for name, entry in now.items() if name not in tokenizers}

    def same(old: dict, new: dict) -> bool:  # on the entries both record
        common = old.keys() & new.keys()
        return bool(common) and all(old[key] == new[key] for key in common)

    # Data moved, its fingerprint unchanged (a quickstart's, trained in its staging directory):
    # the sample indices are made from the contents, not the name, so the samples are the same.
    gone, moved = [name for name in recorded if name not in now], set()
    compared = [(recorded[name], now[name]) for name in recorded.keys() & now.keys()]
    for name in (name for name in now if name not in recorded):
        source = next((old for old in gone if same(recorded[old], now[name])), None)
        if source is not None:
            gone.remove(source)
            moved |= {source, name}
            compared.append((recorded[source], now[name]))
    for saved_entry, entry in compared:  # moved data too: compared on fewer fields alike
        unrecorded |= entry.keys() - saved_entry.keys()
    for name in sorted((recorded.keys() | now.keys()) - moved):
        old, new = recorded.get(name), now.get(name)
        if old is not None and new is not None and same(old, new):
            continue
        if path_changed and (old is None or new is None):
            continue
        what = (f"is new since {path} was saved" if old is None else
                f"is gone since {path} was saved" if new is None else
                f"holds other data than when {path} was saved (" + ", ".join(
                    f"{key} {_shown(old.get(key))} -> {_shown(value)}"
                    for key, value in new.items() if key in old and old[key] != value) + ")")
        log.warning("resume: %s %s: the samples from step %d on are not the ones the saved run "
                    "would have seen", name, what, step + 1, extra=ALIKE_ON_EVERY_RANK)
    if unrecorded:
        log.info("resume: %s's fingerprint of its training data has no %s (saved by an older "
                 "megaloop): %s is not detected", path, ", ".join(sorted(unrecorded)),
                 " nor ".join(UNRECORDED_CHANGES[key] for key in sorted(unrecorded)))


def _shown(value) -> str:
    """A fingerprint's entry in a log line: counts with separators, digests cut to 12 digits."""
    return f"{value:,}" if isinstance(value, int) else str(value)[:12]


def resume_schedule(scheduler, cfg: RunConfig, saved_train: dict, scheduler_state: dict,
                    path: Path, step: int, report: bool = True) -> None:
    """Loads megatron-core's LR ``scheduler`` (``OptimizerParamScheduler``) for a resume at
    ``step`` from ``path``: the config's schedule (with ``report``, each change from the
    checkpoint logged in one line), or with ``checkpoint.keep_schedule`` the checkpoint's. Param groups reloaded from a
    checkpoint carry its peak/floor LR and Adam betas, and megatron-core's scheduler would take its
    warmup, decay length and weight decay from the checkpoint."""
    train, keep = cfg.train, cfg.checkpoint.keep_schedule
    # A field a checkpoint's config lacks (saved before it existed) had its default's effect.
    saved = dataclasses.replace(TrainConfig(), **{name: saved_train[name] for name in
                                                  SCHEDULE_FIELDS if name in saved_train})
    for name in SCHEDULE_FIELDS:
        # The WSD fields by their effect: unset and the default are the same schedule.
        before, now = (getattr(config, f"resolved_{name}" if name.startswith("wsd_") else name)
                       for config in (saved, train))
        if before == now or not report:
            continue
        if keep:
            log.warning("resume: train.%s=%r, but %s's schedule (%r) is kept "
                        "(checkpoint.keep_schedule=true)", name, now, path.name, before,
                        extra=ALIKE_ON_EVERY_RANK)
        else:
            log.warning("resume: train.%s changed from %r to %r; the LR schedule follows the "
                        "config from step %d (checkpoint.keep_schedule=true keeps %s's)",
                        name, before, now, step + 1, path.name, extra=ALIKE_ON_EVERY_RANK)
    scheduler.use_checkpoint_opt_param_scheduler = keep
    scheduler.override_opt_param_scheduler = not keep
    if keep:  # saved beside megatron-core's state (optimizer.scheduler_state); none: no WSD
        scheduler.wsd_decay_steps = scheduler_state.get("wsd_decay_steps")
        scheduler.lr_wsd_decay_style = scheduler_state.get("lr_wsd_decay_style")
    else:
        for group in scheduler.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = train.lr, train.lr * train.min_lr_ratio
            group["betas"] = (train.adam_beta1, train.adam_beta2)
    scheduler.load_state_dict(scheduler_state)
    scheduler.step(0)  # load_state_dict sets the groups' weight decay before loading its own
