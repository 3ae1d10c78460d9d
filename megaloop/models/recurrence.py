"""The one recurrence primitive: apply a weight-tied block K times.

Training, evaluation (test-time depth), generation and export all loop through ``iterate``, so the
semantics of "K iterations" are defined in exactly one place.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def iterate(block, encoded: torch.Tensor, steps: int, *, additive: bool = False,
            step_context: Callable[[int], contextlib.AbstractContextManager] | None = None,
            **block_kwargs) -> torch.Tensor:
    """Returns z_K for z_t = block(z_{t-1}), t = 1..steps.

    - ``additive=False``: z_0 = encoded (AsymLoop, Full Loop, Dense with steps = 1).
    - ``additive=True``: z_0 = 0 and every step re-injects the encoding, z_t = block(z_{t-1} + encoded)
      (the "additive injection" ablation).
    ``block_kwargs`` (rotary embeddings, Global KV context) are identical for every step;
    ``step_context(t)``, if given, is entered around step t = 1..steps (it labels per-iteration
    statistics, e.g. MoE routing).
    """
    state = torch.zeros_like(encoded) if additive else encoded
    for t in range(1, steps + 1):
        with step_context(t) if step_context is not None else contextlib.nullcontext():
            state = block(state + encoded if additive else state, **block_kwargs)
    return state
