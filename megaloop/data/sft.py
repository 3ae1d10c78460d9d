"""Supervised fine-tuning data: prompt/solution records -> padded samples with the loss on the solution.

A record (a .jsonl line or a .parquet row) becomes a prompt and a solution through two format
strings over its fields (``data.sft_prompt``, ``data.sft_solution``; for GSM8K
``"Question: {question}\\nAnswer:"`` and ``"{answer}"``). Each is tokenized on its own and the two
are concatenated, followed by the tokenizer's EOD: the prompt tokens are then exactly what
``encode(prompt)`` gives at generation time, and the model learns to stop after a solution.

One record is one sample, right-padded to ``seq_length`` (padding, not packing: a sample never
attends to another record, as in the AsymLoop paper's GSM8K protocol). The loss mask is 1 where the
label is a solution token or the closing EOD and 0 on prompt and padding positions; padding
repeats EOD, and since attention is causal it changes nothing before it. A record longer than
``seq_length + 1`` tokens (prompt, solution and EOD) is dropped and counted in a warning: cut
short, its solution would lose the final answer.

Samples are the dicts megatron-core's GPTDataset yields (``tokens, labels, loss_mask,
position_ids``), so training runs through the same trainer, loss and checkpoints as pre-training,
plus a ``padding_mask`` that keeps padding out of MoE routing (pre-training has no padding).
Splits take ``data.split`` proportions of the records in file order (files sorted by path),
rounded as megatron-core rounds; within a split each epoch is a permutation seeded by
(seed, split, epoch), so sample i depends on the seed and i alone and a resumed run reads the
samples an uninterrupted one would.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy
import torch

from megaloop.config import template_fields
from megaloop.data.datasets import SPLIT_NAMES, parse_blend, split_weights
from megaloop.data.readers import DataError, RecordFilter, expand_inputs, input_kind, iter_chunks, \
    parse_chunk

log = logging.getLogger("megaloop.data")


def read_records(paths: str | Sequence[str], fields: Sequence[str]) -> list[dict[str, str]]:
    """The ``fields`` of every record of .jsonl/.parquet ``paths``, in order; the first record
    that lacks one (or is not JSON, or holds a non-string or empty value) is a DataError naming
    its ``file:line``, so that no example is lost silently."""
    files = expand_inputs(paths)
    for path in files:
        if input_kind(path) == "text":
            raise DataError(f"{path}: plain text has no fields; prompt/solution records come as "
                            ".jsonl or .parquet")
    record_filter = RecordFilter(keys=tuple(fields), plain_texts=True)
    records: list[dict[str, str]] = []
    for chunk in iter_chunks([(path, 0, None) for path in files], record_filter.columns()):
        parsed = parse_chunk(chunk, record_filter)
        if parsed.bad.total:
            raise DataError(f"{parsed.bad.examples[0]}; every record needs the fields "
                            f"{', '.join(fields)}")
        records.extend(dict(zip(fields, texts)) for texts in parsed.docs)
    if not records:
        raise DataError(f"{', '.join(files)}: no records")
    return records


def encode_examples(records: list[dict[str, str]], tokenizer, prompt: str,
                    solution: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, solution ids + EOD) per record."""
    if tokenizer.eod is None:
        raise DataError(f"{tokenizer.path}: the tokenizer has no end-of-text token to close "
                        "solutions with")
    prompts = tokenizer.encode_batch([prompt.format_map(r) for r in records])
    solutions = tokenizer.encode_batch([solution.format_map(r) for r in records])
    return [(list(p), list(s) + [tokenizer.eod]) for p, s in zip(prompts, solutions)]


