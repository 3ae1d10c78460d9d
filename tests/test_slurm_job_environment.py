"""The slurm/ job scripts' tasks get what the user meant where the job runs: threads that fit
their CPUs, and the paths typed where the job was submitted (srun and scontrol stubbed)."""

import subprocess

import pytest

from tests.test_slurm import REPO, _environment, _job


@pytest.mark.parametrize("allocation, threads", [
    ({"SLURM_CPUS_PER_TASK": "4"}, "4"),  # before: 8, two threads a CPU
    ({"SLURM_CPUS_PER_TASK": "12"}, "8"),
    # No --cpus-per-task: the node's share of the smallest node's CPUs.
    ({"SLURM_JOB_CPUS_PER_NODE": "24,96(x3)"}, "3"),
    ({"SLURM_JOB_CPUS_PER_NODE": "8(x16)", "SLURM_NTASKS_PER_NODE": "16"}, "1"),
    ({"SLURM_CPUS_PER_TASK": "4", "OMP_NUM_THREADS": "6"}, "6"),  # the user's, as given
])
def test_the_tasks_threads_default_to_their_cpus(allocation, threads, tmp_path):
    job, log = _job(tmp_path, "crash", **{"SLURM_NTASKS_PER_NODE": "8", "OMP_NUM_THREADS": None,
                                          "SLURM_CPUS_PER_TASK": None,
                                          "SLURM_JOB_CPUS_PER_NODE": None, **allocation})
    assert job.wait(timeout=60) == 3, (tmp_path / "job.out").read_text()
    assert (tmp_path / "log.srun_threads").read_text() == threads


def test_relative_paths_are_read_from_where_the_job_was_submitted(tmp_path):
    """Submitted from elsewhere (MEGALOOP_ROOT naming the checkout), a relative path is the one
    under the submit directory the user typed it in. Before: the checkout's (the script moves
    there), its data "not found", its run and conversion written there. A blend's weights stay."""
    submitted = tmp_path / "home"
    submitted.mkdir()
    where = {"cwd": submitted, "SLURM_SUBMIT_DIR": str(submitted), "MEGALOOP_ROOT": str(REPO)}
    (tmp_path / "convert").mkdir()
    job, log = _job(tmp_path / "convert", "crash", script="convert.sh",
                    CHECKPOINT="runs/a/checkpoints", OUT="hf/a", **where)
    assert job.wait(timeout=60) == 3, (tmp_path / "convert" / "job.out").read_text()
    srun = (tmp_path / "convert" / "log.srun_args").read_text().splitlines()
    assert srun[-2:] == [f"{submitted}/runs/a/checkpoints", f"{submitted}/hf/a"], srun
    (tmp_path / "train").mkdir()
    job, log = _job(tmp_path / "train", "crash", DATA="0.3,fwe_a, 0.7, /lustre/fwe_b",
                    TOKENIZER="tok.model", RUN_DIR="runs/b", **where)
    assert job.wait(timeout=60) == 3, (tmp_path / "train" / "job.out").read_text()
    srun = (tmp_path / "train" / "log.srun_args").read_text().splitlines()
    assert {f"data.path=[0.3,{submitted}/fwe_a, 0.7, /lustre/fwe_b]",
            f"data.tokenizer_model={submitted}/tok.model",
            f"train.out_dir={submitted}/runs/b"} <= set(srun), srun
    # The default run directory, the checkout's, as the refusal of overrides without RUN_DIR
    # names it for RUN_DIR given there.
    refused = subprocess.run(["bash", str(REPO / "slurm" / "asymloop_7b.sh"), "model.x=1"],
                             cwd=submitted, capture_output=True, text=True,
                             env=_environment(DATA="d", TOKENIZER="t", MEGALOOP_ROOT=str(REPO)))
    assert f"RUN_DIR={REPO}/runs/asymloop_7b to continue" in refused.stderr, refused.stderr


def test_paths_in_the_checkout_are_given_relative_to_it_for_the_container(tmp_path):
    """A path in the checkout, relative from a directory of it or absolute, is mounted in the
    container (IMAGE), where the checkout is the working directory. Before: the relative one was
    the checkout's (hf/a, not docs/hf/a); the absolute one refused as not mounted."""
    job, log = _job(tmp_path, "crash", script="convert.sh", cwd=REPO / "docs",
                    CHECKPOINT=f"{REPO}/runs/a/checkpoints", OUT="hf/a", IMAGE="/images/m.sqsh")
    assert job.wait(timeout=60) == 3, (tmp_path / "job.out").read_text()
    srun = (tmp_path / "log.srun_args").read_text().splitlines()
    assert srun[-2:] == ["runs/a/checkpoints", "docs/hf/a"], srun
