"""A small learnable indexed dataset and tiny run configs for the training tests."""

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from megaloop.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig

VOCAB, EOD = 128, 0


def write_pattern_dataset(prefix: Path, documents: int = 400, seed: int = 0,
                          modulus: int = 120) -> str:
    """Arithmetic progressions mod ``modulus`` (ids 1..modulus, EOD 0): structure a model learns
    in steps."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        start, stride, length = (rng.integers(0, modulus), rng.integers(1, 4),
                                 rng.integers(20, 60))
        doc = (start + stride * np.arange(length)) % modulus + 1
        builder.add_item(torch.from_numpy(np.append(doc, EOD).astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="session")
def pattern_data(tmp_path_factory) -> str:
    return write_pattern_dataset(tmp_path_factory.mktemp("data") / "pattern")


def tiny_run(data_prefix: str, out_dir: Path, *, model=None, train=None, checkpoint=None,
             parallel=None) -> RunConfig:
    model_cfg = ModelConfig(arch="asymloop", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                            num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                            seq_length=32, iterations=2)
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4, train_steps=8, lr=3e-3,
                            out_dir=str(out_dir), log_interval=100, eval_iters=2,
                            tensorboard=False)
    cfg = RunConfig(
        model=dataclasses.replace(model_cfg, **(model or {})),
        train=dataclasses.replace(train_cfg, **(train or {})),
        data=DataConfig(path=[data_prefix], split="90,10,0", eod_id=EOD,
                        cache_dir=str(out_dir / "cache")),
        checkpoint=dataclasses.replace(CheckpointConfig(), **(checkpoint or {})),
    )
    if parallel:
        cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    return cfg


def resume_from(source_run: Path, run: Path, step: int) -> None:
    """Gives ``run`` (a run directory) the checkpoint of ``step`` from ``source_run`` as its
    latest, so that a run there resumes from it, as after a stop just after that save."""
    name = f"iter_{step:07d}"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(source_run / "checkpoints" / name, run / "checkpoints" / name)
    (run / "checkpoints" / "latest").write_text(name + "\n")


def train_losses(out_dir: Path) -> dict[int, float]:
    import json

    losses = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            losses[record["step"]] = record["loss"]
    return losses


def one_line(error) -> str:
    """The message of a ``pytest.raises`` result, asserted to be one line without a traceback."""
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def unlink_refused(monkeypatch, name: str) -> None:
    """Files called ``name`` will not go (a busy NFS file, a read-only directory)."""
    import errno

    unlink = os.unlink

    def refusing(path, *args, **kwargs):
        if os.path.basename(path) == name:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refusing)
