"""What the command-line entry points share: argparse types that say in one line what is wrong with
a flag's value, the refusal of an override of a setting a command makes itself, and why a child
process (a torchrun launch) failed."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.cli import (child_failure, float_above, int_at_least, refuse_overrides_of, set_by,
                          with_settings)


def _parser():
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--limit", type=int_at_least(1))
    parser.add_argument("--shots", type=int_at_least(0), nargs="+")
    parser.add_argument("--tolerance", type=float_above(0))
    return parser


def test_values_at_and_above_the_minimum_are_integers():
    args = _parser().parse_args(["--limit", "1", "--shots", "0", "5", "--tolerance", "1e-9"])
    assert (args.limit, args.shots, args.tolerance) == (1, [0, 5], 1e-9)


@pytest.mark.parametrize("argv, message", [
    (["--limit", "0"], "tool: error: argument --limit: 0: must be >= 1"),
    (["--shots", "2", "-1"], "tool: error: argument --shots: -1: must be >= 0"),
    (["--limit", "1.5"], "tool: error: argument --limit: '1.5': not an integer"),
    (["--tolerance", "0"], "tool: error: argument --tolerance: 0.0: must be > 0"),
    (["--tolerance", "-0.1"], "tool: error: argument --tolerance: -0.1: must be > 0"),
    (["--tolerance", "nan"], "tool: error: argument --tolerance: nan: must be > 0"),
    (["--tolerance", "x"], "tool: error: argument --tolerance: 'x': not a number"),
])
def test_other_values_exit_2_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1] == message


def test_an_override_of_what_the_command_sets_is_refused_naming_what_sets_it():
    from megaloop.config import ConfigError

    set_by = {"parallel.*": "--layouts", "parallel.pipeline_split": None, "train.train_steps":
              "--steps"}
    refuse_overrides_of(["parallel.pipeline_split=[2,2]", "train.lr=1e-4", "model.arch=dense"],
                        set_by)
    for override, by in (("parallel.tensor=2", "--layouts"), ("train.train_steps=9", "--steps")):
        with pytest.raises(ConfigError, match=rf"^override '{override}': set by {by}$"):
            refuse_overrides_of(["train.lr=1e-4", override], set_by)


def test_a_commands_settings_apply_to_a_copy_and_name_the_option_each_comes_from():
    from megaloop.config import RunConfig

    settings = {"train.out_dir": "--out/single", "train.train_steps": "--steps",
                "checkpoint.resume": False}
    assert set_by(settings, ("--steps", "--out"), "the tool") == {
        "train.out_dir": "--out", "train.train_steps": "--steps", "checkpoint.resume": "the tool"}
    given = RunConfig()
    cfg = with_settings(given, {"train.lr": 0.5, "checkpoint.resume": False})
    assert (cfg.train.lr, cfg.checkpoint.resume) == (0.5, False)
    assert (given.train.lr, given.checkpoint.resume) == (RunConfig().train.lr, True)


def _child(*args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH":
                               str(Path(__file__).parents[1])})


def test_a_failed_launch_is_named_with_its_workers_reason(tmp_path):
    """torchrun's stderr ends with its own report (exit codes, 'error_file: <N/A>'); the reason is
    the worker's error line before it, once though both ranks print it, or its exception, which
    torch prints as '[rank0]: ValueError: ...' once the process group is up."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = _child(*launch, "-m", "megaloop.train", "model.num_attention_heads=3", "data.path=[x]",
                  "data.eod_id=0")
    assert child_failure(done, "the tp2 launch") == (
        "the tp2 launch failed (exit 1): model.hidden_size=128: must be a multiple of "
        "num_attention_heads=3 (or set head_dim)")
    script = tmp_path / "worker.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "raise ValueError('no: data')\n")
    assert child_failure(_child(*launch, str(script)), "the dp2 launch") == (
        "the dp2 launch failed (exit 1): ValueError: no: data")
    assert child_failure(_child("-c", "raise ValueError('no: data')"), "x") == (
        "x failed (exit 1): ValueError: no: data")
    assert child_failure(_child("-c", "import sys; sys.exit(3)"), "x") == (
        "x failed (exit 3): nothing on stderr")
    assert child_failure(_child("-c", "pass"), "x") is None


LATE_RANK_0 = """
import os, runpy, sys, time
if os.environ["RANK"] == "0":
    time.sleep(1)  # a slow interpreter start, before megaloop-train blocks the stop signals
sys.argv = ["megaloop-train", *sys.argv[1:]]
runpy.run_module("megaloop.train", run_name="__main__")
"""


