"""RMSNorm for megatron-core's local (CPU) spec that supports sequence parallelism.

megatron-core's local norm (``WrappedTorchNorm``) refuses ``sequence_parallel``; its Transformer
Engine and apex norms accept it. Under sequence parallelism each tensor-parallel rank normalises its
own slice of the sequence, so the weight gradient on a rank is a partial sum over that slice.
megatron-core's ``finalize_model_grads`` sums the gradients of every parameter flagged
``sequence_parallel`` over the tensor-parallel group; the Transformer Engine and apex norms set that
flag from the config, and so does this one. Without sequence parallelism the flag is False and every
rank already holds the full gradient.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way megatron-core builds a norm (``config``, ``hidden_size``,
    ``eps``); state-dict keys are those of megatron-core's local norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_backend_options):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
