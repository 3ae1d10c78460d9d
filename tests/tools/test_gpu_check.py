"""tools/gpu_check.sh, read as the one GPU check: it runs every GPU-marked test module."""

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A module-level ``pytestmark`` or a test decorated with the marker.
GPU_MARKER = re.compile(r"^(pytestmark\s*=.*pytest\.mark\.gpu\b|\s*@pytest\.mark\.gpu\b)", re.M)


def test_the_gpu_check_runs_every_gpu_marked_test_module():
    """A GPU-marked module the script does not name is skipped on every CPU machine and never run
    on a GPU either (tests/models/test_moe_gpu.py was: MoE's alltoall dispatch and Transformer
    Engine's grouped-GEMM experts went unchecked)."""
    marked = sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                    if GPU_MARKER.search(path.read_text()))
    assert "tests/models/test_gpu.py" in marked  # the pattern finds the markers
    script = (REPO / "tools" / "gpu_check.sh").read_text()
    pytest_step = next(line for line in re.split(r"(?<!\\)\n", script)
                       if line.startswith("step pytest_gpu "))
    assert [m for m in marked if m not in pytest_step] == []


def test_relative_out_and_wheels_are_the_callers(tmp_path):
    """The script moves to the checkout. Before: a relative OUT (its results) and MEGALOOP_WHEELS
    (the offline install's wheels) were read there, not where the caller typed them. Every
    command is stubbed: a python that records its arguments, does nothing and finds no package
    (``python -c "import ..."`` fails, so the offline install runs), no GPU."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, status in (("python3", '[ "$1" != -c ]'), ("python", '[ "$1" != -c ]'),
                         ("nvidia-smi", "true")):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "$STUB_LOG"\n{status}\n')
        (stubs / name).chmod(0o755)
    caller = tmp_path / "caller"
    caller.mkdir()
    env = {**os.environ, "OUT": "gpu_check_caller_results", "MEGALOOP_WHEELS": "my_wheels",
           "STUB_LOG": str(tmp_path / "log"),
           "PATH": os.pathsep.join([str(stubs), os.environ["PATH"]])}
    try:
        subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh")], cwd=caller, env=env,
                       capture_output=True, text=True, timeout=120)
        assert (caller / "gpu_check_caller_results" / "environment.txt").is_file()
        assert f"--find-links {caller}/my_wheels " in (tmp_path / "log").read_text()
    finally:  # what the old script wrote into the checkout
        shutil.rmtree(REPO / "gpu_check_caller_results", ignore_errors=True)
