"""A checkpoint directory as files (the layout: megaloop.training.checkpoint): the names, the
``latest`` pointer, the complete checkpoints, their stored run config, and ``verify_checkpoint``,
which finds a missing or truncated file before megatron-core would fail on it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from megaloop.config import ConfigError, from_dict

LATEST = "latest"
NAME_PATTERN = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the path."""


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def one_line(error: BaseException) -> str:
    """The first line of what went wrong; for torch's CheckpointException (a BaseException that
    wraps every rank's traceback) that of the first failing rank's own exception."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and failures:
        error = next(iter(failures.values()))[0]
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none yet."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    path = directory / pointed_name(pointer)
    if not (path / "config.yaml").is_file():
        raise CheckpointError(f"{pointer}: names {path.name!r}, which is not a complete "
                              f"checkpoint directory in {directory}")
    return path


def pointed_name(pointer: Path) -> str:
    """The ``iter_N`` name a ``latest`` file holds; a CheckpointError in one line naming the file
    when it is unreadable, not UTF-8 text, empty or holds anything else (every reader of
    ``latest`` goes through here: resume, ``checkpoint.load``, api.load, export, evaluation)."""
    expected = "it should hold the name of a checkpoint directory, e.g. iter_0000100"
    try:
        text = pointer.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer}: not UTF-8 text ({expected})") from None
    except OSError as e:  # a directory named latest, no permission...
        raise CheckpointError(f"{pointer}: unreadable ({e.strerror or e})") from None
    name = text.strip()
    if not name:
        raise CheckpointError(f"{pointer}: empty ({expected})")
    if not NAME_PATTERN.match(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise CheckpointError(f"{pointer}: holds {shown!r}, not a checkpoint name ({expected})")
    return name


def complete_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The renamed (complete) ``iter_N`` directories of ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if NAME_PATTERN.match(p.name) and p.is_dir())


def verify_checkpoint(path: Path) -> None:
    """Raises a CheckpointError naming the first missing or truncated file of checkpoint ``path``:
    config.yaml, metadata.json, common.pt, the torch_dist ``.metadata`` and every ``.distcp``
    file it indexes (present, and as long as the byte ranges it records). Reads only metadata and
    file sizes, not the shards. Damage inside a shard of the right length is not detectable:
    torch_dist stores no checksums."""
    from torch.distributed.checkpoint import FileSystemReader

    saved_config(path)
    marker = path / "metadata.json"
    try:
        json.loads(marker.read_text())["sharded_backend"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: missing or unreadable ({one_line(e)})") from None
    common = path / "common.pt"
    try:
        torch.load(common, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, pickle errors, OSError...
        raise CheckpointError(f"{common}: missing or truncated ({one_line(e)})") from None
    index = path / ".metadata"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{index}: missing or truncated ({one_line(e)})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard}: missing (listed in {index.name})")
        size = shard.stat().st_size
        if size < end:
            raise CheckpointError(f"{shard}: truncated ({size} bytes, {index.name} records {end})")


def holds_training_state(path: Path) -> bool:
    """Whether checkpoint ``path`` holds optimizer state and progress besides the weights (a
    conversion from Hugging Face, megaloop.hf, writes weights only)."""
    return "trainer" in torch.load(path / "common.pt", map_location="cpu", weights_only=True)


def step_of(path: Path) -> int:
    match = NAME_PATTERN.match(path.name)
    if match is None:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected iter_NNNNNNN)")
    return int(match.group(1))


def saved_config(path: Path) -> dict:
    """The run config stored with a checkpoint, as a plain dict."""
    config_file = path / "config.yaml"
    try:
        saved = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{config_file}: unreadable checkpoint config "
                              f"({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{config_file}: unreadable checkpoint config (not UTF-8 text)"
                              ) from None
    except yaml.YAMLError as e:  # its message spans several lines: the problem and where
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise CheckpointError(f"{config_file}: unreadable checkpoint config (invalid YAML{where}: "
                              f"{problem})") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("model"), dict)
            and isinstance(saved.get("parallel"), dict)):
        raise CheckpointError(f"{config_file}: unreadable checkpoint config (no model and "
                              "parallel sections, which every config a run saves holds)")
    return saved


def saved_section(path: Path, cls, section: str):
    """Section ``section`` of the run config stored with checkpoint ``path``, as dataclass ``cls``
    (a field missing there takes its default); a field it does not accept is a CheckpointError
    naming the file and the field."""
    try:
        return from_dict(cls, saved_config(path).get(section) or {}, section)
    except ConfigError as e:
        raise CheckpointError(f"{path / 'config.yaml'}: {e}") from None

