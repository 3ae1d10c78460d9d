"""Random number generator state of training: what a checkpoint saves and a resume puts back
(torch's CPU and CUDA generators, megatron-core's tensor-parallel RNG tracker), and a context that
leaves every generator as it found it (a downstream evaluation, whose harness seeds them)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def rng_state() -> dict:
    """Every RNG a training step may draw from (plain types, loadable with weights_only)."""
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@contextlib.contextmanager
def preserved_rng():
    """Puts back Python's, NumPy's, torch's and megatron-core's random states on exit (lm-eval
    seeds the global generators)."""
    states = (random.getstate(), np.random.get_state(), rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        set_rng_state(states[2])
