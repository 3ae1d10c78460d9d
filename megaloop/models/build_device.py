"""Where a model is built: on the GPU when there is one (megatron-core's layers made there,
Transformer Engine's modules, the alltoall MoE dispatcher), or wholly on the CPU inside
``built_on_cpu()``, for the CPU jobs of a GPU machine (checkpoint conversions, FLOP counts): built
by the GPU rule, megatron-core would make its layers on the GPU and megaloop's own modules
(norms, LatentLoop's scales, MoE routers) on the CPU, a model split between two devices that no
input runs."""

from __future__ import annotations

import contextlib
import contextvars

import torch

_ON_CPU = contextvars.ContextVar("megaloop_model_built_on_cpu", default=False)


@contextlib.contextmanager
def built_on_cpu():
    """Models built inside are wholly on the CPU, with megatron-core's local modules."""
    token = _ON_CPU.set(True)
    try:
        yield
    finally:
        _ON_CPU.reset(token)


def builds_on_gpu() -> bool:
    return torch.cuda.is_available() and not _ON_CPU.get()
