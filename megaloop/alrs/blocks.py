"""The matrices ALRS analyses and scales: the logical blocks inside megatron-core's fused weights.

The ALRS reference (He et al.'s unfused LLaMA) analyses Q, K, V, O, gate, up and down as separate
matrices, and median-Hill α depends on a matrix's shape, so a fused weight must be split before its
spectrum means what the reference's does. megatron-core fuses three kinds of weight, all along the
output rows (dim 0) of each tensor-parallel rank's shard, in a pattern that repeats every
``period`` rows (``RowSplit``):

- ``SelfAttention.linear_qkv``: per query group g, [the q heads of g; k_g; v_g] (GQA: heads/groups
  q heads per group). Column-parallel; every TP rank holds whole groups.
- megaloop's ``linear_kv_global``: per query group, [Global k_g; Global v_g].
- ``MLP.linear_fc1`` with a gated linear unit: [gate; up] *per TP rank*: each shard is its own gate
  rows followed by its own up rows, so the full gate matrix is the concatenation of every rank's
  first half, not the first half of the concatenated shards.

A block's full matrix is therefore the concatenation, over TP ranks in rank order, of each rank's
block rows (``WeightBlock.local``). Every other 2-D weight is one block under its parameter name; a
weight shared by several modules (a weight-tied decoder, tied embedding and head) is one block.

MoE: expert weights are split by the same rules. megatron-core's SequentialMLP holds every expert
as an ``MLP`` (``...experts.local_experts.<e>.linear_fc1.weight``) and TEGroupedMLP one
``weight<e>`` per local expert inside its ``linear_fc1``; ``fused_layouts`` splits every 2-D
parameter of a gated ``linear_fc1`` into gate/up, so each expert gets its own gate and up blocks
(its down projection is a whole block) without new code here. Under expert parallelism ranks hold
different experts under the same local names; ``megaloop.alrs.experts`` names them by their global
index for ALRS and the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megaloop.alrs.schedule import config_error


@dataclass(frozen=True)
class RowSplit:
    """How a fused weight's local rows divide into logical matrices: the rows form repeating units
    of ``period`` rows, and part ``name`` is rows [start, start + size) of every unit."""

    period: int
    parts: tuple[tuple[str, int, int], ...]  # (name, start, size)


@dataclass(frozen=True)
class WeightBlock:
    """One logical matrix: a whole 2-D parameter, or one part of a fused one.

    ``name`` is the parameter's name, with ``:<part>`` appended for a part of a fused weight (e.g.
    ``decoder.layers.0.self_attention.linear_qkv.weight:q``). ``full_shape`` is that of the whole
    logical matrix across tensor-parallel ranks; ``partition_dim`` the TP shard dimension of the
    parameter (None when every rank holds it whole).
    """

    name: str
    param: str
    full_shape: tuple[int, int]
    partition_dim: int | None
    rows: tuple[int, int, int] | None = None  # (period, start, size) of a part; None: whole

    @property
    def cost(self) -> int:
        m, n = self.full_shape
        return m * n * min(m, n)

    def local_rows(self, n_rows: int) -> torch.Tensor:
        """Indices of this block's rows in a local shard of ``n_rows`` rows, in order."""
        if self.rows is None:
            return torch.arange(n_rows)
        period, start, size = self.rows
        return torch.arange(n_rows).view(-1, period)[:, start:start + size].reshape(-1)

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of the block, from this rank's shard of the parameter."""
        if self.rows is None:
            return weight
        return weight.index_select(0, self.local_rows(weight.shape[0]).to(weight.device))


def _qkv_split(attention: nn.Module) -> tuple[RowSplit, int]:
    hd = attention.hidden_size_per_attention_head
    groups = attention.num_query_groups_per_partition
    q = attention.num_attention_heads_per_partition // groups * hd
    return RowSplit(q + 2 * hd, (("q", 0, q), ("k", q, hd), ("v", q + hd, hd))), groups


