"""Lets megatron-core 0.16+ run on a CPU-only machine under the gloo backend.

megatron-core assumes CUDA in a handful of places. Rather than forking those code paths, this module
intercepts them, once per process, and only when CUDA is absent: on a GPU machine ``enable()`` is a
no-op, so the same model and training code runs unchanged on both. Every intercept below says which
megatron-core call site needs it.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_enabled = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to CPU for every torch call.

    Hard-coded ``device="cuda"`` allocations are spread over megatron-core (pipeline schedules' token
    counters and p2p shape tensors, the optimizer's ``torch.tensor(..., device='cuda')`` scalars,
    clip_grads, the grad scaler, dist_checkpointing exchange utils). A function mode catches them all
    at one point instead of patching each module.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The mixed-precision optimizer sorts parameters by comparing type strings against
            # 'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor'.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _cpu_rng_get_state(device=None, **_):
    return torch.get_rng_state()


def _cpu_rng_set_state(state, device=None, **_):
    torch.set_rng_state(state)


def enable() -> bool:
    """Installs the CPU intercepts when CUDA is absent. Idempotent; returns whether they are active."""
    global _enabled
    if torch.cuda.is_available():
        return False
    with _lock:
        if _enabled:
            return True
        # tensor_parallel layers, DDP buffers, RotaryEmbedding and the router allocate on
        # torch.cuda.current_device(); "cpu" is a valid device for all of those allocations.
        torch.cuda.current_device = lambda: "cpu"
        # dist_checkpointing's async preload and the timers synchronize the device.
        torch.cuda.synchronize = lambda *a, **k: None
        # The model-parallel RNG tracker (dropout streams, activation recompute replay) keeps CUDA
        # generator states; on CPU it keeps CPU generator states instead, so forking and
        # recompute-replay semantics stay real rather than being stubbed out.
        torch.cuda.get_rng_state = _cpu_rng_get_state
        torch.cuda.set_rng_state = _cpu_rng_set_state
        # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the generator directly.)
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
        from megatron.core.tensor_parallel import random as tp_random

        tp_random._get_cuda_rng_state = _cpu_rng_get_state
        tp_random._set_cuda_rng_state = _cpu_rng_set_state
        _CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the process
        _enabled = True
        return True


def is_enabled() -> bool:
    return _enabled