def sft_sample(prompt: Sequence[int], solution: Sequence[int], seq_length: int,
               pad_id: int) -> dict[str, torch.Tensor]:
    """One padded sample; ``solution`` ends with EOD. Position i predicts token i + 1, so the
    mask covers the positions from the last prompt token to the one before the final EOD.
    ``padding_mask`` is True from the final EOD on: the record alone is the sample of
    ``len(ids) - 1`` positions, the final EOD a label only; MoE routing leaves the rest out."""
    ids = list(prompt) + list(solution)
    if len(ids) > seq_length + 1:
        raise ValueError(f"{len(ids)} tokens do not fit seq_length={seq_length} + 1")
    sequence = torch.full((seq_length + 1,), pad_id, dtype=torch.long)
    sequence[:len(ids)] = torch.tensor(ids, dtype=torch.long)
    loss_mask = torch.zeros(seq_length, dtype=torch.float)
    loss_mask[max(len(prompt) - 1, 0):len(ids) - 1] = 1.0
    padding_mask = torch.arange(seq_length) >= len(ids) - 1
    return {"tokens": sequence[:-1], "labels": sequence[1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(seq_length, dtype=torch.long),
            "padding_mask": padding_mask}


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn epoch by epoch from ``examples`` (prompt ids, solution ids
    ending in EOD), each epoch in its own seeded order."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], seq_length: int,
                 pad_id: int, num_samples: int, seed: int, split: int):
        if not examples:
            raise ValueError("an SFT dataset needs at least one example")
        self.examples, self.seq_length, self.pad_id = examples, seq_length, pad_id
        self.num_samples, self.seed, self.split = num_samples, seed, split
        self._epoch, self._order = -1, None

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int) -> numpy.ndarray:
        """The example indices of ``epoch`` in sample order."""
        if epoch != self._epoch:
            rng = numpy.random.default_rng([self.seed, self.split, epoch])
            self._epoch, self._order = epoch, rng.permutation(len(self.examples))
        return self._order

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        epoch, offset = divmod(index, len(self.examples))
        prompt, solution = self.examples[self.order(epoch)[offset]]
        return sft_sample(prompt, solution, self.seq_length, self.pad_id)


def split_edges(weights: Sequence[float]) -> list[float]:
    """Where the splits of ``weights`` begin and end, as shares of the records (0.0, ..., 1.0):
    cumulative proportions, in the floats ``split_bounds`` cuts by."""
    total, edges, running = sum(weights), [0.0], 0.0
    for weight in weights:
        running += weight
        edges.append(running / total)
    return edges


def split_bounds(weights: Sequence[float], count: int) -> list[tuple[int, int]]:
    """[begin, end) record ranges of the train, valid and test splits: cumulative proportions
    times ``count``, rounded (megatron-core's BlendedMegatronDatasetBuilder rounds the same way)."""
    edges = split_edges(weights)
    return [(int(round(edges[i] * count)), int(round(edges[i + 1] * count)))
            for i in range(len(weights))]


def build_sft_datasets(paths: Sequence[str], tokenizer, seq_length: int,
                       num_samples: Sequence[int], *, split: str, seed: int, prompt: str,
                       solution: str) -> list[SFTDataset | None]:
    """``[train, valid, test]`` datasets of ``num_samples`` samples each (None for a split
    without records or without samples wanted); raises DataError on bad records, or when no
    record of a split that is drawn from fits ``seq_length``."""
    if parse_blend(paths)[1] is not None:
        raise DataError(f"data.path={list(paths)!r}: blend weights are not taken by "
                        "data.format=sft; give a list of .jsonl/.parquet files, used whole")
    fields = tuple(dict.fromkeys(template_fields(prompt) + template_fields(solution)))
    examples = encode_examples(read_records(paths, fields), tokenizer, prompt, solution)
    weights = split_weights(split)
    datasets: list[SFTDataset | None] = []
    for index, (begin, end) in enumerate(split_bounds(weights, len(examples))):
        part = examples[begin:end]
        fitting = [e for e in part if len(e[0]) + len(e[1]) <= seq_length + 1]
        if len(fitting) < len(part):
            longest = max(len(p) + len(s) for p, s in part)
            log.warning("data.format=sft: %d of the %d %s records are longer than "
                        "model.seq_length=%d + 1 tokens (prompt, solution and EOD; the longest "
                        "has %d) and are left out", len(part) - len(fitting), len(part),
                        SPLIT_NAMES[index], seq_length, longest)
        if num_samples[index] and not part and weights[index] > 0:
            # Drawn from and weighted, but rounded to no record: the run would go without it
            # (no validation loss) and say nothing; megatron-core refuses such indexed splits.
            raise DataError(f"{', '.join(map(str, paths))}: data.split={split!r} gives the "
                            f"{SPLIT_NAMES[index]} split none of the {len(examples)} records; "
                            f"give more records, or a split with a larger {SPLIT_NAMES[index]} "
                            "share")
        if not num_samples[index] or not part:
            datasets.append(None)
            continue
        if not fitting:
            raise DataError(f"{', '.join(map(str, paths))}: none of the {len(part)} records of "
                            f"the {SPLIT_NAMES[index]} split fits model.seq_length={seq_length}"
                            f" (the shortest has {min(len(p) + len(s) for p, s in part)} tokens)")
        datasets.append(SFTDataset(fitting, seq_length, tokenizer.eod, num_samples[index], seed,
                                   index))
    return datasets

