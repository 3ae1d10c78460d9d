"""One-call model construction for notebooks and quick checks (single process, CPU or one GPU).

    import megaloop.api as ml
    model = ml.build("tiny", arch="asymloop", iterations=3)
    logits = model(tokens)                       # [B, N, V]
    losses = model(tokens, labels=labels)        # per-token cross-entropy [B, N]
    deeper = model(tokens, num_iterations=6)     # test-time depth
"""

from __future__ import annotations

import torch


def build(preset_name: str = "tiny", *, seed: int = 1234, **overrides):
    """Builds preset ``preset_name`` with ``ModelConfig`` field overrides in this process.

    Sets up a one-process group (gloo on CPU) and megatron-core's parallel state unless a process
    group already exists, in which case the caller's setup is used as it is.
    """
    from megatron.core import parallel_state

    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed
    from megaloop.presets import preset

    cfg = preset(preset_name, **overrides)
    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        init_distributed(seed=seed)
    # Reseeded on every call: the same seed gives the same weights however often build() is called.
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_model(cfg)
