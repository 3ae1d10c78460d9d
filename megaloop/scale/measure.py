"""Measured memory of a training step on CPU, to check megaloop.scale.memory against.

A CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``; tracemalloc does not see
torch's C++ allocations, and the process RSS mixes in the allocator's caching, imports and the
library code. What the estimate models is the bytes of live tensors, which is what a CUDA caching
allocator reports as "allocated" (up to its 512-byte rounding), so that is measured directly:

- ``StepMemory`` is a TorchDispatchMode that sees every tensor an operator creates, forward,
  backward and optimizer step alike, counts the bytes of each new storage until Python frees it
  (a weak-reference finaliser), and records the peak. Outputs that share a storage with an input
  (views, in-place updates of weights and buffers) are not new memory.
- ``resident_bytes`` sums the storages of the tensors a trainer keeps between steps: weights,
  megatron-core's gradient and parameter buffers and the optimizer's state and main parameters.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(values) -> dict[int, int]:
    """data pointer -> bytes of every tensor storage in ``values`` (any nesting)."""
    found = {}
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            storage = value.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


class StepMemory(TorchDispatchMode):
    """Bytes of tensors created while active and still alive (``live``), and their ``peak``."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _storages((args, kwargs))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                continue
            storage = value.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in inputs or pointer in self._sizes or storage.nbytes() == 0:
                continue
            self._sizes[pointer] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, pointer)
        self.peak = max(self.peak, self.live)
        return out

    def __enter__(self):
        super().__enter__()
        return self

    def _free(self, pointer: int) -> None:
        self.live -= self._sizes.pop(pointer, 0)


def resident_bytes(models: list[torch.nn.Module], ddps: list, optimizer) -> dict[str, int]:
    """Bytes kept between steps: ``weights`` (the parameters of every model chunk), ``grads`` (the
    gradient buffers) and ``optimizer`` (states and main parameters not shared with the model's).

    ``models``: the rank's model chunks (several under the interleaved schedule); ``ddps``: their
    megatron-core DistributedDataParallel wrappers (dense and expert-parallel buffers are counted);
    ``optimizer``: the Megatron optimizer (chained or not)."""
    weights = _storages([list(model.parameters()) for model in models])
    grads = _storages([b.grad_data for ddp in ddps for b in (*ddp.buffers, *ddp.expert_parallel_buffers)])
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    state = _storages([[list(o.state.values()), [g["params"] for g in o.param_groups]]
                       for o in inner])
    for pointer in list(state):
        if pointer in weights or pointer in grads:
            del state[pointer]
    return {"weights": sum(weights.values()), "grads": sum(grads.values()),
            "optimizer": sum(state.values())}
