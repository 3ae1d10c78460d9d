"""``megaloop-train --dry-run``: what a launch would do, without process groups or a model.

It prints the resolved config, the rank layout (which rank holds which tensor-parallel shard,
pipeline stage and data-parallel replica, in megatron-core's rank order, and what each stage
holds, and under pipeline parallelism each stage's compute against the ideal and the bubble) and
the per-GPU memory estimate with the verdict for the GPU's memory and, when it does
not fit, the cheapest layouts that would.
"""

from __future__ import annotations

import os

from megaloop.config import DataConfig, RunConfig, dump_yaml, micro_batches_per_step, to_dict
from megaloop.models.pipeline import describe_split, stage_counts
from megaloop.platform.fp8 import check_fp8_shapes
from megaloop.scale.layout import Layout, layout_of, rank_coordinates, stage_layout
from megaloop.scale.memory import GIB, OVERHEADS, estimate, fitting_layouts

_FULL_TABLE_RANKS = 64  # larger worlds print their first two and last node only


def rank_table(layout: Layout, gpus_per_node: int) -> list[str]:
    """One line per rank: node, local GPU, tensor-parallel rank, stage, data/expert rank."""
    coords = rank_coordinates(layout)
    ranks = list(range(layout.world_size))
    if layout.world_size > _FULL_TABLE_RANKS:
        ranks = ranks[:2 * gpus_per_node] + [None] + ranks[-gpus_per_node:]
    lines = ["rank  node  gpu  tp    stage  dp      ep"]
    for rank in ranks:
        if rank is None:
            lines.append("  ...")
            continue
        c = coords[rank]
        tp, dp = f"{c['tp']}/{layout.tensor}", f"{c['dp']}/{layout.data}"
        lines.append(f"{rank:<5d} {rank // gpus_per_node:<5d} {rank % gpus_per_node:<4d} "
                     f"{tp:<5s} {c['pp']:<6d} {dp:<7s} {c['ep']}/{layout.expert}")
    return lines


def data_files(data: DataConfig) -> list[str]:
    """The files ``data.path`` names: each prefix's .bin and .idx (blend weights left out), or the
    record files of ``data.format=sft``."""
    from megaloop.data import parse_blend

    if data.format == "sft":
        return list(data.path)
    return [f"{prefix}{suffix}" for prefix in parse_blend(data.path)[0]
            for suffix in (".bin", ".idx")]


def processes_per_node(environ=None) -> int:
    """The processes a node runs, for the rank table's node and GPU columns: ``LOCAL_WORLD_SIZE``
    as torchrun sets it (slurm/common.sh sets it to GPUS_PER_NODE for its dry run), else 8."""
    from megaloop.config import ConfigError

    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "8")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE={value!r}: must be the processes per node, an integer "
                          ">= 1")
    return int(value)


def report(cfg: RunConfig, world_size: int, gpus_per_node: int | None = None,
           gpu_memory_gib: float = 80.0) -> str:
    """The dry-run text for ``cfg`` launched on ``world_size`` processes, ``gpus_per_node`` of them
    on each node (default: ``processes_per_node()``). Raises ConfigError for
    what the run would refuse at start-up without reading the data: a layout the world cannot
    hold, a global batch that does not split into its micro-batches, a tokenizer larger than
    ``model.vocab_size`` or that cannot be loaded, a ``data.eod_id`` no token can have, a
    malformed ``data.path`` blend, FP8 with sizes its GEMMs refuse. A tokenizer or data file
    absent here (a cluster recipe sized on another machine) is noted, not refused."""
    from megaloop.training.data import dataset_tokenizer

    gpus_per_node = gpus_per_node or processes_per_node()
    layout = layout_of(cfg.parallel, world_size)
    check_fp8_shapes(cfg)  # sizes Transformer Engine's FP8 GEMMs refuse
    tokenizer = cfg.data.tokenizer_model
    notes = []
    if tokenizer is None or os.path.exists(tokenizer):
        dataset_tokenizer(cfg)  # or, without a tokenizer, the data.eod_id check
    else:
        notes.append(f"# note: data.tokenizer_model {tokenizer} is not on this machine; "
                     "model.vocab_size is checked against it at start-up")
    absent = [path for path in data_files(cfg.data) if not os.path.exists(path)]
    if absent:
        notes.append(f"# note: data.path {', '.join(absent)} {'is' if len(absent) == 1 else 'are'}"
                     " not on this machine; the data are checked at start-up")
    micro = micro_batches_per_step(cfg.train, cfg.parallel, layout.data)
    modules = cfg.parallel.selective_modules
    selective = f" ({', '.join(modules)} of every layer)" if modules else ""
    lines = ["# resolved config", dump_yaml(to_dict(cfg)).rstrip(), "",
             f"# rank layout: {world_size} ranks = tensor {layout.tensor} x pipeline "
             f"{layout.pipeline} x data {layout.data} (expert {layout.expert} within data); "
             f"sequence parallel {'on' if layout.sequence_parallel else 'off'}, recompute "
             f"{cfg.parallel.recompute}{selective}; {micro} micro-batches of "
             f"{cfg.train.micro_batch_size} "
             f"per step and data-parallel rank; {gpus_per_node} GPUs per node"] + notes
    if layout.pipeline > 1:
        lines += describe_split(cfg.model, stage_counts(cfg.model, cfg.parallel),
                                layout.pipeline, micro, not cfg.parallel.pipeline_split,
                                cfg.parallel.recompute, modules)
    else:
        lines.append(f"stage 0: {stage_layout(cfg.model, cfg.parallel)[0].describe()}")
    lines += rank_table(layout, gpus_per_node)

    device_bytes = int(gpu_memory_gib * GIB)
    mem = estimate(cfg, layout)
    overhead = OVERHEADS[mem.device]
    lines += ["", f"# memory per GPU (busiest stage {mem.stage}; GiB)",
              "  ".join(f"{k} {v}" for k, v in mem.as_dict().items() if k != "stage"),
              f"with allocator slack x{overhead.slack} and {overhead.fixed / GIB:.0f} GiB for the "
              f"CUDA context and NCCL: {mem.needed / GIB:.1f} of {gpu_memory_gib:g} GiB -> "
              + ("fits" if mem.fits(device_bytes) else "DOES NOT FIT")]
    fitting = fitting_layouts(cfg, world_size, device_bytes)
    if fitting:
        cheapest = ", ".join(f"{found.name} ({est.total / GIB:.1f} GiB)"
                             for found, est in fitting[:3])
        lines.append(f"cheapest layouts that fit {world_size} GPUs of {gpu_memory_gib:g} GiB: "
                     f"{cheapest}")
    else:
        lines.append(f"no tensor/pipeline/recompute layout of {world_size} GPUs fits "
                     f"{gpu_memory_gib:g} GiB: use more GPUs or a smaller micro-batch")
    return "\n".join(lines)
