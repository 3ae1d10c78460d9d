"""A model chunk wrapped for training (``wrap_for_training``): per-token loss scaling, bf16, and
megatron-core's DistributedDataParallel, made collectable, with the data-parallel communication
overlap of Megatron-LM's ``--overlap-grad-reduce --overlap-param-gather`` (``configure_sync``).

megatron-core keeps each parameter's gradient accumulator (an autograd node) in ``grad_accs`` and
hangs a hook on it that closes over the DDP wrapper. The garbage collector cannot see through the
C++ node, so the cycle wrapper -> node -> hook -> wrapper is never freed: every dropped wrapper
keeps its model, its gradient buffers and its process groups alive (about fifty gloo threads per
set-up on CPU) until the process exits. Notebooks, sweeps and test sessions that build several
Trainers in one process piled those up. Here the hooks reach the wrapper through a weak proxy; a
live wrapper behaves exactly as before.
"""

from __future__ import annotations

import logging
import weakref

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
from megatron.core.transformer.module import Float16Module


class _AllReducedBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group the distributed optimizer all-reduces rather than reduce-scatters, as
    megatron-core does with ``force_all_reduce``: every rank gets the whole reduced gradient."""

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        super().start_grad_sync(force_all_reduce=True)


_FORCED_ALL_REDUCE = "Performing reduction using all_reduce because force_all_reduce=True"


def _not_forced_all_reduce(record: logging.LogRecord) -> bool:
    """megatron-core logs ``_FORCED_ALL_REDUCE`` at INFO on rank 0 at every reduction of an
    ``_AllReducedBucketGroup``: a line per step wherever its logger is at INFO (api.py users,
    notebooks). Only that line is dropped; the logger's other lines stay."""
    return record.getMessage() != _FORCED_ALL_REDUCE


def _quiet_forced_all_reduce() -> None:
    logger = logging.getLogger(_ParamAndGradBucketGroup.__module__)
    if _not_forced_all_reduce not in logger.filters:
        logger.addFilter(_not_forced_all_reduce)


class CollectableDDP(DistributedDataParallel):
    """DistributedDataParallel whose gradient hooks do not keep it alive."""

    def _make_backward_post_hook(self, param):
        return DistributedDataParallel._make_backward_post_hook(weakref.proxy(self), param)

    def gather_params(self) -> None:
        """Completes the parameter all-gather that ``overlap_param_gather`` defers to the next
        forward pass (each module's pre-hook waits for its bucket): the weights of every rank are
        the optimizer's latest wherever they are read outside a forward pass (checkpoints, the
        finiteness check). A no-op without it, where the optimizer step gathers them itself."""
        if self.use_forward_hook:
            self.start_param_sync(force_sync=True)


def wrap_for_training(model: torch.nn.Module, dtype: torch.dtype, distributed_optimizer: bool,
                      parallel, chunk: int, all_reduced: set = frozenset()) -> CollectableDDP:
    """``model`` (a chunk whose parameters are in ``dtype``, on its device), with per-token
    loss scaling, in Float16Module for bf16 and in DDP (gradients reduced in fp32), with
    ``parallel``'s overlap settings (megaloop.config.run.ParallelConfig). As in Megatron-LM, only
    the first of a rank's model chunks (``chunk`` 0) is cut into buckets: the interleaved
    schedule reduces each later chunk whole after its last backward, which other chunks' compute
    still overlaps. With ``overlap_grad_reduce``, the buckets holding a parameter of
    ``all_reduced`` (tied copies, then summed after the reduction: megaloop.training.tied) are
    all-reduced by the distributed optimizer too."""
    use_per_token_loss(model)
    wrapped = Float16Module(model.config, model) if dtype == torch.bfloat16 else model
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        bucket_size=parallel.ddp_bucket_size or None)  # None: megatron-core's default
    ddp = CollectableDDP(model.config, config, wrapped, disable_bucketing=chunk > 0)
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if distributed_optimizer and parallel.overlap_grad_reduce and group.params & all_reduced:
            group.__class__ = _AllReducedBucketGroup
            _quiet_forced_all_reduce()
    return ddp


def configure_sync(config, ddps: list[CollectableDDP], tied) -> None:
    """The hooks megatron-core's pipeline schedules call (read from the first chunk's
    ``config``), as Megatron-LM sets them: ``no_sync`` keeps every micro-batch but the last from
    reducing; with ``overlap_grad_reduce`` the interleaved schedule starts each chunk's reduction
    after its last backward (``grad_sync_func``). The tied decoder copies' gradients (``tied``, a
    megaloop.training.tied.TiedCopies or None) are summed before finalize_model_grads's reduction,
    or after it with ``overlap_grad_reduce``, which starts the reduction in the backward pass."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    def per_chunk(funcs):
        return funcs if len(funcs) > 1 else funcs[0]

    overlap = ddps[0].ddp_config.overlap_grad_reduce

    def finalize(model_chunks, num_tokens=None, **kwargs):
        if tied is not None and not overlap:
            tied.reduce_grads()
        finalize_model_grads(model_chunks, num_tokens, **kwargs)
        if tied is not None and overlap:
            tied.reduce_grads()

    config.finalize_model_grads_func = finalize
    config.no_sync_func = per_chunk([ddp.no_sync for ddp in ddps])
    if overlap:
        config.grad_sync_func = per_chunk([ddp.start_grad_sync for ddp in ddps])


def use_per_token_loss(model: torch.nn.Module) -> None:
    """Switches megatron-core to per-token loss scaling: the loss function returns token sums and
    counts, schedules stop dividing by micro-batch count, DDP sums over data-parallel ranks and
    finalize_model_grads divides by the global batch's token count. Set on every block's config
    (DDP and the schedules read the model's; MoE routers copy theirs at construction, so their
    copies are set too) here rather than in the model, where plain DDP users expect averaging."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "calculate_per_token_loss"):
            config.calculate_per_token_loss = True
        if hasattr(module, "calculate_per_token_loss"):
            module.calculate_per_token_loss = True
