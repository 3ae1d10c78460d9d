"""slurm/preprocess.sh with mpiexec stubbed: the ranks per node as the mpiexec on PATH takes them,
and tokenizer processes that fit the node's CPUs."""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# mpiexec as each flavour takes the ranks per node: Hydra (MPICH, Intel MPI) -ppn, Open MPI
# --map-by ppr:N:node, refusing -ppn as an unknown option (exit 1).
MPIEXEC = """#!/bin/bash
if [ "$1" = --version ]; then echo "$STUB_MPIEXEC_VERSION"; exit 0; fi
echo "$*" > "$STUB_LOG"
echo "I_MPI_PIN=${I_MPI_PIN-unset}" > "$STUB_LOG.env"
case "$STUB_MPIEXEC_VERSION" in
  *OpenRTE* | *"Open MPI"*) [[ " $* " != *" -ppn "* ]] || { echo "unknown option -ppn" >&2; exit 1; } ;;
  *) [[ " $* " != *" --map-by "* ]] || { echo "unrecognized argument map-by" >&2; exit 255; } ;;
esac
"""
HYDRA = "HYDRA build details:\n    Version:                                 4.2.2"


def _preprocess(tmp_path, version=HYDRA, args=(), cwd="/", **settings):
    """preprocess.sh ``args`` under a stubbed mpiexec in an allocation of ``settings`` (SLURM_*
    variables, TASKS_PER_NODE, WORKERS): the result and the mpiexec command line, None if not
    started."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "mpiexec").write_text(MPIEXEC)
    (stubs / "mpiexec").chmod(0o700)
    log = tmp_path / "log"
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "OMPI_MCA_", "PRTE_MCA_", "I_MPI_PIN"))}
    env.update({"INPUT": "/in/*.parquet", "OUTPUT": "/out/fwe", "TOKENIZER": "/tok.model",
                "SLURM_SUBMIT_DIR": str(REPO), "SLURM_NNODES": "2", **settings,
                "STUB_MPIEXEC_VERSION": version, "STUB_LOG": str(log),
                "PATH": os.pathsep.join([str(stubs), os.environ["PATH"]])})
    result = subprocess.run(["bash", str(REPO / "slurm" / "preprocess.sh"), *args], cwd=cwd,
                            env=env, text=True, capture_output=True)
    return result, (log.read_text() if log.exists() else None)


@pytest.mark.parametrize("version, per_node", [
    (HYDRA, "-ppn 4"),
    ("mpiexec (OpenRTE) 4.1.5", "--map-by ppr:4:node --bind-to none"),
    ("mpiexec (Open MPI) 5.0.3", "--map-by ppr:4:node --bind-to none"),
])
def test_preprocess_starts_its_ranks_per_node_with_the_mpiexec_on_path(version, per_node,
                                                                       tmp_path):
    """Before the fix: -ppn whatever the mpiexec, which the system's Open MPI refuses; then Open
    MPI's default binding (a core for 2 ranks or fewer, else a socket), which each rank's
    tokenizer processes inherit: all on one core."""
    result, command = _preprocess(tmp_path, version, SLURM_JOB_CPUS_PER_NODE="32(x2)",
                                  TASKS_PER_NODE="4", WORKERS="8")
    assert result.returncode == 0, result.stderr
    assert command.startswith(f"-n 8 {per_node} python tools/preprocess_data.py --input ")


@pytest.mark.parametrize("settings, pinning", [
    ({}, "off"), ({"I_MPI_PIN_DOMAIN": "socket"}, "unset")])
def test_intel_mpi_leaves_the_workers_the_ranks_cpus(settings, pinning, tmp_path):
    """Before: Intel MPI pinned each rank, and its tokenizer processes with it, to one core; an
    I_MPI_PIN* setting of the user's holds."""
    result, command = _preprocess(tmp_path, "Intel(R) MPI Library for Linux* OS, Version 2021.10 "
                                  "Build 20230619", SLURM_JOB_CPUS_PER_NODE="32(x2)",
                                  TASKS_PER_NODE="2", **settings)
    assert result.returncode == 0, result.stderr
    assert command.startswith("-n 4 -ppn 2 python tools/preprocess_data.py "), command
    assert (tmp_path / "log.env").read_text() == f"I_MPI_PIN={pinning}\n"


