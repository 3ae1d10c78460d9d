"""Shared fixtures: one in-process gloo group with megatron-core model-parallel state (TP=1)."""

import atexit
import multiprocessing
import os
import shutil
import signal
import tempfile

import pytest

if "PYTEST_XDIST_WORKER" in os.environ:  # `pytest -n N`: N workers share the cores, one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 - after OMP_NUM_THREADS, which torch reads when it loads

from tests import process_state, tool_scripts

# Fails a test that leaves process-wide state changed (and puts it back): autouse, every test.
process_state_restored = process_state.process_state_restored

# Every test runs in a process no launcher started, whatever started pytest (`srun pytest`, a shell
# that exported RANK and WORLD_SIZE): in-process code takes its rank from these variables, and
# under srun's rank 1 of 2 the first test to set up torch.distributed (the mcore fixture, a
# Trainer) waited 30 minutes for a rank 0.
for key in [key for key in os.environ if process_state.LAUNCH_ENV.fullmatch(key)]:
    del os.environ[key]

# Ctrl-C acts as in a terminal, however pytest was started: a script's background job (`pytest ... &`)
# starts with SIGINT ignored, and Python then leaves it ignored, in pytest and in every child a test
# starts. A preprocess run sent SIGINT by a test then never saw it and hung, in full runs started that way.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Remote-code models loaded by the tests (Hugging Face exports) are copied into transformers' module
# cache, one folder per directory name; keep those copies out of the user's home. Set before any
# test imports transformers, which reads it once.
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="megaloop-test-hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def load_tool():
    """Imports a script under tools/ as a module (tools/ is not a package)."""
    return tool_scripts.load_tool


@pytest.fixture(scope="session")
def mcore():
    """Initialises torch.distributed (world size 1) and megatron-core's parallel groups once."""
    from megaloop.platform.distributed import init_distributed

    init_distributed(seed=1234)
    return True


@pytest.fixture
def seeded(mcore):
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return True


def pytest_sessionfinish(session, exitstatus):
    """Ends the processes the session started (distributed test workers, dist_checkpointing's
    managers) here rather than at exit: pytest-xdist workers leave with os._exit, which skips atexit
    and multiprocessing's finalizers, and would leave those processes orphaned."""
    from tests import distributed

    distributed.close_all()
    for child in multiprocessing.active_children():
        child.terminate()


# Modules whose tests take minutes (multi-rank training, torchrun and signal runs). pytest-xdist
# hands tests out in collection order, and these sit late in it (tests/training): one of them
# dispatched last leaves the other worker idle for its whole length. Started first, the short
# tests fill the end of both workers' queues instead.
LONG_RUNNING = ("tests/training/test_parallel_training.py", "tests/scale/test_loss_compare.py",
                "tests/training/test_preemption.py")


def pytest_collection_modifyitems(config, items):
    missing = [name for name in LONG_RUNNING if not (config.rootpath / name).is_file()]
    if missing:  # renamed: the ordering would quietly stop working
        raise pytest.UsageError(f"tests/conftest.py LONG_RUNNING names no file: {missing}")
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONG_RUNNING)  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # The marker, not item.keywords: keywords also hold the names of parent directories, so a
        # checkout in a directory called "gpu" would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
