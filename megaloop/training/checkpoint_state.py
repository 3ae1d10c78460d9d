"""What a Trainer's checkpoint holds (``sharded_state``) and loading one into it
(``load_training_state``): the model chunks, the optimizer in ``checkpoint.optimizer_format``, the
LR schedule, the progress (step, consumed samples, skipped steps, what the training data held:
``data.data_fingerprint``), the LR multipliers, the ALRS state and the RNG states."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megaloop.alrs.schedule import ALRSConfig
from megaloop.cli import ALIKE_ON_EVERY_RANK
from megaloop.training.checkpoint_files import (CheckpointError, holds_training_state,
                                                saved_config)
from megaloop.training.checkpoint_load import (is_own_checkpoint, load_checkpoint,
                                               same_parallel_layout, sharded_metadata)
from megaloop.training.resume import (report_data_changes, report_sample_order,
                                      resume_schedule)
from megaloop.training.rng import rng_state, set_rng_state

log = logging.getLogger("megaloop.train")


def chunk_key(chunk: int) -> str:
    """Checkpoint section of model chunk ``chunk`` (its entries' keys are global: any chunk
    layout reads them)."""
    return "model" if chunk == 0 else f"model{chunk}"


def sharded_state(trainer, is_loading: bool = False, weights_only: bool = False,
                   with_rng: bool = True, optimizer_format: str | None = None,
                   rng_by_expert_rank: bool | None = None) -> dict:
    """What a checkpoint holds: the model, then (unless ``weights_only``) the optimizer,
    in ``optimizer_format`` (default: checkpoint.optimizer_format), scheduler, progress, LR
    multipliers and ALRS state, then the RNG states (``rng_entry``), which only reload into the
    same layout. ``rng_by_expert_rank``: the RNG entry's kind (None: the one saved now)."""
    from megatron.core import parallel_state as ps

    from megaloop.training.optimizer import scheduler_state

    state = {chunk_key(v): model.sharded_state_dict() for v, model in enumerate(trainer.models)}
    model_state = dict(state)  # every chunk's parameters, for the optimizer's state
    if weights_only:
        return state
    state.update(
        optimizer=trainer.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type":
                      optimizer_format or trainer.cfg.checkpoint.optimizer_format}),
        scheduler=scheduler_state(trainer.scheduler),
        trainer={"step": trainer.step, "consumed_samples": trainer.consumed_samples,
                 "skipped_steps": trainer.skipped_steps, "data": trainer.data_fingerprint},
        lr_multipliers=trainer.lr_multipliers.state_dict(),
        alrs=trainer.alrs.state_dict() if trainer.alrs is not None else {},
    )
    if with_rng:
        if rng_by_expert_rank is None:
            rng_by_expert_rank = ps.get_expert_model_parallel_world_size() > 1
        state["rng_state"] = rng_entry(rng_by_expert_rank)
    return state