@pytest.mark.parametrize("binding", ["OMPI_MCA_hwloc_base_binding_policy",
                                     "PRTE_MCA_hwloc_default_binding_policy"])
def test_a_binding_policy_the_user_set_for_open_mpi_holds(binding, tmp_path):
    """Before: --bind-to none overrode it without a word (package: a rank per socket, its
    workers on that socket's cores)."""
    result, command = _preprocess(tmp_path, "mpiexec (Open MPI) 5.0.3",
                                  SLURM_JOB_CPUS_PER_NODE="32(x2)", TASKS_PER_NODE="2",
                                  **{binding: "package"})
    assert result.returncode == 0, result.stderr
    assert command.startswith("-n 4 --map-by ppr:2:node python tools/preprocess_data.py "), command


@pytest.mark.parametrize("allocation, ranks, workers", [
    # The header's --cpus-per-task=32 with 4 ranks a node: before, 32 workers each, 128 in all.
    ({"SLURM_JOB_CPUS_PER_NODE": "32(x2)", "SLURM_NTASKS_PER_NODE": "1",
      "SLURM_CPUS_PER_TASK": "32", "TASKS_PER_NODE": "4"}, 4, 8),
    # No --cpus-per-task: before, 8 workers each, 64 on 16 CPUs.
    ({"SLURM_JOB_CPUS_PER_NODE": "16(x2)", "TASKS_PER_NODE": "8"}, 8, 2),
    # sbatch --ntasks-per-node 4 --cpus-per-task 8 on nodes of unequal size: before, 1 rank a
    # node (the allocation's 4 ignored) of 8 workers, a quarter of the CPUs used.
    ({"SLURM_JOB_CPUS_PER_NODE": "48,32", "SLURM_NTASKS_PER_NODE": "4",
      "SLURM_CPUS_PER_TASK": "8"}, 4, 8),
])
def test_preprocess_by_default_runs_as_many_workers_per_node_as_it_has_cpus(allocation, ranks,
                                                                            workers, tmp_path):
    result, command = _preprocess(tmp_path, **allocation)
    assert result.returncode == 0, result.stderr
    assert command.startswith(f"-n {2 * ranks} -ppn {ranks} python tools/preprocess_data.py ")
    assert command.endswith(f" --workers {workers}\n"), command


@pytest.mark.parametrize("settings, message", [
    ({"WORKERS": "32", "TASKS_PER_NODE": "4"},
     "error: WORKERS=32 x TASKS_PER_NODE=4 = 128 tokenizer processes per node, more than a "
     "node's 64 CPUs (SLURM_JOB_CPUS_PER_NODE=64(x2)): set WORKERS to at most 16, or unset it"),
    ({"TASKS_PER_NODE": "65"}, "error: TASKS_PER_NODE=65 ranks per node, more than a node's 64 "
                               "CPUs (SLURM_JOB_CPUS_PER_NODE=64(x2)): set TASKS_PER_NODE to "
                               "at most 64"),
    ({"WORKERS": "auto"}, "error: WORKERS=auto: a whole number, at least 1"),
    ({"TASKS_PER_NODE": "0"}, "error: TASKS_PER_NODE=0: a whole number, at least 1"),
    # Extra arguments the tool reads after the script's own: before, WORKERS's check passed and
    # 64 workers started; OUTPUT was ignored.
    ({"WORKERS": "8", "args": ["--workers", "64"]}, "error: --workers among the extra arguments: "
     "preprocess.sh sets --workers from WORKERS, which it would replace; set WORKERS instead"),
    ({"args": ["--min-int-score", "3", "--output-prefix=/b/fwe"]},
     "error: --output-prefix=/b/fwe among the extra arguments: preprocess.sh sets --output-prefix "
     "from OUTPUT, which it would replace; set OUTPUT instead"),
])
def test_preprocess_refuses_settings_it_would_overrun_or_ignore_in_one_line(settings, message,
                                                                          tmp_path):
    """Before: started, 128 tokenizer processes on 64 CPUs; TASKS_PER_NODE=0 ran mpiexec -n 0."""
    result, command = _preprocess(tmp_path, SLURM_JOB_CPUS_PER_NODE="64(x2)", **settings)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(message), result.stderr
    assert command is None


