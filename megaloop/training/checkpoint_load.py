"""What a run starts from and whether it can: ``resume_source`` (the checkpoint ``latest`` names in
the run's own directory, verified, else ``checkpoint.load``), the refusals of a checkpoint of
another architecture or of optimizer state that cannot go where this run would put it, and
``load_checkpoint``.

Before a resume, rank 0 checks that every file the checkpoint needs is there and long enough
(``verify_checkpoint``) and all ranks agree on the outcome, so that a damaged checkpoint is one
line naming the file instead of megatron-core's multi-rank traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Callable

from torch.distributed.checkpoint.api import CheckpointException

from megaloop.cli import restating
from megaloop.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, from_dict
from megaloop.platform.files import write_text_atomic
from megaloop.training.checkpoint_files import (LATEST, NAME_PATTERN, CheckpointError,
                                                complete_checkpoints, latest_checkpoint,
                                                one_line, pointed_name, saved_config,
                                                saved_section, step_of, verify_checkpoint)
from megaloop.training.collective import rank0_decides

log = logging.getLogger("megaloop.train")

# Model fields that decide parameter shapes or what the weights mean: a resume that changes one is
# refused. Every other ModelConfig field is in RESUMABLE_MODEL_FIELDS (tests hold the two lists to
# ModelConfig, so that a new field has to be placed in one of them).
ARCHITECTURE_FIELDS = ("arch", "num_layers", "hidden_size", "ffn_hidden_size",
                       "num_attention_heads", "num_query_groups", "vocab_size", "encoder_layers",
                       "block", "qk_norm", "injection", "local_kv", "global_kv_norm",
                       "decoder_ffn_hidden_size", "tie_embeddings", "head_dim", "num_experts",
                       "moe_layers", "moe_ffn_hidden_size", "moe_shared_expert_size",
                       "prelude_layers", "coda_layers", "latent_visits", "latent_stride",
                       "latent_writeback_lag", "latent_reduction", "residual_scale",
                       "untie_attention", "untie_moe")
# Test-time depth, the attention kernel, the context length (warned: it changes the sample order),
# RoPE base and norm epsilon (context extension, fine-tuning), the initialisation scale and the
# initial residual scales (used only before a load), MoE routing width and auxiliary-loss weights.
RESUMABLE_MODEL_FIELDS = ("iterations", "joint_attention", "seq_length", "rotary_base",
                          "norm_eps", "init_std", "residual_scale_init", "moe_top_k",
                          "moe_aux_loss_coeff", "moe_z_loss_coeff")
# Architecture fields whose default (None, ModelConfig.resolve) follows a resumable field: changed
# through it, the refusal names the field the user changed ({field: (source, rule)}).
DERIVED_FROM_RESUMABLE = {"moe_ffn_hidden_size": ("moe_top_k", "ffn_hidden_size // moe_top_k")}


def _model_layout(model: ModelConfig, parallel: ParallelConfig) -> tuple:
    """What decides which rank holds which weights: the tensor size and the pipeline stages
    (each stage's layer applications, the split chosen or given)."""
    from megaloop.models.pipeline import stage_counts

    stages = tuple(stage_counts(model, parallel)) if parallel.pipeline > 1 else ()
    return parallel.tensor, parallel.pipeline, stages


def same_parallel_layout(saved: dict, cfg: RunConfig) -> bool:
    """Whether a checkpoint's ``saved_config`` has this run's tensor/pipeline layout."""
    try:
        before = _model_layout(from_dict(ModelConfig, saved["model"]),
                               from_dict(ParallelConfig, saved["parallel"]))
    except ConfigError:  # saved by another version: not this layout
        return False
    return before == _model_layout(cfg.model, cfg.parallel)


def is_own_checkpoint(path: Path, cfg: RunConfig) -> bool:
    """Whether ``path`` is in the run's own checkpoint directory (which always resumes whole,
    optimizer and progress included), not a ``checkpoint.load`` from elsewhere."""
    directory = Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")
    return path.parent.resolve() == directory.resolve()


def check_optimizer_state(path: Path, cfg: RunConfig) -> None:
    """Refuses, in one line, to load optimizer state that cannot go where this run would put it:
    state of the other kind of optimizer (``train.distributed_optimizer`` changed), of another
    expert-parallel size (megatron-core 0.16 fails on it in either optimizer_format: EP=2 -> 1
    and 2 -> 4 measured), or distributed-optimizer state saved as dp_reshardable (flat buffers
    per tensor/pipeline rank) into another tensor/pipeline layout, which would assign it to
    other weights."""
    own = is_own_checkpoint(path, cfg)
    if not (cfg.checkpoint.load_optimizer or own):
        return  # weights only
    saved = saved_config(path)
    way_out = (f"start a new run from its weights (checkpoint.load={str(path)!r}, "
               "checkpoint.load_optimizer=false, another checkpoint.dir)" if own else
               "set checkpoint.load_optimizer=false to start from its weights")
    distributed = saved.get("train", {}).get("distributed_optimizer", True)
    if distributed != cfg.train.distributed_optimizer:
        raise CheckpointError(
            f"{path} holds the optimizer state of train.distributed_optimizer={distributed}, "
            f"which does not load into train.distributed_optimizer="
            f"{cfg.train.distributed_optimizer}; resume with {distributed}, or {way_out}")
    before = saved["parallel"]
    if before.get("expert", 1) != cfg.parallel.expert:  # measured: every optimizer_format fails
        raise CheckpointError(
            f"{path} holds the optimizer state of parallel.expert={before.get('expert', 1)}, "
            f"which megatron-core does not reload into parallel.expert={cfg.parallel.expert}; "
            f"resume with {before.get('expert', 1)}, or {way_out}")
    format_ = saved.get("checkpoint", {}).get("optimizer_format", "dp_reshardable")
    if format_ != "dp_reshardable" or not distributed or same_parallel_layout(saved, cfg):
        return
    raise CheckpointError(
        f"{path} holds distributed-optimizer state in checkpoint.optimizer_format=dp_reshardable, "
        f"which reloads only into its own tensor/pipeline layout (parallel.tensor="
        f"{before.get('tensor')}, pipeline={before.get('pipeline')}, virtual_pipeline="
        f"{before.get('virtual_pipeline', 1)}, pipeline_split={before.get('pipeline_split', [])}"
        f"); resume with that layout, or {way_out}")


def check_compatible(path: Path, cfg: RunConfig) -> None:
    """Refuses, in one line, to resume a checkpoint of a different architecture."""
    # A field newer than the checkpoint had its default value when the checkpoint was written;
    # resolved, as the run's is (a canonical spelling, e.g. latent_visits sorted).
    saved = vars(saved_section(path, ModelConfig, "model").resolve())
    current = dict(vars(cfg.model.resolve()))
    by_default = vars(dataclasses.replace(
        cfg.model, **dict.fromkeys(DERIVED_FROM_RESUMABLE)).resolve())
    differences = []
    for k in ARCHITECTURE_FIELDS:
        if saved[k] == current[k]:
            continue
        source, rule = DERIVED_FROM_RESUMABLE.get(k, (None, None))
        if source and saved[source] != current[source] and current[k] == by_default[k]:
            differences.append(f"model.{source}={current[source]!r} ({saved[source]!r} in the "
                               f"checkpoint) changes model.{k} from {saved[k]!r} to "
                               f"{current[k]!r} (when unset it is {rule}; set it to {saved[k]!r} "
                               "to keep the checkpoint's)")
        else:
            differences.append(f"model.{k}={saved[k]!r} in the checkpoint, {current[k]!r} now")
    if differences:
        raise CheckpointError(f"{path} was saved by a different architecture: "
                              + "; ".join(differences))


def load_checkpoint(path: Path, sharded_state: dict) -> dict:
    """Collective: loads ``path`` into the layout of ``sharded_state`` (resharding as needed).
    Tensors are loaded into those of ``sharded_state``: the loaded state holds them, the model's
    own parameters, SwiGLU input projections included (weight_loading.merge_swiglu_in_place)."""
    from megaloop.training.sharded_load import load_sharded
    from megaloop.training.weight_loading import merge_swiglu_in_place

    _require_dist_checkpoint(path)
    from megaloop.models.specs import load_absent_extra_state_as_fresh

    try:
        # A local-spec (CPU) checkpoint lacks Transformer Engine's _extra_state entries.
        sharded_state = load_absent_extra_state_as_fresh(sharded_state, str(path))
        return load_sharded(merge_swiglu_in_place(sharded_state), path)
    except (Exception, CheckpointException) as e:
        raise restating(e, CheckpointError(f"{path}: cannot be loaded into this run "
                                           f"({one_line(e)})")) from None


def _require_dist_checkpoint(path: Path) -> None:
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: missing metadata.json, not a dist_checkpointing checkpoint")


def sharded_metadata(path: Path) -> dict:
    """megatron-core's index of the entries checkpoint ``path`` holds (its torch_dist
    ``.metadata``), read outside ``load_checkpoint``: a missing or corrupt index is one
    CheckpointError naming the file, as in the load itself."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    _require_dist_checkpoint(path)
    try:
        return load_sharded_metadata(str(path))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{path / '.metadata'}: missing or unreadable "
                              f"({one_line(e)})") from None


def resume_source(cfg: RunConfig, checkpoint_dir: Path) -> Path | None:
    """Where a run starts from (the same answer on every rank): the checkpoint ``latest`` names in
    its own directory, else the newest complete one there (a lost ``latest``), else
    ``checkpoint.load``, else None. The checkpoint is verified first; a damaged one is an error
    naming the file, or with ``checkpoint.fallback_to_previous`` is set aside for the newest
    earlier one that verifies."""
    return rank0_decides(lambda: _find_resume_source(cfg, Path(checkpoint_dir)),
                         (CheckpointError, ConfigError))


def _find_resume_source(cfg: RunConfig, checkpoint_dir: Path) -> Path | None:
    complete = complete_checkpoints(checkpoint_dir)
    if cfg.checkpoint.resume and (complete or (checkpoint_dir / LATEST).exists()):
        return _verified_own_checkpoint(checkpoint_dir, complete,
                                        cfg.checkpoint.fallback_to_previous)
    if complete:
        raise ConfigError(f"checkpoint.resume=false: {checkpoint_dir} holds another run's "
                          f"checkpoints (newest {complete[-1].name}) that this run would "
                          "overwrite; use another checkpoint.dir or remove them")
    if cfg.checkpoint.resume:
        _check_out_dir_not_left_by_its_checkpoints(cfg, checkpoint_dir)
    unusable = sorted(p.name for p in checkpoint_dir.glob("iter_*") if p.is_dir())
    if unusable:  # interrupted saves (.tmp) or damaged checkpoints set aside
        log.warning("%s holds no complete checkpoint, only %s; the run starts %s", checkpoint_dir,
                    ", ".join(unusable), f"from {cfg.checkpoint.load}" if cfg.checkpoint.load
                    else "from step 0")
    if cfg.checkpoint.load:
        path = named_checkpoint(cfg.checkpoint.load)
        if path is None:
            raise ConfigError(f"checkpoint.load={cfg.checkpoint.load!r}: no checkpoint there "
                              "(expected a directory with config.yaml, one with a 'latest' file, or a "
                              "run's out_dir)")
        verify_checkpoint(path)
        return path
    return None


def _check_out_dir_not_left_by_its_checkpoints(cfg: RunConfig, checkpoint_dir: Path) -> None:
    """A run with nothing of its own to resume starts at step 0 and starts ``train.out_dir``'s
    metrics over. Refused when the config the last run there saved in ``train.out_dir`` names
    another checkpoint directory, one holding checkpoints: checkpoint.dir was changed, and the
    run it names would lose its metrics history. Not when ``checkpoint.load`` continues that run
    from one of them with its optimizer (checkpoints moved to new storage): it goes on from the
    loaded step, its metrics before it kept."""
    out_dir = Path(cfg.train.out_dir)
    previous = _recorded_checkpoint_dir(out_dir)
    if previous is None:
        return
    if cfg.checkpoint.load and cfg.checkpoint.load_optimizer:
        loaded = named_checkpoint(cfg.checkpoint.load)
        if loaded is not None and loaded.resolve().parent == previous.resolve():
            return
    complete = complete_checkpoints(previous)
    if complete and previous.resolve() != checkpoint_dir.resolve():
        raise ConfigError(
            f"checkpoint.dir={cfg.checkpoint.dir!r}: {checkpoint_dir} holds no checkpoint to "
            f"resume, but train.out_dir={str(out_dir)!r} is the run whose checkpoints are in "
            f"{previous} (newest {complete[-1].name}; {out_dir / 'config.yaml'}); set "
            "checkpoint.dir back to resume it, or start a new run in another train.out_dir (or "
            "in this one with checkpoint.resume=false, which starts its metrics.jsonl over)")


def named_checkpoint(path: str | os.PathLike) -> Path | None:
    """Checkpoint ``path`` itself, the one ``latest`` names when ``path`` is a run's checkpoint
    directory, or the one its checkpoint directory's ``latest`` names when ``path`` is a run's
    ``train.out_dir``; None when it is none of these."""
    path = Path(path)
    if _is_out_dir(path):  # its config.yaml is the run's: no checkpoint until one has ``latest``
        found = [d for d in (_recorded_checkpoint_dir(path), path / "checkpoints")
                 if d is not None and (d / LATEST).exists()]
        if not found:
            return None
        path = found[0]
    if path.is_dir() and (path / LATEST).exists():
        path = latest_checkpoint(path)
    return path if (path / "config.yaml").is_file() else None


def _is_out_dir(path: Path) -> bool:
    """Whether ``path`` is a run's ``train.out_dir`` (a config.yaml, but neither a checkpoint's
    metadata.json nor an ``iter_N`` name, which a damaged checkpoint keeps, nor ``latest``)."""
    return ((path / "config.yaml").is_file() and not (path / "metadata.json").is_file()
            and not NAME_PATTERN.match(path.name) and not (path / LATEST).exists())


def _recorded_checkpoint_dir(out_dir: Path) -> Path | None:
    """The checkpoint directory that the run config saved in ``out_dir`` names (its default,
    ``<out_dir>/checkpoints``, when unset); None without a saved run config there (none, or a
    config.yaml the user wrote, which lacks the model/parallel sections every saved one has)."""
    if not (out_dir / "config.yaml").is_file():
        return None
    try:
        saved_dir = (saved_config(out_dir).get("checkpoint") or {}).get("dir")
    except CheckpointError:
        return None
    return Path(saved_dir) if saved_dir else out_dir / "checkpoints"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """``named_checkpoint`` or a CheckpointError naming ``path``."""
    found = named_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint there (expected an iter_N directory with "
                              "config.yaml, a checkpoint directory with 'latest', or a run's "
                              "out_dir whose checkpoint directory has one)")
    return found


def choose_own_checkpoint(directory: Path, complete: list[Path], fallback: bool,
                          warn: Callable[[str], None] = lambda line: None
                          ) -> tuple[Path, Path | None, str | None]:
    """(the checkpoint of ``directory`` that a resume continues, verified; the one ``latest``
    names where ``fallback`` (checkpoint.fallback_to_previous) goes past it to the newest earlier
    one that verifies, and why) from its ``complete_checkpoints``; a CheckpointError otherwise.
    Decides only, moving nothing (megaloop.gsm8k checks a rerun with it); ``warn`` is given the
    lines worth a warning (no pointer, an earlier checkpoint that does not verify either)."""
    pointer = directory / LATEST
    if pointer.exists():
        try:
            candidate, problem = directory / pointed_name(pointer), None
            if not candidate.is_dir():
                raise CheckpointError(f"{pointer}: names {candidate.name!r}, which is not a "
                                      f"checkpoint directory in {directory}")
        except CheckpointError as e:
            candidate, problem = None, str(e)
    else:
        candidate, problem = complete[-1], None
        warn(f"{directory}: no 'latest' pointer; resuming from the newest complete checkpoint "
             f"{candidate.name}")
    if candidate is not None:
        try:
            verify_checkpoint(candidate)
            return candidate, None, None
        except CheckpointError as e:
            problem = str(e)
    earlier = [p for p in complete if candidate is None or step_of(p) < step_of(candidate)]
    if not fallback:
        hint = (f"; checkpoint.fallback_to_previous=true resumes from {earlier[-1].name}"
                if earlier else "")
        raise CheckpointError(problem + hint)
    if pointer.is_dir():  # the pointer cannot be rewritten over it, and it is not ours to remove
        raise CheckpointError(f"{pointer}: a directory where the 'latest' pointer file belongs; "
                              "move it aside, and checkpoint.fallback_to_previous resumes from "
                              "the newest complete checkpoint")
    for older in reversed(earlier):
        try:
            verify_checkpoint(older)
        except CheckpointError as e:
            warn(str(e))
            continue
        return older, candidate, problem
    raise CheckpointError(f"{problem}; no earlier complete checkpoint in {directory} to fall "
                          "back to")


def _verified_own_checkpoint(directory: Path, complete: list[Path], fallback: bool) -> Path:
    """``choose_own_checkpoint``, done: a damaged checkpoint set aside, ``latest`` repointed."""
    path, damaged, problem = choose_own_checkpoint(directory, complete, fallback,
                                                   lambda line: log.warning("%s", line))
    if problem is None:
        return path
    if damaged is not None:
        aside = damaged.with_name(f"{damaged.name}.damaged-{int(time.time())}")
        os.replace(damaged, aside)
        problem += f" (set aside as {aside.name})"
    write_text_atomic(directory / LATEST, path.name + "\n")
    log.warning("%s; resuming from %s instead (checkpoint.fallback_to_previous)", problem,
                path.name)
    return path