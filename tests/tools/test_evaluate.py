"""tools/evaluate.py as a process: what a signal that ends it leaves behind."""

import os
import subprocess
import sys
from pathlib import Path

from tests.hf.harness import EVAL_DATA

# Saves a tiny AsymLoop's config (the source tools/evaluate.py checks first), then runs the tool
# with the model load replaced by a temporary export that ends in SIGTERM, as a time limit would.
SCRIPT = """
import os, signal, sys
from pathlib import Path
from megaloop.hf import evaluate as ev
from tests.reference.test_generation import reference_model
from tests.tool_scripts import load_tool

def export_then_terminated(source, workdir, tokenizer=None):
    (Path(workdir) / "model.safetensors").write_bytes(b"0" * 100_000)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()

reference_model("asymloop").save_pretrained(sys.argv[1])
ev.load_for_evaluation = export_then_terminated
sys.exit(load_tool("evaluate").main([sys.argv[1], "--data-dir", sys.argv[2], "--tasks", "piqa",
                                     "--output", sys.argv[3]]))
"""


def test_sigterm_ends_an_evaluation_removing_its_temporary_export(tmp_path):
    """Before: SIGTERM's default action ended the process on the spot, leaving the temporary
    export (as large as the model) in the temp directory; now it is removed, one line says so and
    the exit status is SIGTERM's (143)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(Path(__file__).parents[2]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "hf"), str(EVAL_DATA),
                           str(tmp_path / "results")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 143, done.stderr
    assert done.stderr.splitlines()[-1] == ("error: terminated (SIGTERM): the evaluation stopped, "
                                            "no results written")
    assert not list(temp.glob("megaloop-eval-*"))
    assert not list(tmp_path.glob("results*"))
