"""checkpoint.async_save: the write of a periodic save runs in the background while training goes
on, the checkpoint holds the state of its own step (a resume from it is bit-exact), ``latest``
moves only once the write is complete, and the Trainer closes every part of itself, waiting for
a write in flight first. A kill -9 mid-write and a failing write: test_preemption.py and
test_checkpoint.py."""

import logging
import time

import pytest

from megaloop.config import ConfigError
from megaloop.training import checkpoint as ckpt
from megaloop.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.conftest import one_line, resume_from, tiny_run, train_losses


def _slow_background_writes(monkeypatch, seconds: float) -> None:
    """Each background write waits ``seconds`` before writing: it runs in a process forked from
    this one, which inherits the patch."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    write = FileSystemWriterAsync.write_preloaded_data_multiproc

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc",
                        staticmethod(slow))


def test_a_checkpoint_written_while_training_goes_on_resumes_bit_for_bit(
        mcore, pattern_data, tmp_path, monkeypatch, caplog):
    straight = tmp_path / "straight"
    trainer = Trainer(tiny_run(pattern_data, straight,
                               checkpoint={"save_interval": 4, "async_save": True}))
    _slow_background_writes(monkeypatch, 1.0)
    in_flight, train_step = [], trainer.train_step

    def noting_the_write_in_flight(data):
        in_flight.append((trainer.step, trainer.saver.pending_step))
        return train_step(data)

    trainer.train_step = noting_the_write_in_flight
    trainer.train()
    monkeypatch.undo()
    # Step 5 ran while step 4's write was in flight: what it changed must not be in iter_4.
    assert (5, 4) in in_flight, in_flight
    assert ckpt.latest_checkpoint(straight / "checkpoints").name == "iter_0000008"
    assert [t["step"] for t in trainer.saver.timings] == [4, 8]
    # The writes were slowed by 1 s; stamped after the fork, the background time may miss a little.
    assert all(t["background_s"] >= 0.9 for t in trainer.saver.timings), trainer.saver.timings

    resumed = tmp_path / "resumed"
    resume_from(straight, resumed, 4)
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        # The checkpoint was saved with async_save=true: a resume may turn it off (or on).
        trainer = Trainer(tiny_run(pattern_data, resumed, checkpoint={"save_interval": 4}))
    assert any("checkpoint.async_save changed from True to False; in effect from step 5"
               in r.getMessage() for r in caplog.records), caplog.text
    assert trainer.step == 4
    trainer.train()
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert [a[s] for s in b] == [b[s] for s in b]


@pytest.mark.parametrize("interval, named", [
    (0, "checkpoint.save_interval=0"),
    # Before the fix: accepted, and no save ran in the background.
    (9, "checkpoint.save_interval=9 > train.train_steps=8")])
def test_async_save_with_saves_only_at_the_end_is_refused(pattern_data, tmp_path, interval,
                                                          named):
    with pytest.raises(ConfigError) as error:
        tiny_run(pattern_data, tmp_path, checkpoint={"async_save": True,
                                                     "save_interval": interval}).validate()
    assert one_line(error) == (f"checkpoint.async_save=True: must be false with {named} (only "
                               "the final and stop-signal saves, which wait for their write, so "
                               "it would change nothing)")
    # A periodic save at the last step writes in the background during the final evaluation.
    tiny_run(pattern_data, tmp_path, checkpoint={"async_save": True, "save_interval": 8}
             ).validate()


def test_close_finalizes_the_write_in_flight_and_closes_every_part(mcore, pattern_data,
                                                                   tmp_path):
    cfg = tiny_run(pattern_data, tmp_path, checkpoint={"save_interval": 2, "async_save": True})
    trainer = Trainer(cfg)
    assert trainer.save(wait=False) == tmp_path / "checkpoints" / "iter_0000000"
    assert trainer.saver.pending_step == 0
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints") is None, "not before it is complete"

    def fails(message):
        def close():
            raise RuntimeError(message)
        return close

    trainer.profiler.close = fails("the profiler's close failed")
    trainer.monitor.close = fails("the monitor's close failed too")
    with pytest.raises(RuntimeError, match="the profiler's close failed"):
        trainer.close()
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000000"
    trainer.close()  # closed once: nothing is closed twice
    # The run lock was released although two parts before it failed: the run can go on.
    with Trainer(cfg) as resumed:
        assert resumed.step == 0 and resumed.saver.latest_step == 0


def _two_ranks_async(rank, world_size, data_prefix, out_dir):
    from pathlib import Path

    out = Path(out_dir)
    steps = {"train_steps": 4, "log_interval": 1}
    Trainer(tiny_run(data_prefix, out / "async", train=steps,
                     checkpoint={"save_interval": 2, "async_save": True})).train()
    if rank == 0:
        resume_from(out / "async", out / "resumed", 2)
    import torch.distributed as dist

    dist.barrier()
    trainer = Trainer(tiny_run(data_prefix, out / "resumed", train=steps))
    start = trainer.step
    trainer.train()
    return start


def test_two_gloo_ranks_save_in_the_background_and_resume_exactly(mcore, pattern_data,
                                                                  tmp_path):
    """Data parallel over two gloo ranks, the distributed optimizer sharding its state."""
    starts = run_distributed(_two_ranks_async, world_size=2, data_prefix=pattern_data,
                             out_dir=str(tmp_path))
    assert starts == [2, 2]
    assert ckpt.latest_checkpoint(tmp_path / "async" / "checkpoints").name == "iter_0000004"
    a, b = train_losses(tmp_path / "async"), train_losses(tmp_path / "resumed")
    assert sorted(b) == [3, 4] and [a[s] for s in b] == [b[s] for s in b]


def _contents(path):
    """Every tensor and object a checkpoint's shards hold, and its common.pt."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    return (torch.load(path.parent / f"{path.name}.pt", weights_only=True),
            torch.load(path / "common.pt", weights_only=True))


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_a_fully_reshardable_background_write_writes_what_a_synchronous_save_writes(
        mcore, pattern_data, tmp_path):
    """checkpoint.optimizer_format=fully_reshardable gathers the optimizer state into new tensors
    when the state dict is made. (dp_reshardable's flat buffers hold uninitialised padding,
    different in any two saves: its background writes are held to the bit-exact resume above.)"""
    from megaloop.training.checkpoint_state import sharded_state
    from megaloop.training.data import MicroBatches

    cfg = tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 2},
                   checkpoint={"save_interval": 2, "optimizer_format": "fully_reshardable"})
    with Trainer(cfg) as trainer:  # one step: optimizer state that is not all zeros
        trainer.step = 1
        trainer.train_step(MicroBatches(trainer.train_data, 2, 0, 1, 0, 4))
        saved = {}
        for asynchronous in (False, True):
            cfg.checkpoint.async_save = asynchronous
            directory = tmp_path / ("async" if asynchronous else "sync")
            saver = ckpt.CheckpointSaver(directory, cfg)
            saved[asynchronous] = _contents(saver.save(1, sharded_state(trainer)))
    optimizer_keys = [k for k in saved[True][0] if k.startswith("optimizer")]
    assert optimizer_keys and _equal(saved[False], saved[True])


