"""Training and validation batches from megatron-core GPT datasets.

Sample order is a function of the dataset seed and of ``consumed_samples`` only, so a resumed run
reads exactly the batches an uninterrupted run would, and the global batch is the same set of samples
whatever the data-parallel size: step s uses samples [s*G, (s+1)*G), and micro-batch m of data-
parallel rank r takes the ``micro_batch_size`` samples at s*G + (m*dp + r)*micro_batch_size.
"""

from __future__ import annotations

import torch

from megaloop.config import ConfigError, RunConfig
from megaloop.data import DatasetTokenizer, build_gpt_datasets, load_tokenizer


def dataset_tokenizer(cfg: RunConfig) -> DatasetTokenizer:
    data, model = cfg.data, cfg.model
    if data.tokenizer_model is not None:
        tokenizer = DatasetTokenizer.from_text_tokenizer(
            load_tokenizer(data.tokenizer_type, data.tokenizer_model))
    else:
        tokenizer = DatasetTokenizer(model.vocab_size, data.eod_id, name=f"eod{data.eod_id}")
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size}: smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} tokens ({data.tokenizer_model})")
    return tokenizer


def build_datasets(cfg: RunConfig):
    """(train, valid) megatron-core datasets sized for the whole run; raises DataError on bad files."""
    samples = (cfg.train.train_steps * cfg.train.global_batch_size,
               cfg.train.eval_iters * cfg.train.global_batch_size, 0)
    train, valid, _ = build_gpt_datasets(
        cfg.data.path, dataset_tokenizer(cfg), cfg.model.seq_length, samples,
        split=cfg.data.split, seed=cfg.train.seed, cache_dir=cfg.data.cache_dir,
        eod_mask_loss=cfg.data.eod_mask_loss,
    )
    if train is None:
        raise ConfigError(f"data.split={cfg.data.split!r}: gives the training split no data")
    return train, valid


class MicroBatches:
    """Iterator over this rank's micro-batches, starting at ``consumed_samples``."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int, global_batch_size: int):
        self.dataset, self.mbs = dataset, micro_batch_size
        self.dp_rank, self.dp_size, self.gbs = dp_rank, dp_size, global_batch_size
        self.per_step = global_batch_size // (micro_batch_size * dp_size)
        self.consumed, self.micro = consumed_samples, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = self.consumed + (self.micro * self.dp_size + self.dp_rank) * self.mbs
        if start + self.mbs > len(self.dataset):
            raise StopIteration
        samples = [self.dataset[i] for i in range(start, start + self.mbs)]
        self.micro += 1
        if self.micro == self.per_step:  # a global batch is done
            self.consumed, self.micro = self.consumed + self.gbs, 0
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                for key in ("tokens", "labels", "loss_mask", "position_ids")}
