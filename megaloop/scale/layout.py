"""Parallel layouts: written as short strings, checked against a world size, laid out over ranks.

A layout string lists its parallel dimensions, comma-separated, in any order:

    "dp2"        2 data-parallel replicas          "tp2,sp"     tensor parallel + sequence parallel
    "pp2"        2 pipeline stages                 "ep2"        2 expert-parallel ranks (MoE)
    "tp2,pp2"    4 ranks                           "recompute"  full activation recomputation
    "pp2,vp2"    2 pipeline ranks, 2 model chunks each (the interleaved schedule)
    "selrecompute"  selective recomputation (the config's parallel.recompute_modules, else core
                 attention)
    "single"     one process (also "")

The data-parallel size is what the ranks leave over (``world = tp * pp * dp``); expert parallelism
is carved out of the data-parallel and tensor ranks as megatron-core does, so "ep2" alone means
two data-parallel ranks that split the experts. Which rank holds what follows megatron-core's
rank order ("tp-cp-ep-dp-pp": tensor-parallel ranks adjacent, pipeline stages farthest apart), by
its own ``RankGenerator``, without process groups.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from megaloop.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from megaloop.config.errors import divisors_text
from megaloop.models.pipeline import Stage, plan_stages, stage_counts

MCORE_RANK_ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default, which init_distributed uses
_PART = re.compile(r"^(tp|pp|dp|ep|vp)(\d+)$")
_FLAGS = {"sp": "sequence_parallel"}
# Layout flag -> parallel.recompute; at most one of them.
_RECOMPUTE_FLAGS = {"recompute": "full", "selrecompute": "selective"}


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # parallel.recompute: none, full or selective
    virtual: int = 1  # model chunks per pipeline rank

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def name(self) -> str:
        parts = [f"{key}{value}" for key, value in (("tp", self.tensor), ("pp", self.pipeline),
                                                    ("vp", self.virtual), ("dp", self.data),
                                                    ("ep", self.expert))
                 if value > 1]
        parts += [flag for flag, field in _FLAGS.items() if getattr(self, field)]
        parts += [flag for flag, mode in _RECOMPUTE_FLAGS.items() if self.recompute == mode]
        return ",".join(parts) or "single"

    def settings(self, pipeline_split: list[int] | None = None,
                 recompute_modules: list[str] | None = None) -> dict:
        """The parallel fields a layout decides (``LAYOUT_FIELDS``), by name."""
        return dict(tensor=self.tensor, pipeline=self.pipeline, expert=self.expert,
                    sequence_parallel=self.sequence_parallel, recompute=self.recompute,
                    recompute_modules=list(recompute_modules or []),
                    virtual_pipeline=self.virtual, pipeline_split=list(pipeline_split or []))

    def parallel_config(self, pipeline_split: list[int] | None = None,
                        recompute_modules: list[str] | None = None) -> ParallelConfig:
        return ParallelConfig(**self.settings(pipeline_split, recompute_modules))

    def apply(self, cfg: RunConfig) -> RunConfig:
        """A copy of ``cfg`` with this layout's parallel fields (``LAYOUT_FIELDS``); ``cfg``'s
        ``parallel.pipeline_split`` is kept when it has one count per stage of this layout, its
        ``parallel.recompute_modules`` when both recompute selectively, and its other parallel
        settings (data-parallel overlap, timeout) as they are: the run under this layout is
        ``cfg``'s, and the checks of those settings that depend on the layout apply to it."""
        split = cfg.parallel.pipeline_split
        keep = self.pipeline > 1 and len(split) == self.pipeline * self.virtual
        modules = (cfg.parallel.recompute_modules
                   if self.recompute == cfg.parallel.recompute == "selective" else None)
        return dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, **self.settings(split if keep else None, modules)))


# The ParallelConfig fields a Layout decides; Layout.apply keeps the others of a config.
LAYOUT_FIELDS = tuple(Layout().settings())


