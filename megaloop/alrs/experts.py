"""MoE expert weights for ALRS and the per-block LRs: every expert matrix is its own block, named by
its *global* expert index, and every rank knows every expert's blocks.

Under expert parallelism each rank holds E / EP experts under local names (megatron-core's
SequentialMLP ``...experts.local_experts.<i>.linear_fc1.weight``, Transformer Engine's grouped
experts ``...experts.linear_fc1.weight<i>``), so equal names on two ranks are different experts.
Here local index i becomes the layer's ``local_expert_indices[i]``; with EP = 1 the names do not
change. ``every_expert`` completes a rank's blocks with the other ranks' experts (same shapes,
canonical order), so that ALRS analyses and allocates over all E experts identically on every rank
and each rank applies the multipliers of the experts it holds.

Pipeline stages hold other layers, and a block of a pipeline stage holds layers at other positions
than their numbers (``LayerBlock``): ``named_parameters`` names layers by their number in the whole
block, so that names do not depend on the layout and the tied copies of a decoder layer on several
stages share one name, and ``every_block`` completes a stage's blocks with the other stages'.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megaloop.alrs.blocks import RowSplit, WeightBlock

# (prefix up to the expert index, local index, rest) of an expert parameter's name, relative to the
# MoE layer's ``experts`` module.
_EXPERT = re.compile(r"^(local_experts\.)(\d+)(\..+)$|^(linear_fc[12]\.weight)(\d+)$")
_GLOBAL = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)"
                     r"|(\.experts\.linear_fc[12]\.weight)(\d+)")


_LAYER = re.compile(r"^(.*?layers\.)(\d+)\.")


def _layer_numbers(model: nn.Module) -> dict[str, str]:
    """Local prefix -> prefix with the layer's number in its whole block, for the layers a pipeline
    stage's block holds at another position (``LayerBlock``: "decoder.layers.0." of a stage
    holding decoder layers 3-4 is "decoder.layers.2.")."""
    renames = {}
    for prefix, module in model.named_modules():
        for position, layer in enumerate(getattr(module, "layers", None) or []):
            number = getattr(layer, "layer_number", None)
            if number is not None and number - 1 != position:
                renames[f"{prefix}.layers.{position}."] = f"{prefix}.layers.{number - 1}."
    return renames


def _global_names(model: nn.Module) -> dict[str, str]:
    """Local parameter name -> name with the global expert index, for every expert parameter."""
    renames = {}
    for prefix, module in model.named_modules():
        indices = getattr(module, "local_expert_indices", None)
        experts = getattr(module, "experts", None)
        if indices is None or experts is None:
            continue
        for name, _ in experts.named_parameters():
            match = _EXPERT.match(name)
            if match is None:
                continue
            if match.group(1):
                local_name = f"{match.group(1)}{indices[int(match.group(2))]}{match.group(3)}"
            else:
                local_name = f"{match.group(4)}{indices[int(match.group(5))]}"
            owner = f"{prefix}.experts." if prefix else "experts."
            renames[owner + name] = owner + local_name
    return renames


def _canonical(model: nn.Module):
    """name -> the name ``named_parameters`` gives it."""
    experts, layers = _global_names(model), _layer_numbers(model)
    # The last pipeline stage's copy of a tied embedding (megatron-core's) is the embedding.
    if getattr(model, "share_embeddings_and_output_weights", False) \
            and not getattr(model, "pre_process", True):
        experts["output_layer.weight"] = "embedding.word_embeddings.weight"

    def rename(name: str) -> str:
        name = experts.get(name, name)
        match = _LAYER.match(name)
        if match is not None and match.group(0) in layers:
            name = layers[match.group(0)] + name[match.end():]
        return name

    return rename


def named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` under names every rank and layout agrees on: experts by their
    global index, a pipeline stage's layers by their number in the whole block (so that the tied
    copies of a decoder layer on several stages share one name), and the last stage's copy of a
    tied embedding as the embedding."""
    rename = _canonical(model)
    for name, param in model.named_parameters():
        yield rename(name), param


def global_layouts(model: nn.Module, layouts: dict[str, RowSplit]) -> dict[str, RowSplit]:
    """``fused_layouts(model)`` keyed by the names of ``named_parameters``."""
    rename = _canonical(model)
    return {rename(name): split for name, split in layouts.items()}


def expert_index(name: str) -> int | None:
    """The global expert index in a (global) parameter or block name; None for other weights."""
    match = _GLOBAL.search(name)
    if match is None:
        return None
    return int(match.group(2) if match.group(1) else match.group(5))


def _with_expert(name: str, index: int) -> str:
    return _GLOBAL.sub(lambda m: (f"{m.group(1)}{index}{m.group(3)}" if m.group(1)
                                  else f"{m.group(4)}{index}"), name, count=1)


def every_expert(blocks: list[WeightBlock], num_experts: int) -> list[WeightBlock]:
    """``blocks`` with each expert block repeated for all ``num_experts`` experts, in an order
    every rank agrees on: the non-expert blocks and expert "kinds" in first-seen order, each kind
    expanded over experts 0..E-1."""
    out, kinds = [], set()
    for block in blocks:
        if expert_index(block.name) is None:
            out.append(block)
            continue
        kind = _with_expert(block.name, -1)
        if kind in kinds:
            continue
        kinds.add(kind)
        out.extend(dataclasses.replace(block, name=_with_expert(block.name, e),
                                       param=_with_expert(block.param, e))
                   for e in range(num_experts))
    return out


def num_experts(model: nn.Module) -> int:
    """E of the model's MoE layers (0 without experts)."""
    return max((m.config.num_moe_experts for m in model.modules()
                if getattr(m, "local_expert_indices", None) is not None), default=0)


_MODEL_ORDER = re.compile(r"^(embedding|encoder|decoder)\.(?:layers\.(\d+)\.)?")


def _model_order(block: WeightBlock) -> tuple[int, int]:
    """Where one process's ``named_parameters`` lists a block: embedding, encoder layers, decoder
    layers by number, then the rest (final norm, head)."""
    match = _MODEL_ORDER.match(block.name)
    if match is None:
        return 3, 0
    return ("embedding", "encoder", "decoder").index(match.group(1)), int(match.group(2) or 0)


def every_block(blocks: list[WeightBlock], num_experts: int,
                pipeline_group: dist.ProcessGroup | None = None) -> list[WeightBlock]:
    """Every block of the model, each once, in the order one process lists them: ``every_expert``,
    and under pipeline parallelism (``pipeline_group`` of more than one rank) the union over the
    stages (a collective)."""
    blocks = every_expert(blocks, num_experts)
    if pipeline_group is None or dist.get_world_size(pipeline_group) == 1:
        return blocks
    stages = [None] * dist.get_world_size(pipeline_group)
    dist.all_gather_object(stages, blocks, group=pipeline_group)
    merged = {}
    for stage in stages:
        for block in stage:
            merged.setdefault(block.name, block)
    return sorted(merged.values(), key=_model_order)
