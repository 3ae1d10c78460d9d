"""Greedy decoding of megaloop models (one process).

    model = megaloop.api.load("runs/gsm8k/checkpoints")
    backend = Cached(to_reference(model), num_iterations=6)    # or FullForward(model, 6)
    out = greedy_generate(backend, prompt_ids, max_new_tokens=512, eos_id=tokenizer.eod,
                          vocab_size=tokenizer.vocab_size)

Decoding asks a *backend* for the logits of the next token: ``prefill(prompt)`` once, then
``extend(token)`` per generated token. ``FullForward`` runs the whole sequence through the canonical
model at every step (no KV cache): each step costs a full forward over the tokens so far, but its
logits are by construction those of the model's training forward, which makes it the reference the
cached backend must reproduce (the tests hold the two to equal tokens). ``Cached`` decodes with
megaloop's reference model (megaloop.models.export.to_reference; the Hugging Face model) and its
``LoopedCache``: Local KV per iteration and layer, Global KV per decoder layer, so each new token
costs one token's forward. Prompts are decoded one at a time, without padding.

A decoding stays within the context the model was trained on (``model.seq_length``, a backend's
``context``): ``greedy_generate`` refuses a prompt and ``max_new_tokens`` that together run past it,
since positions beyond it were never trained and the tokens there are extrapolation, which a user
choosing a token budget should not get without a word (megaloop.gsm8k caps each question's budget
at the context and says so, as megaloop.hf.evaluate counts and reports the lm-eval requests cut to
it). The model's own forward (``megaloop.api``'s model call) takes longer
sequences and is left to: its positions are RoPE, computed for any length, with no learned
position table to run out of, so the numbers past the context are well defined, if untrained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


def _refuse_empty(prompt: Sequence[int]) -> None:
    if not prompt:
        raise ValueError("an empty prompt gives the model nothing to continue")


class DecodeBackend(Protocol):
    context: int  # the longest sequence (prompt and generated tokens) to decode: model.seq_length

    def prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        """Starts a sequence; returns the logits [V] for the token after ``prompt``."""

    def extend(self, token: int) -> torch.Tensor:
        """Appends ``token``; returns the logits [V] for the token after it."""


class FullForward:
    """Uncached backend: the full forward of the model on the sequence so far, at every step.
    ``num_iterations``: test-time depth (None: the model's configured K or R)."""

    def __init__(self, model: torch.nn.Module, num_iterations: int | None = None):
        self.model, self.num_iterations = model, num_iterations
        self.context = model.cfg.seq_length
        self.device = next(model.parameters()).device
        self.tokens: list[int] = []

    def _logits(self) -> torch.Tensor:
        ids = torch.tensor([self.tokens], dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.model(ids, num_iterations=self.num_iterations)[0, -1].float()

    def prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        _refuse_empty(prompt)
        self.tokens = [int(t) for t in prompt]
        return self._logits()

    def extend(self, token: int) -> torch.Tensor:
        self.tokens.append(int(token))
        return self._logits()


class Cached:
    """Cached backend: a reference model (megaloop.reference, e.g. ``to_reference(model)``) with
    its ``LoopedCache``. ``num_iterations``: test-time depth (None: the model's configured one)."""

    def __init__(self, reference: torch.nn.Module, num_iterations: int | None = None):
        self.model, self.num_iterations = reference.eval(), num_iterations
        self.context = reference.config.max_position_embeddings  # megaloop's seq_length
        self.device = next(reference.parameters()).device
        self.cache = None

    def _logits(self, ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model(ids, cache=self.cache, num_iterations=self.num_iterations,
                             logits_to_keep=1)
        return out.logits[0, -1].float()

    def prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        _refuse_empty(prompt)
        self.cache = self.model.new_cache(self.num_iterations)
        return self._logits([int(t) for t in prompt])

    def extend(self, token: int) -> torch.Tensor:
        return self._logits([int(token)])


@dataclass
class Generation:
    tokens: list[int]  # the generated tokens, without the EOS that ended them
    stopped_at_eos: bool  # False: max_new_tokens ran out first


def greedy_generate(backend: DecodeBackend, prompt: Sequence[int], max_new_tokens: int,
                    eos_id: int | None, vocab_size: int | None = None) -> Generation:
    """Argmax decoding until ``eos_id`` or ``max_new_tokens`` tokens. ``vocab_size``: the
    tokenizer's; the embedding's padding rows above it are never chosen (they decode to
    nothing). Ties go to the lowest id, so decoding is deterministic. A prompt and
    ``max_new_tokens`` longer together than ``backend.context`` are a ValueError (see above)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    _refuse_empty(prompt)  # before the max_new_tokens=0 shortcut, which never reaches prefill
    if len(prompt) + max_new_tokens > backend.context:
        raise ValueError(f"a prompt of {len(prompt)} tokens and max_new_tokens={max_new_tokens} "
                         f"run past the model's {backend.context}-token context (model.seq_length, "
                         "the length it was trained on); generate at most "
                         f"{max(backend.context - len(prompt), 0)} tokens")
    generated: list[int] = []
    if max_new_tokens == 0:
        return Generation(generated, False)
    logits = backend.prefill(prompt)
    while True:
        token = int(torch.argmax(logits[:vocab_size]))
        if token == eos_id:
            return Generation(generated, True)
        generated.append(token)
        if len(generated) == max_new_tokens:
            return Generation(generated, False)
        logits = backend.extend(token)
