"""Process-group and model-parallel initialisation from torchrun, SLURM (srun) or MPI launchers.

The launcher is detected from its environment variables (megaloop.platform.launch), so the same
entry point works under ``torchrun``, ``srun`` (one task per GPU), ``mpiexec``, or as a plain
single process. On machines without CUDA the backend is gloo and the CPU compatibility layer is
switched on.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from megaloop.config import ParallelConfig
from megaloop.platform import cpu_compat
from megaloop.platform.launch import LaunchEnv, detect_launch_env
from megaloop.scale.layout import check_world_size

log = logging.getLogger("megaloop.platform")

# Seed offset between pipeline stages, beyond every offset megatron-core adds to a seed (tensor
# rank + 2718, 1024 + 100 x expert rank + expert-tensor rank).
PIPELINE_SEED_STRIDE = 1_000_000


def local_device(launch: LaunchEnv, visible_gpus: int) -> int:
    """The CUDA device of this process: its local rank among the GPUs it sees (all of the node's
    under torchrun; its own under ``srun --gpus-per-task``, where the modulo picks the first).
    A local rank past the visible GPUs while several are visible may put two ranks on one GPU
    (NCCL then refuses later, less clearly), or be a launcher that gave each task its own set:
    said in one line rather than refused."""
    if launch.local_rank >= visible_gpus > 1:
        log.warning("local rank %d (%s launch) sees %d GPUs, fewer than its local rank: it takes "
                    "GPU %d, which another rank takes too unless the launcher gave each task its "
                    "own GPUs", launch.local_rank, launch.launcher, visible_gpus,
                    launch.local_rank % visible_gpus)
    return launch.local_rank % visible_gpus


def init_distributed(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    seed: int = 1234,
    virtual_pipeline: int = 1,
    same_settings: dict[str, object] | None = None,
    timeout_minutes: int = ParallelConfig.distributed_timeout_minutes,
) -> LaunchEnv:
    """Initialises torch.distributed and megatron-core's model-parallel groups; returns the launch env.
    ``same_settings`` (``section.field``: value): further settings every rank must be launched with,
    compared with the parallel sizes and seed, in one collective, before any group is built.

    ``timeout_minutes``: how long any collective waits for a rank (``parallel.
    distributed_timeout_minutes``), in the default group and megatron-core's alike.

    Safe to call when a process group already exists (tests, notebooks): it then only (re)builds the
    model-parallel groups, and gives the default group ``timeout_minutes``.
    """
    timeout = datetime.timedelta(minutes=timeout_minutes)
    launch = detect_launch_env()
    cpu_compat.enable()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_device(launch, torch.cuda.device_count()))
        dist.init_process_group(
            backend="nccl" if torch.cuda.is_available() else "gloo",
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    else:  # made elsewhere, with its maker's timeout (torchtitan changes it the same way)
        dist.distributed_c10d._set_pg_timeout(timeout, dist.group.WORLD)
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    from megaloop.training.collective import same_on_every_rank

    same_on_every_rank({"parallel.tensor": tensor_parallel, "parallel.pipeline": pipeline_parallel,
                        "parallel.expert": expert_parallel,
                        "parallel.virtual_pipeline": virtual_pipeline, "train.seed": seed,
                        **(same_settings or {})})
    check_world_size(ParallelConfig(tensor=tensor_parallel, pipeline=pipeline_parallel,
                                    expert=expert_parallel), dist.get_world_size())

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
        distributed_timeout_minutes=timeout_minutes,
    )
    # Each pipeline stage draws its weights from its own seed: with one seed on every stage, a
    # later stage drew its layers from the numbers the first stage had drawn its embedding and
    # layers from (scaled copies). Megatron-LM adds 100 x the pipeline rank; megatron-core's
    # expert streams are 100 apart per expert-parallel rank, and would then repeat across
    # stages (pipeline rank 1, expert rank 0 = pipeline rank 0, expert rank 1).
    stage_seed = seed + PIPELINE_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    mcore_tp.model_parallel_cuda_manual_seed(stage_seed)
    torch.manual_seed(stage_seed)
    world = dist.get_world_size()
    if world > 1 and dist.get_rank() == 0:  # a job log's first line: how its ranks are laid out
        log.info("%d ranks (%s launch, rendezvous %s:%d, %s) = tensor %d x pipeline %d x data "
                 "%d%s%s", world, launch.launcher, launch.master_addr, launch.master_port,
                 dist.get_backend(), tensor_parallel, pipeline_parallel,
                 world // (tensor_parallel * pipeline_parallel),
                 f", expert {expert_parallel}" if expert_parallel > 1 else "",
                 f", {virtual_pipeline} virtual stages a rank" if virtual_pipeline > 1 else "")
    return launch


def destroy_model_parallel() -> None:
    """Tears down megatron-core's model-parallel groups and releases their communicators.

    megatron-core's own ``destroy_model_parallel`` only forgets its group handles; torch keeps every
    group alive (gloo holds about 50 threads per set-up), so a process that re-initialises for each
    run, such as a test worker or a notebook, gathers thousands of idle threads. The default group
    is kept, and so are the groups of models still referenced. megatron-core also memoises
    ``RotaryEmbedding.forward`` per module (lru_cache), which keeps up to 32 dead models' rotary
    modules and their context-parallel groups alive: cleared too.
    """
    import gc

    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if not parallel_state.model_parallel_is_initialized():
        return
    parallel_state.destroy_model_parallel()
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    RotaryEmbedding.forward.cache_clear()
    # A group's communicator (and its threads) lives as long as its last Python reference. A
    # dropped model's DDP buffers and hooks hold theirs from reference cycles, which only the
    # collector frees: without this, a notebook or test worker keeps ~16 gloo threads a run.
    gc.collect()
