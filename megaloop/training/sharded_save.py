"""megatron-core's save of a rank's sharded state, in steps whose failure every rank sees.

``dist_checkpointing.save`` runs rank-local work between its collectives: each rank's factories
before the ranks' sharding is gathered, the check of that sharding on rank 0 alone, common.pt
written by rank 0 alone before the write's planning gathers every rank's plan, and in its
finalize ``.metadata`` and metadata.json, written by rank 0 alone between collectives. A
failure in one of them (a factory's error on one rank, a sharding rank 0 refuses, a full disk
under rank 0's files) was raised on that rank alone: its error path's next collective met the
others' next one in megatron-core, or it left them in one, until the process-group timeout (30
minutes by default). Here ``save_sharded`` runs the same steps in megatron-core's order with the
outcome agreed after each, the finalize's too, and every rank raises the first failure, naming
its rank, as a RuntimeError marked ``cli.decided_on_every_rank``.

So is the rank-local half of the write's planning (torch DCP's decentralised plan: each rank
translates its state and plans its writes, then rank 0 gathers the plans), whose failure on one
rank (an object that cannot be pickled, a checkpoint directory its node cannot create) left
rank 0 in that gather until the process-group timeout: ``_plan_locally`` runs it once first,
and its outcome is agreed. What fails only in the second run of it, inside megatron-core's
save, still leaves rank 0 in its gather; the failed rank then logs its cause at once
(checkpoint_save._write).
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path


from megaloop.cli import decided_on_every_rank
from megaloop.training.checkpoint_files import one_line
from megaloop.training.collective import first_error, is_rank0, said_by_this_rank
from megaloop.training.sharded_load import agreed_refusal


def _on_this_rank(error: BaseException) -> str:
    return said_by_this_rank(one_line(error))


def _agreed(problem: str | None) -> None:
    problem = first_error(problem)
    if problem is not None:
        raise decided_on_every_rank(RuntimeError(problem))


def _agreed_call(step) -> None:
    """Collective: ``step()`` on every rank, whose failure on any rank raises on every rank."""
    problem = None
    try:
        step()
    except Exception as e:
        problem = _on_this_rank(e)
    _agreed(problem)


def save_sharded(state: dict, path: Path):
    """Collective: ``dist_checkpointing.save(state, path, async_sharded_save=True)``, the
    AsyncRequest of the write (to schedule), with its finalize; a failure before the write's
    planning raises the same RuntimeError on every rank (``cli.is_decided_on_every_rank``)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_common_strategy
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded, common, problem = {}, {}, None
    try:
        sharded, common = save_preprocess(state, validate_access_integrity=False)
    except Exception as e:
        problem = _on_this_rank(e)
    refusal = agreed_refusal(problem, sharded, common)
    if refusal is not None:
        raise decided_on_every_rank(RuntimeError(refusal))
    # The common state: written by rank 0 alone.
    _agreed_call(lambda: get_default_save_common_strategy().save_common(common, str(path)))
    # torch_dist writes the ShardedObjects itself, beside the tensors (megatron-core's save
    # hands them to the common strategy only for a sharded strategy that cannot).
    strategy = _strategy()
    _agreed_call(lambda: _plan_locally(strategy, sharded, path))
    request = strategy.async_save(sharded, str(path))
    request.finalize_fns.append(lambda: _write_format(strategy, path))
    return request


def _plan_locally(strategy, sharded: dict, path: Path) -> None:
    """What ``strategy.async_save(sharded, path)`` does on this rank before it gathers every
    rank's plan on rank 0 (megatron-core's torch_dist translation of the state, then torch DCP's
    local plan and the writer's preparation of the directory), run ahead of it, so that a
    failure here is agreed on rather than leaving rank 0 in that gather. It writes no data and
    copies no tensor (ShardedObjects are pickled, the small ones: RNG states, bucket sizes)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    keep_only_main = strategy.keep_only_main_replica
    flat = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main)[0]
    planner = MCoreSavePlanner(dedup_replicated_tensors=not keep_only_main,
                               flatten_state_dict=False)
    writer = FileSystemWriterAsync(path, separation_hint=strategy.separation_hint,
                                   thread_count=strategy.thread_count)
    planner.set_up_planner(mcore_to_pyt_state_dict(flat, False), is_coordinator=is_rank0())
    writer.set_up_storage_writer(is_rank0())
    writer.prepare_local_plan(planner.create_local_plan())


def _strategy():
    """megatron-core's default save strategy (torch_dist), whose finalize records the failure of
    rank 0's ``.metadata`` write for ``_write_format`` to agree on, rather than raising it
    between the finalize's gather and broadcast, which the other ranks would wait in."""
    return _strategy_class()("torch_dist", 1)


@functools.lru_cache(maxsize=1)
def _strategy_class():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class Strategy(TorchDistSaveShardedStrategy):
        finish_problem: str | None = None

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            # The finalize calls finish on the planning's writer, this one. Held weakly: the
            # writer holds the tensors it writes, and a cycle through it would keep them alive
            # after the save, until the garbage collector runs.
            finish, writer_ref = type(writer).finish, weakref.ref(writer)

            def recorded(*args, **kwargs) -> None:
                try:
                    finish(writer_ref(), *args, **kwargs)
                except Exception as e:
                    self.finish_problem = _on_this_rank(e)

            writer.finish = recorded
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    return Strategy


def _write_format(strategy, path: Path) -> None:
    """Collective, the finalize's last step once every rank's write is complete: rank 0 writes
    metadata.json (the format, which marks the checkpoint a dist_checkpointing one) unless its
    ``.metadata`` failed."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    problem = strategy.finish_problem
    if is_rank0() and problem is None:
        try:
            save_config(CheckpointingConfig(strategy.backend, strategy.version), str(path))
        except Exception as e:
            problem = _on_this_rank(e)
    _agreed(problem)  # also megatron-core's barrier: every rank's finalize has run
