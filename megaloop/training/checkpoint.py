"""Distributed checkpoints (megatron-core dist_checkpointing) with an atomic "latest" pointer.

Layout of ``<dir>``::

    iter_0000100/          a complete checkpoint (dist_checkpointing files + config.yaml)
    iter_0000200.tmp/      a save in progress, or one killed mid-way: never loaded, removed later
    iter_0000300.damaged*  a damaged checkpoint set aside by checkpoint.fallback_to_previous
    latest                 text file naming the newest complete checkpoint, replaced atomically
    .latest-<pid>-<hex>    the new ``latest`` of a pointer move killed mid-way: removed later
    .pruned-iter_0000050/  a checkpoint beyond keep_last being deleted, renamed first (a kill
                           mid-delete leaves no half-deleted iter_N): removed at the next start

A save writes into ``iter_N.tmp``, and only when every rank has finished does rank 0 rename it to
``iter_N`` and then repoint ``latest`` (with ``checkpoint.async_save`` the write runs in the
background while training goes on, and this finalize runs once every rank's write is complete).
A ``kill -9`` at any moment therefore leaves ``latest`` on the previous complete checkpoint, and
so does a save that fails (full disk, any OSError): it is a one-line ``CheckpointError`` naming
the path. Checkpoints beyond ``keep_last`` are deleted after the pointer moves (renamed to
``.pruned-iter_N`` first; a deletion that fails is a warning naming the path). The state dicts
hold only plain types and tensors, so megatron-core's ``torch.load`` (``weights_only=True`` by
default in torch >= 2.6) reads them.

The code is in three modules, whose public names this one holds: checkpoint_files (the layout:
names, ``latest``, verification, the stored config), checkpoint_save (saving and its finalize,
synchronous or in the background) and checkpoint_load (what a run starts from, the refusals of a
checkpoint it cannot continue, loading). What a Trainer's checkpoint holds is checkpoint_state's.
"""

from megaloop.training.checkpoint_files import (LATEST, CheckpointError, checkpoint_name,
                                                complete_checkpoints, holds_training_state,
                                                latest_checkpoint, pointed_name, saved_config,
                                                saved_section, step_of, verify_checkpoint)
from megaloop.training.checkpoint_load import (ARCHITECTURE_FIELDS, DERIVED_FROM_RESUMABLE,
                                               RESUMABLE_MODEL_FIELDS, check_compatible,
                                               check_optimizer_state, choose_own_checkpoint,
                                               find_checkpoint, is_own_checkpoint,
                                               load_checkpoint, named_checkpoint, resume_source,
                                               same_parallel_layout)
from megaloop.training.checkpoint_save import (CheckpointSaver, left_by_an_exit,
                                               save_checkpoint)

__all__ = ["LATEST", "CheckpointError", "checkpoint_name", "complete_checkpoints",
           "holds_training_state", "latest_checkpoint", "pointed_name", "saved_config",
           "saved_section", "step_of", "verify_checkpoint", "ARCHITECTURE_FIELDS",
           "DERIVED_FROM_RESUMABLE", "RESUMABLE_MODEL_FIELDS", "check_compatible",
           "check_optimizer_state", "choose_own_checkpoint", "find_checkpoint",
           "is_own_checkpoint", "load_checkpoint", "named_checkpoint", "resume_source",
           "same_parallel_layout", "CheckpointSaver", "left_by_an_exit", "save_checkpoint"]