def _global_kv_split(attention: nn.Module) -> tuple[RowSplit, int]:
    hd = attention.hidden_size_per_attention_head
    return (RowSplit(2 * hd, (("global_k", 0, hd), ("global_v", hd, hd))),
            attention.num_query_groups_per_partition)


def _gated_fc1_split(rows: int) -> tuple[RowSplit, int]:
    return RowSplit(rows, (("gate", 0, rows // 2), ("up", rows // 2, rows // 2))), 1


def fused_layouts(model: nn.Module) -> dict[str, RowSplit]:
    """The ``RowSplit`` of every fused weight of a megatron-core model, by parameter name.

    Modules are recognised by megatron-core's attributes, so the local and Transformer Engine specs
    (whose fused linears keep the names ``linear_qkv`` / ``linear_fc1``) are both covered. A weight
    whose rows do not fit the expected layout exactly (e.g. with an attention output gate, or with
    TP larger than the number of query groups) raises a one-line ConfigError instead of being split
    wrongly.
    """
    layouts: dict[str, RowSplit] = {}
    for prefix, module in model.named_modules():
        splits = {}
        if getattr(module, "linear_qkv", None) is not None \
                and hasattr(module, "num_query_groups_per_partition"):
            splits["linear_qkv"] = lambda rows, m=module: _qkv_split(m)
        if getattr(module, "linear_kv_global", None) is not None:
            splits["linear_kv_global"] = lambda rows, m=module: _global_kv_split(m)
        if getattr(module, "linear_fc1", None) is not None \
                and getattr(getattr(module, "config", None), "gated_linear_unit", False):
            splits["linear_fc1"] = _gated_fc1_split
        for linear_name, split_of in splits.items():
            for name, param in getattr(module, linear_name).named_parameters(recurse=False):
                if param.ndim != 2:
                    continue
                full_name = ".".join(p for p in (prefix, linear_name, name) if p)
                split, units = split_of(param.shape[0])
                sizes = [size for _, _, size in split.parts]
                if (param.shape[0] != units * split.period or sum(sizes) != split.period
                        or min(sizes) < 1):
                    raise config_error(
                        f"ALRS cannot split {full_name} (shape {tuple(param.shape)}) into "
                        f"{[p for p, _, _ in split.parts]}: expected {units} x {split.period} "
                        "rows; set alrs.granularity=parameter")
                layouts[full_name] = split
    return layouts


def weight_blocks(named_parameters: Iterable[tuple[str, torch.Tensor]],
                  layouts: dict[str, RowSplit] | None = None, exclude: Iterable[str] = (),
                  tp_size: int = 1) -> list[WeightBlock]:
    """The blocks of the 2-D weights, each physical tensor once, in first-seen order.

    ``layouts`` splits fused weights (``fused_layouts``; empty: whole-parameter granularity);
    parameters whose name contains a substring of ``exclude`` are left out. megatron-core marks
    TP-sharded parameters ``tensor_model_parallel`` with a ``partition_dim``, which sets the full
    shape. ``nn.Module.named_parameters`` already yields a shared Parameter once; tensors seen twice
    from another iterable are skipped here as well.
    """
    layouts = layouts or {}
    exclude = tuple(exclude)
    seen, out = set(), []
    for name, param in named_parameters:
        if id(param) in seen or param.ndim != 2 or any(s in name for s in exclude):
            continue
        seen.add(id(param))
        dim = None
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            dim = int(param.partition_dim)
        rows, cols = param.shape
        cols = cols * tp_size if dim == 1 else cols
        split = layouts.get(name)
        if split is None:
            out.append(WeightBlock(name, name, (rows * tp_size if dim == 0 else rows, cols), dim))
            continue
        for part, start, size in split.parts:
            part_rows = rows // split.period * size * (tp_size if dim == 0 else 1)
            out.append(WeightBlock(f"{name}:{part}", name, (part_rows, cols), dim,
                                   (split.period, start, size)))
    return out