def _sbatch_allocation(command):
    """The environment a job of ``command`` (``VAR=... sbatch [OPTIONS] slurm/preprocess.sh``,
    options over the script's #SBATCH ones) sees: its variables and SLURM's, for nodes of as
    many CPUs as the job asks."""
    script = (REPO / "slurm" / "preprocess.sh").read_text()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    variables, given = command.split(" sbatch ")
    options.update(re.findall(r"--([\w-]+)[ =](\d+)", given))
    nodes, tasks, cpus = (int(options[o]) for o in ("nodes", "ntasks-per-node", "cpus-per-task"))
    return {**dict(re.findall(r"(\w+)=(\S+)", variables)), "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_CPUS_PER_TASK": str(cpus),
            "SLURM_JOB_CPUS_PER_NODE": f"{tasks * cpus}(x{nodes})"}, nodes, tasks, cpus


def test_the_headers_commands_use_every_cpu_of_their_nodes(tmp_path):
    header = (REPO / "slurm" / "preprocess.sh").read_text().replace("\\\n#   ", "")
    commands = re.findall(r"^#   (.* sbatch .*)$", header, re.M)
    assert len(commands) == 2, commands
    for number, command in enumerate(commands):
        allocation, nodes, tasks, cpus = _sbatch_allocation(command.replace("'", ""))
        (tmp_path / str(number)).mkdir()
        result, mpiexec = _preprocess(tmp_path / str(number), **allocation)
        assert result.returncode == 0, (command, result.stderr)
        assert mpiexec.startswith(f"-n {nodes * tasks} -ppn {tasks} "), (command, mpiexec)
        assert mpiexec.endswith(f" --workers {cpus}\n"), (command, mpiexec)


def test_outside_an_allocation_workers_fill_the_cpus_whatever_omp_num_threads(tmp_path):
    """nproc answers OMP_NUM_THREADS when it is set: before, a shell's OMP_NUM_THREADS=1 made
    the machine one CPU, so WORKERS defaulted to 1 (and WORKERS=2 was refused)."""
    cpus = len(os.sched_getaffinity(0))
    result, command = _preprocess(tmp_path, SLURM_NNODES="1", OMP_NUM_THREADS="1",
                                  OMP_THREAD_LIMIT="1")
    assert result.returncode == 0, result.stderr
    assert command.endswith(f" --workers {cpus}\n"), command


def test_relative_paths_are_read_from_where_the_job_was_submitted(tmp_path):
    """Before: from the checkout (MEGALOOP_ROOT), where the script moves: no input found there,
    or the dataset written into the checkout."""
    result, command = _preprocess(tmp_path, cwd=tmp_path, SLURM_SUBMIT_DIR=str(tmp_path),
                                  MEGALOOP_ROOT=str(REPO), SLURM_JOB_CPUS_PER_NODE="8(x2)",
                                  INPUT="fwe/*.parquet", OUTPUT="out/fwe", TOKENIZER="t5.model")
    assert result.returncode == 0, result.stderr
    assert (f" --input {tmp_path}/fwe/*.parquet --output-prefix {tmp_path}/out/fwe "
            f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {tmp_path}/t5.model "
            ) in command, command
