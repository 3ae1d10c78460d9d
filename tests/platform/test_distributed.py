"""Launcher detection (torchrun, SLURM, MPI) and multi-process initialisation."""

import datetime
import os

import pytest
import torch

from megaloop.config import ConfigError
from megaloop.platform.launch import detect_launch_env, expand_slurm_nodelist
from tests.distributed import run_distributed


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[8-10],login5", ["a8", "a9", "a10", "login5"]),
    # Text after a bracket was a host of its own ("-ib"), and a second bracket was not expanded.
    ("gpu[01-02]-ib,cpu5", ["gpu01-ib", "gpu02-ib", "cpu5"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
])
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


def test_torchrun_environment():
    env = detect_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "MASTER_ADDR": "node7", "MASTER_PORT": "6000"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 8, 1)
    assert (env.master_addr, env.master_port) == ("node7", 6000)


def test_slurm_environment_uses_first_node_and_job_port():
    env = detect_launch_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                             "SLURM_STEP_NUM_TASKS": "16",
                             "SLURM_JOB_NODELIST": "h100-[004-005]", "SLURM_JOB_ID": "123"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 9, 16, 1)
    assert env.master_addr == "h100-004" and env.master_port == 20123


def test_slurm_step_on_part_of_the_allocation_meets_on_its_own_first_node():
    """Before the fix the ranks of `srun -w n3,n4` met on n1, where no rank runs, and
    waited for its store until the 30-minute timeout."""
    env = detect_launch_env({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
                             "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_STEP_NODELIST": "n[3-4]",
                             "SLURM_JOB_ID": "7"})
    assert env.master_addr == "n3"


@pytest.mark.parametrize("keys", [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                  ("PMI_RANK", "PMI_SIZE")])
def test_mpi_environment(keys):
    env = detect_launch_env({keys[0]: "1", keys[1]: "2", "MASTER_PORT": "7000"})
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 1, 2)
    with pytest.raises(ConfigError, match=r"^MPI launch of 2 ranks: set MASTER_ADDR \(rank 0's "
                                          r"host\) and MASTER_PORT"):
        detect_launch_env({keys[0]: "1", keys[1]: "2"})


@pytest.mark.parametrize("prefix, local_size_key", [
    ("OMPI_COMM_WORLD_", "OMPI_COMM_WORLD_LOCAL_SIZE"), ("PMI_", "MPI_LOCALNRANKS")])
def test_mpi_launch_over_nodes_needs_rank_0s_address(prefix, local_size_key):
    """Before: MASTER_PORT alone was taken, and the ranks of the second node looked for rank 0's
    store at their own 127.0.0.1 until the timeout."""
    env = {f"{prefix}RANK": "9", f"{prefix}SIZE": "16", local_size_key: "8", "MASTER_PORT": "7000"}
    with pytest.raises(ConfigError, match=r"^MPI launch of 16 ranks over several nodes: set "
                                          r"MASTER_ADDR \(rank 0's host\)"):
        detect_launch_env(env)
    assert detect_launch_env({**env, "MASTER_ADDR": "node01"}).master_addr == "node01"
    assert detect_launch_env({**env, local_size_key: "16"}).master_addr == "127.0.0.1"


def test_sbatch_batch_step_without_srun_is_a_single_process():
    env = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "5"})
    assert (env.launcher, env.world_size) == ("single", 1)


def test_single_process_default():
    env = detect_launch_env({})
    assert (env.launcher, env.rank, env.world_size) == ("single", 0, 1)
    assert env.master_port > 0


def _ranks_and_groups(rank, world_size):
    import logging

    from megatron.core import parallel_state

    from megaloop.platform.distributed import init_distributed

    logger, lines = logging.getLogger("megaloop.platform"), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        init_distributed(tensor_parallel=2, timeout_minutes=7)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    value = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(value, group=parallel_state.get_tensor_model_parallel_group())
    timeouts = {group_timeout(group) for group in (
        torch.distributed.group.WORLD, parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_group())}
    return parallel_state.get_tensor_model_parallel_rank(), value.item(), timeouts, lines


def group_timeout(group):
    return group._get_backend(torch.device("cpu")).options._timeout


def test_model_parallel_groups_on_gloo():
    """... with parallel.distributed_timeout_minutes in every group: the default group made by the
    test harness included (before: gloo's 30 minutes and NCCL's 10 there, megatron-core's 30 in
    its groups, whatever the setting). Rank 0 logs the layout in one line (before: none)."""
    seven = {datetime.timedelta(minutes=7)}
    first, second = run_distributed(_ranks_and_groups, world_size=2)
    assert first[:3] == (0, 3.0, seven) and second[:3] == (1, 3.0, seven)
    assert len(first[3]) == 1 and second[3] == []
    assert first[3][0].startswith("2 ranks (torchrun launch, rendezvous 127.0.0.1:")
    assert first[3][0].endswith(", gloo) = tensor 2 x pipeline 1 x data 1"), first[3]


