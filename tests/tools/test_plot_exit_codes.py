"""tools/plot_metrics.py and tools/plot_alrs.py as commands: a refusal is its one ``error:`` line
and exit code 2, as for every other megaloop command (before: 1, Python's code for a SystemExit
message; then lines prefixed with the tool's name, "plot_alrs: ...")."""

import os
import subprocess
import sys

import pytest

from tests.tool_scripts import TOOLS


@pytest.mark.parametrize("argv, message", [
    (["plot_metrics.py", "NOPE"], "error: NOPE/metrics.jsonl: no such file"),
    (["plot_alrs.py", "--alrs", "NOPE"], "error: NOPE: no ALRS log there"),
])
def test_a_refusal_exits_2_with_one_line(tmp_path, argv, message):
    done = subprocess.run([sys.executable, str(TOOLS / argv[0]), *argv[1:]], cwd=tmp_path,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(TOOLS.parent)})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_a_finished_plot_exits_0(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "loss": 3.0, "lr": 0.001, "tokens_per_s": 10.0}\n')
    done = subprocess.run([sys.executable, str(TOOLS / "plot_metrics.py"), str(run), "--out",
                           str(tmp_path / "c.png")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(TOOLS.parent)})
    assert done.returncode == 0 and (tmp_path / "c.png").is_file(), done.stderr
