"""Process-group and model-parallel initialisation from torchrun, SLURM (srun) or MPI launchers.

The launcher is detected from its environment variables, so the same entry point works under
``torchrun``, ``srun`` (one task per GPU), ``mpiexec``, or as a plain single process. On machines
without CUDA the backend is gloo and the CPU compatibility layer is switched on.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaloop.config import ConfigError, ParallelConfig
from megaloop.platform import cpu_compat
from megaloop.scale.layout import check_world_size

log = logging.getLogger("megaloop.platform")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expands a SLURM hostlist such as ``gpu[01-03,07],login5`` into host names.

    SLURM's own ``scontrol show hostnames`` is not available inside every container, so the
    bracket grammar (comma-separated ranges with zero padding, text after a bracket, several
    brackets in a name: ``rack[1-2]-gpu[01-08]-ib``) is expanded here.
    """
    return [host for entry in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist)
            for host in _expand_host(entry)]


def _expand_host(entry: str) -> list[str]:
    match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", entry)
    if match is None:
        return [entry]
    prefix, ranges, rest = match.groups()
    hosts = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            hosts += [f"{prefix}{i:0{len(lo)}d}{tail}" for tail in _expand_host(rest)]
    return hosts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Reads rank, world size and rendezvous address from the launcher's environment."""
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", 0))
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun / torch.distributed.launch
        return LaunchEnv(
            int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
            addr, port or 29500, "torchrun",
        )
    # Only srun sets SLURM_STEP_NUM_TASKS: a plain `python` in an sbatch script (or a notebook in
    # an allocation) also sees SLURM_PROCID/SLURM_NTASKS, and must not wait for absent peers.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # Rank 0 runs on the step's first node, which is the job's only when the step spans the
        # allocation (not under `srun -w`, `--relative` or `-N` below the job's node count).
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if "MASTER_ADDR" not in env and nodelist:
            addr = expand_slurm_nodelist(nodelist)[0]
        # A job-derived port keeps concurrent jobs sharing a node from colliding.
        default_port = 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000
        return LaunchEnv(
            int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]),
            int(env.get("SLURM_LOCALID", 0)),
            addr, port or default_port, "slurm",
        )
    for rank_key, size_key, local_key, local_size_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ):
        if rank_key in env and size_key in env:
            size = int(env[size_key])
            # Ranks on another node than rank 0 would look for it at their own 127.0.0.1 and wait
            # there until the store's timeout.
            across_nodes = int(env.get(local_size_key, size)) < size
            if size > 1 and (not port or (across_nodes and "MASTER_ADDR" not in env)):
                raise ConfigError(
                    f"MPI launch of {size} ranks{' over several nodes' if across_nodes else ''}: "
                    "set MASTER_ADDR (rank 0's host) and MASTER_PORT (e.g. `mpiexec -genv "
                    "MASTER_ADDR node01 -genv MASTER_PORT 29500 ...`) so that every rank "
                    "rendezvous at the same address"
                )
            return LaunchEnv(
                int(env[rank_key]), int(env[size_key]), int(env.get(local_key, 0)),
                addr, port or 29500, "mpi",
            )
    return LaunchEnv(0, 1, 0, addr, port or _free_port(), "single")


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
    mcore_tp.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
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