def rng_entry(by_expert_rank: bool):
    """This rank's RNG states as a checkpoint entry: one per (pipeline, tensor) rank, saved by
    one of its data-parallel replicas (they draw alike), as Megatron-LM saves them; with
    ``by_expert_rank`` (expert parallelism) one per (pipeline, tensor, expert) rank, saved by
    one of its expert-data-parallel replicas. Expert-parallel ranks are data-parallel ranks of
    the other weights, but each has its own expert-parallel stream (megatron-core's tracker),
    which the first kind saved from expert-parallel rank 0 only, and resumed on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    grid = [(ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()),
            (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())]
    replica = ps.get_data_parallel_rank(with_context_parallel=True)
    if by_expert_rank:
        grid.append((ps.get_expert_model_parallel_world_size(),
                     ps.get_expert_model_parallel_rank()))
        replica = ps.get_expert_data_parallel_rank()
    sizes, ranks = zip(*grid)
    return ShardedObject("rng_state", rng_state(), sizes, ranks, replica_id=replica)


def rng_saved_by_expert_rank(path: Path) -> bool:
    """Whether checkpoint ``path`` holds its RNG states per expert-parallel rank
    (``rng_entry``): those saved before it did hold them per (pipeline, tensor) rank only."""
    return any(entry.key == "rng_state" and len(entry.global_shape) == 3
               for entry in sharded_metadata(path).values())



def load_training_state(trainer, path: Path, final_evaluation_only: bool = False) -> bool:
    """Loads checkpoint ``path`` into ``trainer``: its weights, and unless only they are taken
    (``checkpoint.load_optimizer=false`` for another run's checkpoint) the optimizer, schedule,
    progress, LR multipliers, ALRS and RNG states. True when ``path`` is the run's own
    checkpoint, resumed: it need not be written again. ``final_evaluation_only``: a complete
    run loaded to make its missing final evaluation, which trains no step; what a resume reports
    of the steps after it (the schedule's and sample order's changes, "resumed from") is not
    logged: check_resume's line said which changed settings apply."""
    from megaloop.training.optimizer import (materialise_optimizer_state,
                                             restore_torch_adam_steps)

    # checkpoint.load_optimizer=false concerns the checkpoint a run starts from
    # (checkpoint.load); the run's own checkpoints always resume whole, fine-tuning included.
    own = is_own_checkpoint(path, trainer.cfg)
    weights_only = not trainer.cfg.checkpoint.load_optimizer and not own
    if not weights_only and not holds_training_state(path):
        raise CheckpointError(
            f"{path}: holds model weights only (no optimizer state or progress, e.g. a "
            "conversion from Hugging Face); set checkpoint.load_optimizer=false to start a "
            "run from it")
    saved = saved_config(path)
    same_layout = same_parallel_layout(saved, trainer.cfg)
    # With expert parallelism (the same as saved, check_optimizer_state sees to it), the RNG
    # entry's kind is the checkpoint's: one saved before it was per expert rank still resumes.
    rng_by_expert_rank = (trainer.cfg.parallel.expert > 1 and same_layout and not weights_only
                          and rng_saved_by_expert_rank(path))
    if not weights_only:
        materialise_optimizer_state(trainer.optimizer)
    # Read in the format it was saved in: a changed checkpoint.optimizer_format is that of
    # the saves from now on.
    state = load_checkpoint(path, sharded_state(
        trainer, is_loading=True, weights_only=weights_only, with_rng=same_layout,
        optimizer_format=(saved.get("checkpoint") or {}).get("optimizer_format",
                                                             "dp_reshardable"),
        rng_by_expert_rank=rng_by_expert_rank))
    for chunk, model in enumerate(trainer.models):
        model.load_state_dict(state[chunk_key(chunk)])
    if weights_only:  # a fresh run from these weights
        # With bf16 params the optimizer keeps fp32 main copies made at construction; without
        # this they would overwrite the loaded weights at the first step.
        trainer.optimizer.reload_model_params()
        log.info("loaded weights from %s (optimizer and progress not restored)", path)
        return False
    with torch.no_grad():  # in fp32 the main params are views of the model's leaf params
        trainer.optimizer.load_state_dict(state["optimizer"])
    restore_torch_adam_steps(trainer.optimizer, state["optimizer"])
    progress = state["trainer"]
    trainer.step, trainer.consumed_samples = progress["step"], progress["consumed_samples"]
    resume_schedule(trainer.scheduler, trainer.cfg, saved["train"], state["scheduler"], path,
                    trainer.step, report=not final_evaluation_only)
    if not final_evaluation_only:
        report_sample_order(saved, trainer.cfg, path, trainer.step)
        report_data_changes(progress.get("data"), trainer.data_fingerprint, saved, trainer.cfg,
                            path, trainer.step)  # none: saved before checkpoints recorded it
    trainer.skipped_steps = progress["skipped_steps"]
    trainer.lr_multipliers.load_state_dict(state["lr_multipliers"])
    if trainer.alrs is not None and state["alrs"]:
        # Saved before the schedule kept its ramp's length: the ramp ran with the config's.
        state["alrs"]["schedule"].setdefault(
            "ramp_length", (saved.get("alrs") or {}).get("transition", ALRSConfig.transition))
        trainer.alrs.load_state_dict(state["alrs"])
    if same_layout:
        set_rng_state(state["rng_state"])
    else:
        log.warning("%s was saved with another tensor/pipeline layout: RNG states not restored",
                    path, extra=ALIKE_ON_EVERY_RANK)
    if not final_evaluation_only:
        log.info("resumed from %s at step %d", path, trainer.step)
    return own