def _stage_weights(rank, world_size):
    """The weight matrices of this rank's pipeline stage (PP=2, Dense, 4 layers, seed 1234),
    each divided by its standard deviation: the random numbers it was drawn from."""
    from megaloop.config import ModelConfig, ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed(pipeline_parallel=2, seed=1234)
    cfg = ModelConfig(arch="dense", iterations=1, num_layers=4, hidden_size=64,
                      ffn_hidden_size=128, num_attention_heads=4, vocab_size=128, seq_length=32)
    model = build_model(cfg, ParallelConfig(pipeline=2), stage=rank)
    return {name: (p / p.std()).detach().flatten() for name, p in model.named_parameters()
            if p.dim() == 2}


def test_pipeline_stages_draw_their_weights_from_their_own_numbers():
    """No weight of pipeline stage 1 starts as a (scaled) copy of numbers stage 0 drew. With
    one seed on every stage, stage 1 drew its layers from the numbers stage 0 had drawn its
    embedding and first layers from: its first attention projection was the embedding's first
    4096 values, times the ratio of their init stds."""
    first, second = run_distributed(_stage_weights, world_size=2)
    drawn = torch.cat(list(first.values()))
    window = 16
    runs = drawn.unfold(0, window, 1)  # every run of 16 consecutive numbers stage 0 drew
    for name, weight in second.items():
        ratios = runs / weight[:window]
        scaled_copy = (ratios - ratios[:, :1]).abs().amax(dim=1) < 1e-4 * ratios[:, 0].abs()
        assert not scaled_copy.any(), (name, scaled_copy.nonzero()[:3].flatten().tolist())


def _init_with(rank, world_size, settings):
    from megaloop.platform.distributed import init_distributed

    try:
        init_distributed(**settings[rank])
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("settings, message", [
    # Another seed built every group and trained diverging replicas, without a word.
    ([{"seed": 1}, {"seed": 2}], "train.seed=2 on rank 1 but 1 on rank 0"),
    # Other sizes built other groups: rank 0 waited for ever in megatron-core's group set-up.
    ([{"tensor_parallel": 2}, {"pipeline_parallel": 2}],
     "parallel.tensor=1 on rank 1 but 2 on rank 0"),
])
def test_ranks_launched_with_other_settings_are_refused_on_every_rank(settings, message):
    expected = f"{message}: every rank must be launched with the same settings"
    assert run_distributed(_init_with, world_size=2, settings=settings) == [expected, expected]


MPI_PROGRAM = """
import torch, torch.distributed as dist
from megaloop.platform.distributed import init_distributed
env = init_distributed()
value = torch.tensor([float(env.rank + 1)])
dist.all_reduce(value)
import sys
with open(f"{sys.argv[1]}/rank{env.rank}.txt", "w") as f:  # one file a rank: no interleaving
    f.write(f"{env.launcher} {env.rank} {env.world_size} {value.item()}")
"""


def test_mpiexec_launch(tmp_path):
    """Ranks come from MPI's environment (PMI_* under the mpich wheel's Hydra launcher)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip package mpich) not installed")
    script = tmp_path / "mpi_init.py"
    script.write_text(MPI_PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "MASTER_PORT": "29631",
           "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines == ["mpi 0 2 3.0", "mpi 1 2 3.0"]


def _gloo_threads_over_repeated_runs(rank, world_size, repeats):
    """Each run builds a DDP-wrapped TP=2 model and drops it, as a notebook or a test worker does.
    Models, DDP buffers and hooks reference the groups from reference cycles, so a group (and its
    gloo threads) outlives its destruction unless the cycles are collected."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megaloop.config import ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed
    from tests.models.variants import small_config

    def gloo_threads():
        return sum(open(f"/proc/self/task/{t}/comm").read().startswith("gloo")
                   for t in os.listdir("/proc/self/task"))

    counts = []
    for _ in range(repeats):
        init_distributed(tensor_parallel=2)
        model = build_model(small_config("asymloop"), ParallelConfig(tensor=2))
        DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        counts.append(gloo_threads())
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_repeated_runs_release_the_previous_groups_threads():
    """Each set-up builds a dozen gloo groups; without releasing them a test worker or a notebook
    that re-initialises per run gathers ~20 gloo threads a run until the machine crawls."""
    for counts in run_distributed(_gloo_threads_over_repeated_runs, world_size=2, repeats=4):
        assert counts == counts[:1] * len(counts), counts  # none left from earlier runs


def test_each_local_rank_gets_its_own_gpu_and_a_rank_past_them_is_named(caplog):
    from megaloop.platform.distributed import LaunchEnv, local_device

    def launch(local_rank):
        return LaunchEnv(8 + local_rank, 16, local_rank, "node0", 29500, "torchrun")

    with caplog.at_level("WARNING", logger="megaloop.platform"):
        assert [local_device(launch(r), 8) for r in range(8)] == list(range(8))
        assert local_device(launch(5), 1) == 0  # the launcher gave each task its own GPU
    assert not caplog.records
    with caplog.at_level("WARNING", logger="megaloop.platform"):
        assert local_device(launch(5), 4) == 1  # srun --gpus-per-task=4, or two ranks on GPU 1
    assert caplog.messages == ["local rank 5 (torchrun launch) sees 4 GPUs, fewer than its local "
                               "rank: it takes GPU 1, which another rank takes too unless the "
                               "launcher gave each task its own GPUs"]