def test_an_error_left_to_rank_0_is_said_though_torchrun_ends_the_workers_at_the_first_exit(
        tmp_path):
    """torchrun SIGTERMs every worker once one exits: before, rank 1 failed first and rank 0,
    still starting, was killed (-15) without a word, and no rank said the error."""
    (tmp_path / "late.py").write_text(LATE_RANK_0)
    done = _child("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                  str(tmp_path / "late.py"), "train.lrr=1")
    assert child_failure(done, "the launch") == (
        "the launch failed (exit 1): unknown field train.lrr (did you mean lr?)"), done.stderr


def _log_lines(rank, world_size):
    """What megaloop-train's logging writes on this rank for a note and a warning."""
    import io
    import logging

    from megaloop.cli import ALIKE_ON_EVERY_RANK, EVERY_RANK, log_to_stderr

    root, stderr = logging.getLogger(), sys.stderr
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    sys.stderr = io.StringIO()
    try:
        log_to_stderr()
        logging.getLogger("megaloop.train").info("resumed from iter_0000150 at step 150")
        logging.getLogger("megaloop.train").warning("rank %d: a warning", rank)
        logging.getLogger("megaloop.train").info("rank %d: traced", rank, extra=EVERY_RANK)
        logging.getLogger("megaloop.train").warning("stopped by signal 10",
                                                    extra=ALIKE_ON_EVERY_RANK)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = stderr
        root.handlers[:] = handlers
        root.setLevel(level)


def test_notes_come_from_rank_0_alone_and_warnings_from_every_rank():
    """Before: every rank wrote each note, so a job log held each line once per rank."""
    from tests.distributed import run_distributed

    first, second = run_distributed(_log_lines, 2)
    assert "resumed from iter_0000150 at step 150" in first and "rank 0: a warning" in first
    assert "resumed from" not in second and "rank 1: a warning" in second
    assert "rank 0: traced" in first and "rank 1: traced" in second  # a note of its own
    # A warning every rank logs alike (the stop all ranks agreed on), once.
    assert "stopped by signal 10" in first and "stopped by signal 10" not in second


def _errors_of_train(rank, world_size, argv_of_rank):
    """What megaloop-train writes on stderr, and its exit status, on this rank."""
    import io
    import logging

    from megaloop.train import main

    root, stderr = logging.getLogger(), sys.stderr
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    sys.stderr = io.StringIO()
    local_rank = os.environ["LOCAL_RANK"]
    os.environ["LOCAL_RANK"] = "0"  # each rank on a node of its own, with its own files
    try:
        status = main(argv_of_rank[rank])
        return status, sys.stderr.getvalue()
    finally:
        os.environ["LOCAL_RANK"] = local_rank
        sys.stderr = stderr
        root.handlers[:] = handlers
        root.setLevel(level)


def test_an_error_every_rank_has_comes_from_rank_0_and_one_ranks_own_from_that_rank(tmp_path):
    """Before: every rank printed every error, 128 copies of a config error in a job log."""
    from tests.distributed import run_distributed

    small = ["model.arch=dense", "model.num_layers=2", "model.hidden_size=32",
             "model.ffn_hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=128",
             "model.seq_length=32", "train.micro_batch_size=1", "train.global_batch_size=2",
             "train.tensorboard=false", f"train.out_dir={tmp_path / 'run'}", "data.eod_id=0"]
    missing_data = [*small, f"data.path=[{tmp_path / 'absent'}]"]  # found by rank 0 for all
    typo = [*small, "train.lrr=1"]
    missing_config = ["--config", str(tmp_path / "absent.yaml")]  # one node does not see it
    for argv, alike, said in ((missing_data, True, "absent"), (typo, True, "train.lrr"),
                              ([typo, missing_config], False, "train.lrr")):
        argv_of_rank = argv if not alike else [argv, argv]
        (first, first_err), (second, second_err) = run_distributed(
            _errors_of_train, 2, argv_of_rank=argv_of_rank)
        assert first == second == 2, (first_err, second_err)
        assert first_err.count("error: ") == 1 and said in first_err, first_err
        if alike:
            assert second_err == "", second_err
        else:  # rank 1's own error is not left to rank 0, whose error is another
            assert second_err == f"error: config file {tmp_path / 'absent.yaml'}: not found\n"


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("argv, said", [
    (["train.lrr=1"], "error: unknown field train.lrr (did you mean lr?)\n"),
    # argparse's usage error: before, printed by every rank
    (["--bad-flag"], "megaloop-train: error: unrecognized arguments: --bad-flag\n"),
    (["--world-size", "0"], "megaloop-train: error: argument --world-size: 0: must be >= 1\n")])
def test_an_argument_error_before_the_process_group_is_up_comes_from_rank_0(rank, argv, said,
                                                                            tmp_path):
    """The launcher's rank decides, before torch is loaded (srun: every task fails alike)."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "megaloop.train", *argv], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    if rank == 0:
        assert done.stderr.endswith(said), done.stderr
    else:
        assert done.stderr == "", done.stderr


def _printed(error) -> str:
    """What print_error writes on this rank for ``error``."""
    import contextlib
    import io

    from megaloop.cli import print_error

    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        print_error(error)
    return stderr.getvalue()


def _agreed_error(rank):
    """The DataError every rank raises once rank 1 alone fails to read its shard."""
    from megaloop.data import DataError
    from megaloop.training.collective import each_rank_agrees

    def read():
        if rank == 1:
            raise DataError("shard.bin: truncated")

    with pytest.raises(DataError) as agreed:
        each_rank_agrees(read, (DataError,))
    return agreed.value


def _errors_after_a_failure_decided_together(rank, world_size):
    """What each rank prints of the agreed error, of a save's error restating it (as
    checkpoint_save and checkpoint_load word theirs), and of rank 1's own later error that
    quotes it, in one process."""
    from megaloop.cli import restating

    agreed = _agreed_error(rank)
    restated = restating(agreed, RuntimeError(f"iter_0000002.tmp: saving step 2 failed ({agreed}; "
                                              "1.2 GB free)"))
    own = RuntimeError(f"retried after {agreed}: shard.bin: permission denied")
    return _printed(agreed), _printed(restated), _printed(own) if rank == 1 else ""


def test_an_error_decided_together_comes_from_rank_0_and_a_later_own_one_from_its_rank():
    """Before: an error restating the agreed one was printed by every rank; then, every agreed
    message was kept for the process's life and matched by substring, so that rank 1's own
    later error, quoting it, was left to rank 0 and printed by no rank."""
    from tests.distributed import run_distributed

    first, second = run_distributed(_errors_after_a_failure_decided_together, 2)
    assert first == ("error: rank 1: shard.bin: truncated\n",
                     "error: iter_0000002.tmp: saving step 2 failed (rank 1: shard.bin: "
                     "truncated; 1.2 GB free)\n", "")
    assert second == ("", "", "error: retried after rank 1: shard.bin: truncated: shard.bin: "
                              "permission denied\n")


@pytest.mark.parametrize("rank,local_rank", [(0, 0), (1, 0), (1, 1)])
def test_an_error_of_the_config_file_comes_from_the_first_rank_of_each_node(rank, local_rank,
                                                                           tmp_path):
    """Each node reads the --config file for itself (a node-local or stale copy may differ from
    rank 0's): before, an error in it came from rank 0 alone, and a node whose copy alone was
    wrong exited 2 without a word (rank 0 then waited for it at the rendezvous)."""
    (tmp_path / "run.yaml").write_text("train:\n  lrr: 1\n")
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "megaloop.train", "--config", "run.yaml"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == ("error: config file run.yaml: unknown field train.lrr (did you mean "
                           "lr?)\n" if local_rank == 0 else ""), done.stderr


@pytest.mark.parametrize("launch", [
    {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
     "MASTER_PORT": "29511"},  # mpiexec: its ranks' process group is up by then
    # mpiexec without the rendezvous address (refused later): before, every rank printed
    {"PMI_RANK": "1", "PMI_SIZE": "2"},
    {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"}])
def test_a_rank_that_leaves_its_error_to_rank_0_waits_before_it_exits(launch, monkeypatch, capsys):
    """Every launcher ends the other ranks at the first exit: a rank 1 that left its error to
    rank 0 and exited at once let mpiexec kill rank 0 before its line (exit 2, stderr empty,
    once in a full test run); the wait was torchrun's alone. The launcher's rank decides here:
    a world of one that an earlier test left in this worker would make this process rank 0 (CI
    failed on it)."""
    from megaloop import cli

    monkeypatch.setattr("torch.distributed.is_initialized", lambda: False)
    for key in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID",
                "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in launch.items():
        monkeypatch.setenv(key, value)
    waits = []
    monkeypatch.setattr("time.sleep", waits.append)
    cli.print_error(RuntimeError("no usable document"), alike=True)
    assert waits == [cli.RANK0_GRACE_S] and capsys.readouterr().err == ""
