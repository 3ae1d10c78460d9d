"""Tied copies of decoder layers across pipeline stages, kept equal as megatron-core keeps a tied
embedding and output layer.

A pipeline that unrolls the loop over stages (megaloop.models.pipeline) gives every stage that runs
a decoder layer its own copy of the layer's weights; with the interleaved schedule one rank may hold
several copies, one per model chunk (each in its chunk's DDP grad buffer). The copies act as one
parameter:

- ``sync_weights`` sets every copy to the primary copy's values (the first stage holding the
  layer), before training starts;
- ``reduce_grads`` sums the gradients of all copies of a layer: first the copies of one rank,
  then over the pipeline ranks holding it, and writes the sum into every copy. All copies then
  take identical optimizer steps (same values, gradients and optimizer states);
- the gradient norm counts each tied parameter once (the model marks the other copies
  ``shared``), and checkpoints hold one copy (``LoopedLM.sharded_state_dict``).

Without ``overlap_grad_reduce`` the sum runs on each rank's accumulated gradients before the
data-parallel reduce(-scatter) (``finalize_model_grads``), so it is exact for either optimizer
whatever part of a bucket a data-parallel rank owns, and costs no extra data-parallel traffic.
With it, that reduction starts during the backward pass, before the copies are complete; the sum
then follows it (the reduction is linear), as megatron-core's sum of a tied embedding and output
layer (``_allreduce_word_embedding_grads``) does. The distributed optimizer reduce-scatters a
bucket: a data-parallel rank then holds the reduced gradient of its shard only, and the copies on
other stages, in other buckets, are cut into other shards. So under overlap the DDP bucket groups
holding copies (``params``) are all-reduced instead (megatron-core's ``force_all_reduce``,
``ddp.wrap_for_training``): every rank holds every copy's whole reduced gradient, and the sums
are exact whatever the bucket layout, which so stays that of checkpoints saved before. That costs
an all-reduce over a reduce-scatter (twice the gradient bytes) for those buckets; megatron-core
leaves the later pipeline stages in one bucket, so there it is the stage's whole gradient. The
two orders add the same numbers in another order: overlap on and off agree to rounding. The holders
of each layer get a process group per pipeline group (all ranks create them together).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class TiedCopies:
    """The tied decoder copies of this rank's model chunks (``LoopedLM``s of one pipeline rank)."""

    def __init__(self, chunks: list, pipeline: int, pipeline_group):
        self.pipeline = pipeline
        # (layer, parameter name within the layer) -> this rank's copies, in chunk order
        self.copies: dict[tuple[int, str], list[torch.nn.Parameter]] = defaultdict(list)
        self.primary: dict[tuple[int, str], torch.nn.Parameter] = {}
        holders: dict[int, tuple[int, ...]] = {}
        model = chunks[0]
        for chunk in chunks:
            if chunk.decoder is None:
                continue
            for layer in chunk.decoder.layers:
                stages = chunk.decoder_holders(layer.layer_number)
                if len(stages) == 1:
                    continue
                holders[layer.layer_number] = tuple(sorted({s % pipeline for s in stages}))
                for name, param in layer.named_parameters():
                    key = (layer.layer_number, name)
                    self.copies[key].append(param)
                    if stages[0] == chunk.stage.index:
                        self.primary[key] = param
        self.holders = {key: holders[key[0]] for key in self.copies}
        self.groups = _holder_groups(sorted(_every_holder_set(model, pipeline)), pipeline_group)

    @property
    def params(self) -> set[torch.nn.Parameter]:
        """Every copy this rank holds."""
        return {param for copies in self.copies.values() for param in copies}

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Every copy takes the primary copy's values (collective over the holders)."""
        self._reduce({key: (self.primary[key].data.clone() if key in self.primary
                            else torch.zeros_like(copies[0].data))
                      for key, copies in self.copies.items()}, lambda p: p.data)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sums each layer's gradients over all its copies, into every copy (collective)."""
        sums = {}
        for key, copies in self.copies.items():
            total = copies[0].main_grad.clone()
            for other in copies[1:]:
                total += other.main_grad
            sums[key] = total
        self._reduce(sums, lambda p: p.main_grad)

    def _reduce(self, local: dict, target) -> None:
        by_group: dict[tuple[int, ...], list] = defaultdict(list)
        for key in local:
            by_group[self.holders[key]].append(key)
        for ranks in sorted(by_group):
            keys = by_group[ranks]
            tensors = [local[k] for k in keys]
            if len(ranks) > 1:
                flat = _flatten_dense_tensors(tensors)
                dist.all_reduce(flat, group=self.groups[ranks])
                tensors = _unflatten_dense_tensors(flat, tensors)
            for key, value in zip(keys, tensors):
                for param in self.copies[key]:
                    target(param).copy_(value)


def _every_holder_set(model, pipeline: int) -> set[tuple[int, ...]]:
    """The pipeline ranks holding each tied decoder layer, for every layer of the model (so that
    every rank creates the same groups in the same order)."""
    sets = set()
    for layer in range(1, model.cfg.num_decoder_layers + 1):
        stages = model.decoder_holders(layer)
        if len(stages) > 1:
            sets.add(tuple(sorted({s % pipeline for s in stages})))
    return sets


def _holder_groups(holder_sets: list[tuple[int, ...]], pipeline_group) -> dict:
    """A process group of the ranks at the given pipeline positions of this rank's pipeline group,
    for each set of more than one position. ``new_group`` is collective over the world, so every
    rank creates every pipeline group's groups, in one order, and keeps its own."""
    mine = dist.get_process_group_ranks(pipeline_group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pipelines = sorted({tuple(ranks) for ranks in every})
    groups = {}
    for positions in holder_sets:
        if len(positions) < 2:
            continue
        for ranks in pipelines:
            group = dist.new_group([ranks[p] for p in positions])
            if tuple(mine) == ranks:
                groups[positions] = group
    return groups
