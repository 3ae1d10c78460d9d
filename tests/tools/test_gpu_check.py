"""tools/gpu_check.sh, read as the one GPU check: it runs every GPU-marked test module."""

import re
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
