"""megatron-core's load of a rank's sharded state (``dist_checkpointing.load``), with two changes.

Each piece is read once per rank. Under the interleaved schedule one pipeline rank can hold
several tied copies of a decoder layer (model chunks running the same layer in different
iterations), and so several entries, model and optimizer state alike, for the same piece of the
same tensor (same key and offsets). megatron-core builds one PyTorch ShardedTensor per key and
rank and refuses those as overlapping shards. Here the load requests each piece once, and every
other entry for it gets a copy of what was loaded, into its own tensor where it has one (no two
parameters or optimizer states come to share storage).

A refusal is seen by every rank. megatron-core checks a rank's pieces on that rank alone and the
sharding of all ranks on rank 0 alone, each just before a collective, which the other ranks then
wait in until the process-group timeout. Both checks run here first, and every rank raises the
first refusal.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from megaloop.cli import decided_on_every_rank
from megaloop.training.collective import first_error


def _leaves(tree, path=()):
    """(path, leaf) of a nested dict/list state, depth first."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else None
    if items is None:
        yield path, tree
        return
    for key, value in list(items):
        yield from _leaves(value, (*path, key))


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def _piece(entry) -> tuple:
    """What an entry reads from a checkpoint: equal for two entries of one rank that read the same
    values (a factory: those its pieces read, built as views of its tensor)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if isinstance(entry, ShardedObject):
        return ("object", entry.unique_key)
    if isinstance(entry, ShardedTensor):
        flat = entry.flattened_range
        return ("tensor", entry.key, tuple(entry.global_offset), tuple(entry.local_shape),
                None if flat is None else (flat.start, flat.stop))
    return ("factory", *(_piece(built) for built in nested_values(entry.build())))


def _read_each_piece_once(state: dict) -> list[tuple[tuple, tuple, object]]:
    """Leaves one entry per piece in ``state`` (a main replica where there is one, so that the
    sharding stays valid) and puts placeholders in place of the others; returns each one left
    out as (its path, the path of the entry kept, the entry)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    groups: dict[tuple, list] = {}
    for path, entry in _leaves(state):
        if isinstance(entry, ShardedBase):
            groups.setdefault(_piece(entry), []).append((path, entry))
    twins = []
    for group in groups.values():
        if len(group) == 1:
            continue
        kept = next((g for g in group if is_main_replica(g[1].replica_id)), group[0])
        for path, entry in group:
            if path != kept[0]:
                _set(state, path, LocalNonpersistentObject(None))
                twins.append((path, kept[0], entry))
    return twins


def _own_copy(entry, value):
    """``value`` (what was loaded for ``entry``'s piece) in ``entry``'s own tensor if it has one of
    that shape, else a copy. An entry whose tensor is the kept entry's (the same elements) holds
    it already: copying it again would only cost the time, cloning it the memory too."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    own = getattr(entry, "data", None)
    if not (isinstance(own, torch.Tensor) and own.shape == value.shape):
        return value.clone()
    if own.data_ptr() == value.data_ptr() and own.stride() == value.stride():
        return own
    with torch.no_grad():
        return own.copy_(value)


def _overlap(a, b) -> bool:
    """Whether two pieces of one tensor share an element."""
    def sizes(piece):  # the axes megatron-core prepends (e.g. layers) are 1 wide
        return (1,) * piece.prepend_axis_num + tuple(piece.local_shape)

    for start_a, size_a, start_b, size_b in zip(a.global_offset, sizes(a),
                                                b.global_offset, sizes(b)):
        if start_a >= start_b + size_b or start_b >= start_a + size_a:
            return False
    flat_a, flat_b = a.flattened_range, b.flattened_range
    return flat_a is None or flat_b is None or (flat_a.start < flat_b.stop
                                                and flat_b.start < flat_a.stop)


def _check_own_pieces(built: dict) -> None:
    """Refuses two overlapping pieces of one tensor on this rank, which megatron-core cannot
    load (one ShardedTensor per key and rank)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    by_key: dict[str, list] = {}
    for entry in nested_values(built):
        if isinstance(entry, ShardedTensor):
            for other in by_key.setdefault(entry.key, []):
                if _overlap(entry, other):
                    raise ValueError(f"rank {torch.distributed.get_rank()} requests "
                                     f"overlapping pieces of {entry.key} "
                                     f"(offsets {entry.global_offset} and {other.global_offset})")
            by_key[entry.key].append(entry)


def _prepare(state: dict) -> tuple[list, str | None]:
    """Collective: leaves one entry per piece in ``state`` (``_read_each_piece_once``'s twins);
    then the first refusal of it by megatron-core's load checks on any rank (its own pieces on
    each rank, the sharding of all on rank 0), on every rank (None if none)."""
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    from megaloop.training.checkpoint_files import one_line

    problem, built, twins = None, {}, []
    try:  # the factories built, as the load will see them (load_preprocess copies)
        twins = _read_each_piece_once(state)
        built = extract_sharded_base(load_preprocess(state)[0])[0]
        _check_own_pieces(built)
    except Exception as e:
        problem = one_line(e)
    return twins, agreed_refusal(problem, built)


def agreed_refusal(problem: str | None, built: dict, common_state: dict | None = None
                   ) -> str | None:
    """Collective: the first rank's ``problem`` (a refusal found on that rank alone, None if
    none), else megatron-core's check of the sharding of every rank's ``built`` entries (made on
    rank 0 alone), on every rank; None when nothing is refused. The ranks' problems are agreed
    first: rank 0's check of a sharding that lacks a failed rank's pieces would refuse it too,
    and name that instead of the cause. ``common_state``: a save's common state, which
    megatron-core compares with rank 0's (a warning when they differ)."""
    from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                             validate_sharding_integrity)

    from megaloop.training.checkpoint_files import one_line

    problem = first_error(problem)
    if problem is not None:
        return problem
    _, every_rank = determine_global_metadata(built)
    try:
        validate_sharding_integrity(every_rank, common_state)  # raises on rank 0 only
    except Exception as e:
        problem = one_line(e)
    return first_error(problem)


def load_sharded(state: dict, path: Path) -> dict:
    """Collective: ``dist_checkpointing.load(state, path)``, each piece read once per rank and a
    refusal raised on every rank (see the module)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    twins, refusal = _prepare(state)
    if refusal:
        raise decided_on_every_rank(CheckpointingException(refusal))
    loaded = dist_checkpointing.load(state, str(path), validate_access_integrity=False)
    for twin, kept, entry in twins:
        _set(loaded, twin, _own_copy(entry, _get(loaded, kept)))
    return loaded