def parse_layout(text: str) -> Layout:
    """Parses a layout string (see the module docstring); mistakes are one-line ConfigErrors."""
    sizes = {"tp": 1, "pp": 1, "dp": None, "ep": 1, "vp": 1}
    flags = dict.fromkeys(_FLAGS.values(), False)
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    # "tp2,tp4" kept the last size without a word; a dimension or flag is given once.
    keys = [match.group(1) if (match := _PART.match(part)) else part for part in parts]
    twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    if twice is not None:
        raise ConfigError(f"layout {text!r}: {twice!r} given twice (one size per dimension)")
    recompute = [part for part in parts if part in _RECOMPUTE_FLAGS]
    if len(recompute) > 1:
        raise ConfigError(f"layout {text!r}: {' and '.join(recompute)} together (one "
                          "recomputation: 'recompute' full, 'selrecompute' selective)")
    for part in parts:
        match = _PART.match(part)
        if part in ("single", "1") and len(parts) == 1:
            continue
        if part in _FLAGS:
            flags[_FLAGS[part]] = True
        elif part in _RECOMPUTE_FLAGS:
            flags["recompute"] = _RECOMPUTE_FLAGS[part]
        elif match and int(match.group(2)) >= 1:
            sizes[match.group(1)] = int(match.group(2))
        else:
            raise ConfigError(f"layout {text!r}: unknown part {part!r} (known: tpN, ppN, vpN, "
                              "dpN, epN, sp, recompute, selrecompute, single; e.g. 'tp2,sp' or "
                              "'dp2,pp2')")
    tp, ep = sizes["tp"], sizes["ep"]
    # megatron-core builds expert groups of (expert tensor = tp) x ep ranks out of the tp x dp
    # ranks of a stage: dp must be a multiple of ep.
    dp = sizes["dp"] if sizes["dp"] is not None else ep
    if dp % ep:
        raise ConfigError(f"layout {text!r}: ep{ep} needs a data-parallel size that is a multiple "
                          f"of {ep} (got dp{dp}; e.g. dp{ep * math.ceil(dp / ep)})")
    return Layout(tensor=tp, pipeline=sizes["pp"], data=dp, expert=ep, virtual=sizes["vp"],
                  **flags)


def layout_of(parallel: ParallelConfig, world_size: int) -> Layout:
    """The layout a run with this parallel section has on ``world_size`` processes."""
    check_world_size(parallel, world_size)
    return Layout(tensor=parallel.tensor, pipeline=parallel.pipeline,
                  data=world_size // (parallel.tensor * parallel.pipeline),
                  expert=parallel.expert, sequence_parallel=parallel.sequence_parallel,
                  recompute=parallel.recompute, virtual=parallel.virtual_pipeline)


def check_world_size(parallel: ParallelConfig, world_size: int) -> None:
    """One ConfigError line when the parallel sizes do not fit ``world_size`` processes, naming the
    numbers and what would fit."""
    model_parallel = parallel.tensor * parallel.pipeline
    if world_size % model_parallel:
        lower = world_size - world_size % model_parallel
        fits = f"{lower} or {lower + model_parallel}" if lower else f"{model_parallel}"
        raise ConfigError(
            f"parallel.tensor={parallel.tensor} x parallel.pipeline={parallel.pipeline} = "
            f"{model_parallel} does not divide the world size {world_size}: launch a multiple of "
            f"{model_parallel} processes (e.g. {fits}) or choose tensor x pipeline among the "
            f"divisors of {world_size} ({divisors_text(world_size)})")
    data = world_size // model_parallel
    if parallel.expert > 1 and data % parallel.expert:
        raise ConfigError(
            f"parallel.expert={parallel.expert} does not divide the data-parallel size {data} "
            f"(world size {world_size} / tensor {parallel.tensor} / pipeline "
            f"{parallel.pipeline}): expert parallelism splits the data-parallel ranks; use "
            f"expert in ({divisors_text(data)})")


# --------------------------------------------------------------------------------------------
# which rank holds what
# --------------------------------------------------------------------------------------------

def stage_layout(model: ModelConfig, parallel: ParallelConfig) -> list[Stage]:
    """The pipeline stages LoopedLM builds for ``parallel`` (megaloop.models.pipeline): the
    model's chain of layer applications cut by ``parallel.pipeline_split`` or the balanced split."""
    return plan_stages(model, stage_counts(model, parallel))


def rank_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """The rank groups megatron-core's initialize_model_parallel builds for ``layout``: "tp",
    "pp", "dp" (decoder) and "ep" (expert), each a list of rank lists."""
    from megatron.core.parallel_state import RankGenerator

    decoder = RankGenerator(tp=layout.tensor, ep=1, dp=layout.data, pp=layout.pipeline, cp=1,
                            order=MCORE_RANK_ORDER)
    expert = RankGenerator(tp=layout.tensor, ep=layout.expert,
                           dp=layout.data // layout.expert, pp=layout.pipeline, cp=1,
                           order=MCORE_RANK_ORDER)
    return {"tp": decoder.get_ranks("tp"), "pp": decoder.get_ranks("pp"),
            "dp": decoder.get_ranks("dp"), "ep": expert.get_ranks("ep")}


def rank_coordinates(layout: Layout) -> list[dict[str, int]]:
    """For every rank: its index inside its tp, pp (= stage), dp and ep group."""
    coords = [{} for _ in range(layout.world_size)]
    for kind, groups in rank_groups(layout).items():
        for group in groups:
            for index, rank in enumerate(group):
                coords[rank][kind] = index
    return coords