def test_a_failure_during_a_background_write_leaves_it_unfinalized(mcore, pattern_data, tmp_path,
                                                                   monkeypatch):
    """A failure that may be one rank's alone (here an error in step 3) while step 2's write is
    in flight: finalizing it would wait in collectives that the other ranks, busy in training's
    own, never join (until the process-group timeout). The write is left as its .tmp instead."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    cfg = tiny_run(pattern_data, tmp_path, checkpoint={"save_interval": 2, "async_save": True})
    trainer = Trainer(cfg)
    _slow_background_writes(monkeypatch, 0.5)
    train_step = trainer.train_step

    def fails_at_step_3(data):
        if trainer.step == 3:
            monkeypatch.setattr(dist, "all_reduce", None)  # no collective after the failure
            raise RuntimeError("step 3 failed on this rank")
        return train_step(data)

    trainer.train_step = fails_at_step_3
    with pytest.raises(RuntimeError, match="step 3 failed on this rank"):
        trainer.train()
    monkeypatch.undo()
    checkpoints = tmp_path / "checkpoints"
    assert ckpt.latest_checkpoint(checkpoints) is None
    assert list((checkpoints / "iter_0000002.tmp").glob("*.distcp")), "its write was joined"
    assert filesystem_async._results_queue.empty(), "no result left for the next save to take"


def test_a_failure_in_a_with_block_leaves_a_write_in_flight_unfinalized(mcore, pattern_data,
                                                                        tmp_path, monkeypatch):
    """The same through ``with Trainer(...)``: leaving the block on an error abandons the write in
    flight (close() would finalize it collectively), and the block's error is the one raised."""
    import torch.distributed as dist

    cfg = tiny_run(pattern_data, tmp_path, checkpoint={"async_save": True, "save_interval": 2})
    with pytest.raises(RuntimeError, match="the user's code failed"):
        with Trainer(cfg) as trainer:
            _slow_background_writes(monkeypatch, 0.5)
            trainer.save(wait=False)
            monkeypatch.setattr(dist, "all_reduce", None)  # no collective after the failure
            raise RuntimeError("the user's code failed")
    monkeypatch.undo()
    checkpoints = tmp_path / "checkpoints"
    assert ckpt.latest_checkpoint(checkpoints) is None
    assert list((checkpoints / "iter_0000000.tmp").glob("*.distcp")), "its write was joined"


def test_the_host_copies_a_write_reads_live_until_it_has_ended(mcore, tmp_path, monkeypatch):
    """On a GPU megatron-core stages every tensor in pinned host memory and forks the writer;
    0.16.1 then drops the copies. Pinned memory is shared with a fork, not copied on write, so
    the trainer's next pinned allocations could reuse it while the writer reads it. Staging
    here makes fresh copies as a GPU's does: they must live until the write is finalized."""
    import gc
    import weakref

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    from megaloop.config import CheckpointConfig, RunConfig

    copies = []

    def staging(write_buckets, non_blocking=True):
        staged = []
        for path, key, (byte_data, tensor_data) in write_buckets:
            tensor_data = [(item, tensor.clone()) for item, tensor in tensor_data]
            copies.extend(weakref.ref(tensor) for _, tensor in tensor_data)
            staged.append((path, key, (byte_data, tensor_data)))
        return staged

    monkeypatch.setattr(FileSystemWriterAsync, "preload_tensors", staticmethod(staging))
    _slow_background_writes(monkeypatch, 0.5)
    saver = ckpt.CheckpointSaver(tmp_path, RunConfig(checkpoint=CheckpointConfig(
        async_save=True)))
    state = {"weight": ShardedTensor.from_rank_offsets("weight", torch.arange(64.0))}
    saver.save(1, state, wait=False)
    gc.collect()
    assert saver.pending_step == 1 and copies
    assert all(ref() is not None for ref in copies), "freed while the writer reads them"
    saver.wait()
    gc.collect()
    assert all(ref() is None for ref in copies), "held after the write"
    assert ckpt.latest_checkpoint(tmp_path).name == "iter_0000001"
