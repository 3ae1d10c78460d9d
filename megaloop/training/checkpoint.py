"""Distributed checkpoints (megatron-core dist_checkpointing) with an atomic "latest" pointer.

Layout of ``<dir>``::

    iter_0000100/          a complete checkpoint (dist_checkpointing files + config.yaml)
    iter_0000200.tmp/      a save in progress, or one killed mid-way: never loaded, removed later
    latest                 text file naming the newest complete checkpoint, replaced atomically

A save writes into ``iter_N.tmp``, and only when every rank has finished does rank 0 rename it to
``iter_N`` and then repoint ``latest``. A ``kill -9`` at any moment therefore leaves ``latest`` on
the previous complete checkpoint. Checkpoints beyond ``keep_last`` are deleted after the pointer
moves. The state dicts hold only plain types and tensors, so megatron-core's ``torch.load``
(``weights_only=True`` by default in torch >= 2.6) reads them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from megaloop.config import ConfigError, RunConfig, save_yaml

LATEST = "latest"
_NAME = re.compile(r"^iter_(\d{7})$")
# Model fields that decide parameter shapes or what the weights mean; anything else (iterations,
# joint_attention kernel, sequence length) may change between a save and a resume.
ARCHITECTURE_FIELDS = ("arch", "num_layers", "hidden_size", "ffn_hidden_size",
                       "num_attention_heads", "num_query_groups", "vocab_size", "encoder_layers",
                       "block", "qk_norm", "injection", "local_kv", "global_kv_norm",
                       "decoder_ffn_hidden_size", "tie_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the path."""


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none yet."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = directory / name
    if not _NAME.match(name) or not (path / "config.yaml").is_file():
        raise CheckpointError(f"{pointer}: names {name!r}, which is not a complete checkpoint "
                              f"directory in {directory}")
    return path


def step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    if match is None:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected iter_NNNNNNN)")
    return int(match.group(1))


def saved_config(path: Path) -> dict:
    """The run config stored with a checkpoint, as a plain dict."""
    config_file = path / "config.yaml"
    try:
        saved = yaml.safe_load(config_file.read_text())
        if not isinstance(saved.get("model"), dict) or not isinstance(saved.get("parallel"), dict):
            raise KeyError("model/parallel sections")
        return saved
    except (OSError, yaml.YAMLError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: unreadable checkpoint config ({e})") from None


def same_parallel_layout(saved: dict, cfg: RunConfig) -> bool:
    """Whether a checkpoint's ``saved_config`` has this run's tensor/pipeline layout."""
    saved = saved["parallel"]
    return (saved.get("tensor"), saved.get("pipeline")) == (cfg.parallel.tensor,
                                                           cfg.parallel.pipeline)


def check_compatible(path: Path, cfg: RunConfig) -> None:
    """Refuses, in one line, to resume a checkpoint of a different architecture."""
    saved = saved_config(path)["model"]
    current = dict(vars(cfg.model.resolve()))
    differences = [f"model.{k}={saved.get(k)!r} in the checkpoint, {current[k]!r} now"
                   for k in ARCHITECTURE_FIELDS if saved.get(k) != current[k]]
    if differences:
        raise CheckpointError(f"{path} was saved by a different architecture: "
                              + "; ".join(differences))


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict, cfg: RunConfig,
                    keep_last: int) -> Path:
    """Collective: every rank calls it with its sharded state dict."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    final = directory / checkpoint_name(step)
    tmp = directory / (checkpoint_name(step) + ".tmp")
    if _is_rank0():
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("iter_*.tmp"):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            if latest_checkpoint(directory) == final:
                raise CheckpointError(f"{final}: already the latest checkpoint; refusing to "
                                      "overwrite it in place")
            shutil.rmtree(final)  # an older run's, not pointed to: safe to replace
        tmp.mkdir()
    _barrier()
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _is_rank0():
        save_yaml(cfg, tmp / "config.yaml")
        os.replace(tmp, final)
        _write_text_atomic(directory / LATEST, final.name + "\n")
        # Keep the newest keep_last by step, and always the one just written (a run restarted
        # with resume=false may share the directory with higher-numbered checkpoints).
        complete = sorted(p for p in directory.iterdir() if _NAME.match(p.name) and p != final)
        for old in complete[:max(len(complete) - (keep_last - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, sharded_state: dict) -> dict:
    """Collective: loads ``path`` into the layout of ``sharded_state`` (resharding as needed)."""
    from megatron.core import dist_checkpointing

    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: missing metadata.json, not a dist_checkpointing checkpoint")
    from megaloop.models.specs import load_absent_extra_state_as_fresh

    try:
        # A local-spec (CPU) checkpoint lacks Transformer Engine's _extra_state entries.
        sharded_state = load_absent_extra_state_as_fresh(sharded_state, str(path))
        return dist_checkpointing.load(sharded_state, str(path))
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be loaded into this run ({first})") from e


def rng_state() -> dict:
    """Every RNG a training step may draw from (plain types, loadable with weights_only)."""
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def resume_source(cfg: RunConfig, checkpoint_dir: Path) -> Path | None:
    """Where a run starts from: the latest checkpoint of its own directory, else checkpoint.load."""
    if cfg.checkpoint.resume:
        latest = latest_checkpoint(checkpoint_dir)
        if latest is not None:
            return latest
    if cfg.checkpoint.load:
        path = Path(cfg.checkpoint.load)
        if path.is_dir() and (path / LATEST).exists():
            path = latest_checkpoint(path)
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"checkpoint.load={cfg.checkpoint.load!r}: no checkpoint there "
                              "(expected a directory with config.yaml, or one with a 'latest' file)")
        return path
    return None
