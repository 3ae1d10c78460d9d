"""The one recurrence primitive: apply a weight-tied block K times.

Training, evaluation (test-time depth), generation and export all loop through ``run_segments``
(``iterate`` for whole iterations), so the semantics of "K iterations" are defined in exactly one
place. A pipeline stage runs a piece of the unrolled loop: segments that may start or end inside
an iteration (megaloop.models.pipeline), continuing from the state the previous stage sent.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Segment:
    """Some consecutive layers of iteration ``step`` (1-based), as a callable block;
    ``starts_step``: it begins with the iteration's first layer."""

    block: Callable[..., torch.Tensor]
    step: int
    starts_step: bool = True


def run_segments(segments: list[Segment], encoded: torch.Tensor | None,
                 state: torch.Tensor | None = None, *, additive: bool = False,
                 step_context: Callable[[int], contextlib.AbstractContextManager] | None = None,
                 **block_kwargs) -> torch.Tensor:
    """Runs ``segments`` in order on the decoder state and returns the state after them.

    The state starts as ``state`` (what an earlier pipeline stage computed), or when None as z_0:
    - ``additive=False``: z_0 = encoded, and z_t = Dec(z_{t-1}) (AsymLoop, Full Loop, Dense);
    - ``additive=True``: z_0 = 0, and every iteration re-injects the encoding as it starts,
      z_t = Dec(z_{t-1} + encoded) (the "additive injection" ablation).
    ``block_kwargs`` (rotary embeddings, Global KV context) are identical for every segment;
    ``step_context(t)``, if given, is entered around each segment of iteration t (it labels
    per-iteration statistics, e.g. MoE routing).
    """
    if state is None:
        state = torch.zeros_like(encoded) if additive else encoded
    for segment in segments:
        with step_context(segment.step) if step_context is not None else contextlib.nullcontext():
            inputs = state + encoded if additive and segment.starts_step else state
            state = segment.block(inputs, **block_kwargs)
    return state


def iterate(block, encoded: torch.Tensor, steps: int, *, additive: bool = False,
            step_context: Callable[[int], contextlib.AbstractContextManager] | None = None,
            **block_kwargs) -> torch.Tensor:
    """Returns z_K for z_t = block(z_{t-1}), t = 1..steps: ``run_segments`` over whole
    iterations of ``block``."""
    return run_segments([Segment(block, t) for t in range(1, steps + 1)], encoded,
                        additive=additive, step_context=step_context, **block_kwargs)
