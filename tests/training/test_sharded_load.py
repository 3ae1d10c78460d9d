"""Loading a sharded state (megaloop.training.sharded_load): a piece requested several times on one
rank (tied copies of a layer in two model chunks) is read once and fills every request, each in
its own tensor; a request megatron-core refuses on one rank alone is refused on every rank, not
left to the others to wait out in a collective."""

import contextlib
import io
from pathlib import Path

import pytest
import torch

from megaloop.cli import print_error
from megaloop.training.checkpoint import CheckpointError
from tests.distributed import run_distributed


def _save(path: Path, rank: int = 0, world_size: int = 1) -> None:
    """Saves w = arange(8) split over the ranks, and an object, into ``path``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    half = 8 // world_size
    w = torch.arange(8.0)[rank * half:(rank + 1) * half].clone()
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(
        {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world_size)),
         "o": ShardedObject("o", {"n": 3}, (1,), (0,), replica_id=rank)}, str(path))


def test_a_piece_requested_twice_on_one_rank_fills_both_in_their_own_tensors(mcore, tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from megaloop.training.checkpoint_load import load_checkpoint

    _save(tmp_path)
    first, second = torch.zeros(8), torch.full((8,), -1.0)
    loaded = load_checkpoint(tmp_path, {
        "chunk0": {"w": ShardedTensor.from_rank_offsets("w", first),
                   "o": ShardedObject("o", None, (1,), (0,))},
        "chunk2": {"w": ShardedTensor.from_rank_offsets("w", second, replica_id=1),
                   "o": ShardedObject("o", None, (1,), (0,), replica_id=1)}})
    assert torch.equal(first, torch.arange(8.0)) and torch.equal(second, first)
    assert [loaded[c]["w"].data_ptr() for c in ("chunk0", "chunk2")] == [first.data_ptr(),
                                                                          second.data_ptr()]
    assert loaded["chunk0"]["o"] == loaded["chunk2"]["o"] == {"n": 3}
    assert loaded["chunk0"]["o"] is not loaded["chunk2"]["o"]


def _load_refused_on_one_rank(rank, world_size, path, refusal):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megaloop.training.checkpoint_load import load_checkpoint

    _save(Path(path), rank, world_size)
    overlapping = {"overlap": 0, "overlap_on_rank_1": 1}.get(refusal)
    if rank == overlapping:  # its rows and rows of them again: one rank's pieces overlap
        state = {"a": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, 2)),
                 "b": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 2 * rank, 4),
                                                      replica_id=1)}
    elif overlapping is not None:
        state = {"a": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, 2))}
    else:  # both ranks the main replica of all of w: refused by rank 0's sharding check
        state = {"a": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}
    try:
        load_checkpoint(Path(path), state)
    except CheckpointError as e:
        with contextlib.redirect_stderr(io.StringIO()) as printed:
            print_error(e)
        return str(e), printed.getvalue()
    return None, ""


@pytest.mark.parametrize("refusal, says", [
    ("overlap", "rank 0 requests overlapping pieces of w"),
    ("overlap_on_rank_1", "rank 1 requests overlapping pieces of w"),
    ("sharding", "Invalid access pattern for ShardedTensor(key='w'"),
], ids=["own_pieces_overlap", "own_pieces_overlap_on_rank1", "sharding_refused_on_rank0"])
def test_a_load_one_rank_refuses_is_refused_on_every_rank(tmp_path, refusal, says):
    # Before, the refusing rank raised while the other waited in the load's next collective
    # until the process-group timeout. Rank 1's refusal was then named as rank 0's check of a
    # sharding without rank 1's pieces (Invalid access pattern), not as its cause.
    (error0, printed0), (error1, printed1) = run_distributed(
        _load_refused_on_one_rank, world_size=2, path=str(tmp_path), refusal=refusal)
    assert error0 == error1 and says in error0, (error0, error1)
    assert "\n" not in error0
    assert (printed0, printed1) == (f"error: {error0}\n", ""), "said by rank 0 alone"




def test_a_piece_requested_twice_with_one_tensor_is_loaded_into_it_once(mcore, tmp_path):
    """Two requests for one piece that share their tensor (one state reached by two paths): the
    second gets that tensor as loaded, written no more times than by a load of one request (its
    version counter: every in-place write bumps it). Before, it was copied onto itself."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megaloop.training.checkpoint_load import load_checkpoint

    _save(tmp_path)
    once, shared = torch.zeros(8), torch.zeros(8)
    load_checkpoint(tmp_path, {"w": ShardedTensor.from_rank_offsets("w", once)})
    loaded = load_checkpoint(tmp_path, {
        "chunk0": {"w": ShardedTensor.from_rank_offsets("w", shared)},
        "chunk2": {"w": ShardedTensor.from_rank_offsets("w", shared, replica_id=1)}})
    assert torch.equal(shared, torch.arange(8.0))
    assert loaded["chunk2"]["w"].data_ptr() == loaded["chunk0"]["w"].data_ptr() == \
        shared.data_ptr()
    assert shared._version == once._version > 0
