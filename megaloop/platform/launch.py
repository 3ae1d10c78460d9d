"""The launcher's environment: rank, world size and rendezvous address from torchrun, SLURM (srun)
or MPI variables. Standard library only, unlike megaloop.platform.distributed (which re-exports
it): megaloop-train reads the rank of a process that fails before it loads torch, to leave an
error every rank has alike to rank 0 (megaloop.cli)."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from megaloop.config import ConfigError


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


def detect_launch_env(environ: dict[str, str] | None = None, *,
                      rendezvous: bool = True) -> LaunchEnv:
    """Reads rank, world size and rendezvous address from the launcher's environment.
    ``rendezvous=False``: for the rank and world size alone, an MPI launch's rendezvous address
    is not required."""
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
            unaddressed = not port or (across_nodes and "MASTER_ADDR" not in env)
            if rendezvous and size > 1 and unaddressed:
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
