"""Multi-hop variable binding: the quickstart's generated task and its answer-accuracy scorer.

A program binds names to digits or to names already bound, in two interleaved chains, and ends
with a query on the last name of one chain:

    d=4;a=7;g=d;c=a;e=g;?e=4

Answering ``?e`` takes three lookups, e -> g -> d -> 4 (three *hops*), past the other chain
(``a=7;c=a``, the distractor), whose value is the only other digit in the program. A model that
learned the syntax but not the pointer chasing picks one of the program's values: 50% accuracy.
Answers are deterministic given the program, so a model that learned the task reaches 100%.

Every binding ``x=y;`` and every query ``?x=`` is one token: the quickstart trains its tokenizer
with them as user-defined pieces. A hop is then one attention lookup (the query's name against the
bindings' names). Spelled out in separate tokens (``x``, ``=``, ``y``), each lookup first needs an
induction-style circuit (the value's position learning which name precedes it): in trials of up to
2000 CPU steps with that spelling, even one-hop lookups stayed near chance.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from megaloop.platform.files import write_text_atomic

NAMES = "abcdefgh"
DIGITS = "0123456789"


@dataclass(frozen=True)
class Program:
    bindings: tuple[tuple[str, str], ...]  # (name, digit or earlier name), in program order
    query: str

    @property
    def prompt(self) -> str:
        return "".join(f"{name}={value};" for name, value in self.bindings) + f"?{self.query}="

    @property
    def answer(self) -> str:
        return follow(self.bindings, self.query)[0]

    @property
    def hops(self) -> int:
        return follow(self.bindings, self.query)[1]

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def follow(bindings: Sequence[tuple[str, str]], name: str) -> tuple[str, int]:
    """(digit, hops): the value ``name`` resolves to and the number of bindings read on the way."""
    table = dict(bindings)
    hops = 0
    while not name.isdigit():
        if name not in table:
            program = "".join(f"{n}={v};" for n, v in bindings)
            raise ValueError(f"{name!r} is not bound in {program}")
        if hops > len(table):
            raise ValueError(f"{name!r}: the bindings form a cycle")
        name, hops = table[name], hops + 1
    return name, hops


def task_pieces() -> list[str]:
    """The user-defined tokenizer pieces: every binding ``x=y;`` and every query ``?x=``."""
    bindings = [f"{x}={y};" for x in NAMES for y in NAMES + DIGITS if x != y]
    return bindings + [f"?{x}=" for x in NAMES]


def make_program(rng: random.Random, hops: int, distractor_hops: int) -> Program:
    """Two chains of ``hops`` and ``distractor_hops`` bindings with distinct names and distinct
    digits, interleaved at random (each chain keeps its order, so every name is bound before it
    is read); the query asks for the last name of the first chain."""
    if hops < 1 or distractor_hops < 1 or hops + distractor_hops > len(NAMES):
        raise ValueError(f"hops={hops}, distractor_hops={distractor_hops}: each must be >= 1 and "
                         f"together <= {len(NAMES)} (the names available)")
    names = iter(rng.sample(NAMES, hops + distractor_hops))
    chains = []
    for length, digit in zip((hops, distractor_hops), rng.sample(DIGITS, 2)):
        chain, previous = [], digit
        for _ in range(length):
            name = next(names)
            chain.append((name, previous))
            previous = name
        chains.append(chain)
    order = [0] * hops + [1] * distractor_hops
    rng.shuffle(order)
    cursors = [0, 0]
    bindings = []
    for c in order:
        bindings.append(chains[c][cursors[c]])
        cursors[c] += 1
    return Program(tuple(bindings), query=chains[0][-1][0])


def training_programs(rng: random.Random, count: int, max_hops: int) -> list[Program]:
    """``count`` programs whose query and distractor chains each have 1..``max_hops`` bindings,
    uniformly."""
    return [make_program(rng, rng.randint(1, max_hops), rng.randint(1, max_hops))
            for _ in range(count)]


def program_count(hops: int, max_distractor_hops: int) -> int:
    """How many distinct programs ``make_program`` can write with ``hops`` hops and a distractor
    chain of 1..``max_distractor_hops`` bindings: the names in order, the two digits, and the
    interleaving of the chains each change the prompt."""
    return sum(math.perm(len(NAMES), hops + d) * math.perm(len(DIGITS), 2) * math.comb(hops + d, d)
               for d in range(1, max_distractor_hops + 1) if hops + d <= len(NAMES))


def held_out_programs(seed: int, hops: Sequence[int], per_hop: int, max_distractor_hops: int,
                      exclude: set[str]) -> list[Program]:
    """``per_hop`` programs for every hop count in ``hops`` (distractors of 1..
    ``max_distractor_hops`` bindings), none of whose prompts is in ``exclude`` (the training
    corpus's), so that accuracy measures the lookup, not recall of a seen program."""
    rng = random.Random(seed)
    programs, exclude = [], set(exclude)
    for h in hops:
        found, tries = 0, 0
        while found < per_hop:
            tries += 1
            if tries > 100 * per_hop:
                raise ValueError(f"hops={h}: fewer than {per_hop} programs unseen in training")
            program = make_program(rng, h, rng.randint(1, max_distractor_hops))
            if program.prompt not in exclude:
                programs.append(program)
                exclude.add(program.prompt)
                found += 1
    return programs


def write_corpus(path: Path, documents: int, max_hops: int, seed: int = 0) -> set[str]:
    """JSONL of ``documents`` documents of 4-8 training programs each, one per line, written
    atomically; returns the programs' prompts."""
    rng = random.Random(seed)
    prompts, lines = set(), []
    for i in range(documents):
        programs = training_programs(rng, rng.randint(4, 8), max_hops)
        prompts.update(p.prompt for p in programs)
        lines.append(json.dumps({"id": i, "text": "\n".join(p.text for p in programs)}) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(lines))  # a Ctrl-C leaves neither a half file nor a temporary
    return prompts


@dataclass(frozen=True)
class Encoded:
    """A held-out program as the model sees it: prompt ids, then the answer's ids."""
    prompt: list[int]
    answer: list[int]
    hops: int


def encode_programs(tokenizer, programs: Sequence[Program]) -> list[Encoded]:
    """Token ids of each prompt and of the answer that follows it in the program's text (the
    ids of ``text`` past those of ``prompt``; the answer may take more than one token)."""
    prompts = tokenizer.encode_batch([p.prompt for p in programs])
    texts = tokenizer.encode_batch([p.text for p in programs])
    encoded = []
    for program, prompt, text in zip(programs, prompts, texts):
        if list(text[:len(prompt)]) != list(prompt) or len(text) == len(prompt):
            raise ValueError(f"{program.text!r}: the tokenizer does not split it after the query "
                             f"{program.prompt!r}")
        encoded.append(Encoded(list(prompt), list(text[len(prompt):]), program.hops))
    return encoded


def answers_correct(logits: torch.Tensor, examples: Sequence[Encoded],
                    vocab_size: int | None = None) -> list[bool]:
    """Exact match of every answer token against the argmax of the logits [B, N, V] of the
    right-padded sequences ``prompt + answer``: position ``len(prompt) - 1 + i`` predicts answer
    token i. Teacher-forced, this is what greedy decoding produces, since greedy decoding sees the
    gold tokens for as long as it is right. ``vocab_size``: the tokenizer's; padding rows of the
    embedding above it are never predicted."""
    predicted = logits[..., :vocab_size].argmax(-1)
    correct = []
    for row, example in enumerate(examples):
        start = len(example.prompt) - 1
        guess = predicted[row, start:start + len(example.answer)]
        correct.append(guess.tolist() == example.answer)
    return correct


def score(model: torch.nn.Module, examples: Sequence[Encoded], *, num_iterations: int | None,
          vocab_size: int, pad_id: int, batch_size: int = 256) -> list[bool]:
    """``answers_correct`` for each example under the model at test-time depth
    ``num_iterations``; the attention is causal, so right padding changes nothing before it."""
    correct = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for begin in range(0, len(examples), batch_size):
            chunk = examples[begin:begin + batch_size]
            length = max(len(e.prompt) + len(e.answer) for e in chunk)
            ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
            for row, e in enumerate(chunk):
                ids[row, :len(e.prompt) + len(e.answer)] = torch.tensor(e.prompt + e.answer)
            logits = model(ids.to(device), num_iterations=num_iterations)
            correct += answers_correct(logits, chunk, vocab_size)
    return correct


def accuracy_by_hops(examples: Sequence[Encoded], correct: Sequence[bool]) -> dict[int, float]:
    totals: dict[int, list[int]] = {}
    for example, ok in zip(examples, correct):
        totals.setdefault(example.hops, []).append(int(ok))
    return {h: sum(v) / len(v) for h, v in sorted(totals.items())}
