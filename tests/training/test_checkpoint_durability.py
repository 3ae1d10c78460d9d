"""Checkpoints that survive what the disk and the machine do: every file and directory of a
checkpoint is on disk before ``latest`` names it."""

import os

import pytest

from megaloop.training import checkpoint as ckpt
from megaloop.training.trainer import Trainer
from tests.training.conftest import tiny_run


def _record_syncs_and_renames(monkeypatch, log_path):
    """Appends "fsync <path>" and "replace <src> <dst>" to ``log_path`` for every os.fsync and
    os.replace, in this process and in those it forks (megatron-core's writers): one append per
    event, so that their order is kept."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        os.write(log, f"fsync {os.readlink(f'/proc/self/fd/{fd}')}\n".encode())
        return fsync(fd)

    def recording_replace(src, dst, **kwargs):
        os.write(log, f"replace {os.fspath(src)} {os.fspath(dst)}\n".encode())
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpoint_is_on_disk_before_latest_names_it(mcore, pattern_data, tmp_path,
                                                        monkeypatch, async_save):
    events = tmp_path / "events"
    cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 2},
                   checkpoint={"save_interval": 2, "async_save": async_save})
    with Trainer(cfg) as trainer:
        _record_syncs_and_renames(monkeypatch, events)
        trainer.train()
    monkeypatch.undo()
    checkpoints = tmp_path / "run" / "checkpoints"
    final = ckpt.latest_checkpoint(checkpoints)
    tmp = final.with_name(final.name + ".tmp")
    lines = events.read_text().splitlines()
    moved = lines.index(f"replace {tmp} {final}")
    pointed = next(i for i, line in enumerate(lines)
                   if line.startswith("replace ") and line.endswith(f" {checkpoints / 'latest'}"))
    synced_before = {line.split(" ", 1)[1] for line in lines[:pointed] if line.startswith("fsync ")}
    files = sorted(p.name for p in final.iterdir())
    assert {"common.pt", "metadata.json", "config.yaml", ".metadata"} <= set(files), files
    assert [name for name in files if str(tmp / name) not in synced_before] == []
    assert str(tmp) in synced_before, "the checkpoint directory (its entries)"
    parent = f"fsync {checkpoints}"
    assert parent in lines[moved:pointed], "the rename of iter_N.tmp, before latest moves"
    assert parent in lines[pointed:], "the move of latest"
    # megatron-core's writers sync the shards; they are not read back to be synced again.
    shards = [line for line in lines if line.startswith("fsync ") and line.endswith(".distcp")]
    assert len(shards) == len(set(shards)) == len(list(final.glob("*.distcp"))), shards
