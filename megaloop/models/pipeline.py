"""Pipeline stages of a looped model: its chain of layer applications, cut into contiguous pieces.

A forward pass of Dense, Full Loop and AsymLoop is one chain of J = E + K·D layer applications
(Dense: E = 0, K = 1; Full Loop: E = 0, K = R):

    embedding -> encoder 1..E -> decoder 1..D (iteration 1) -> ... -> decoder 1..D (iteration K)
              -> final norm + head

megatron-core's pipeline schedules are a linear chain of stages, and so is this: stage s runs
``counts[s]`` consecutive applications of the chain (``parallel.pipeline_split``, or the split
``balanced_split`` picks). The loop is unrolled over the stages: a stage holds every physical
layer it runs, an encoder layer once, a decoder layer once however many of its iterations the
stage runs. A decoder layer that several stages run is held by each of them: those copies are tied
(megaloop.training.tied keeps them equal: same initial values, gradients summed over the copies,
identical updates; checkpoints hold one). With the interleaved schedule the chain is cut into
pipeline x virtual stages; virtual stage v * P + p is model chunk v on pipeline rank p.

What travels between stages is one tensor per micro-batch, since megatron-core sends one: the
residual stream [N, B, h]; and once the encoder has run, if the decoder reads the encoder output
(AsymLoop's Global KV, or its additive injection), the stream and H_E stacked along the sequence,
[2N, B, h]. Every stage holding decoder layers projects their Global KV from H_E itself, once per
forward pass (2 * d * 2g FLOPs per token and layer, where shipping the Global KV of every decoder
layer instead would send D x 2g channels per token), and the gradients that reach H_E on every
stage flow back along the chain to the encoder. The non-interleaved schedule takes a shape per
stage boundary; the interleaved one a single shape, so there every message has the stacked shape,
with zeros in place of H_E before the encoder has finished.

Costs for balancing come from megaloop.models.flops: training FLOPs (forward + executed backward)
per layer application, per Global KV projection and for the head; the embedding is a lookup (no
matmul FLOPs) and norms and the loss are left out, as in the MFU convention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from megaloop.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class LayerRun:
    """Physical layers ``first``..``last`` of ``block`` ("encoder" or "decoder", the looped block
    of every architecture), run in order once; ``step``: the decoder iteration (0: the encoder)."""

    block: str
    first: int
    count: int
    step: int = 0

    @property
    def last(self) -> int:
        return self.first + self.count - 1


@dataclass(frozen=True)
class Stage:
    """What one (virtual) pipeline stage runs and holds."""

    index: int
    start: int  # its first application in the chain
    runs: tuple[LayerRun, ...]
    embedding: bool
    head: bool  # final norm + output layer
    global_kv: bool  # projects the Global KV of the decoder layers it holds
    receives_encoding: bool  # its input message carries H_E after the stream
    sends_encoding: bool
    looped: bool = True  # the model iterates (K > 1): runs name their iteration
    # LatentLoop (one stage): its encoder and decoder runs are the prelude and the middle block's
    # visits, and it holds the coda's layers, which run after the chain
    latent: bool = False
    coda: int = 0

    @property
    def applications(self) -> int:
        return sum(run.count for run in self.runs)

    def held(self, block: str) -> tuple[int, ...]:
        """The physical layers of ``block`` this stage holds, ascending."""
        return tuple(sorted({n for run in self.runs if run.block == block
                             for n in range(run.first, run.last + 1)}))

    @property
    def global_kv_layers(self) -> int:
        return len(self.held("decoder")) if self.global_kv else 0

    def describe(self) -> str:
        """e.g. "Global KV of 2 layers, decoder layers 1-2 (iteration 3), final norm + head"."""
        parts = ["embedding"] if self.embedding else []
        merged = []  # the same layers in consecutive iterations as one entry: [run, last step]
        for run in self.runs:
            previous = merged[-1][0] if merged else None
            if previous is not None and previous.block == run.block == "decoder" and \
                    (previous.first, previous.count) == (run.first, run.count) and \
                    merged[-1][1] + 1 == run.step:
                merged[-1][1] = run.step
            else:
                merged.append([run, run.step])
        blocks = [run.block for run, _ in merged]
        first_decoder = blocks.index("decoder") if "decoder" in blocks else None
        for position, (run, last_step) in enumerate(merged):
            if position == first_decoder and self.global_kv_layers:
                count = self.global_kv_layers
                parts.append(f"Global KV of {count} layer{'s' if count > 1 else ''}")
            layers = (f"layer {run.first}" if run.count == 1
                      else f"layers {run.first}-{run.last}")
            step = "visit" if self.latent else "iteration"
            steps = (f"{step} {run.step}" if last_step == run.step
                     else f"{step}s {run.step}-{last_step}")
            block = ({"encoder": "prelude", "decoder": "middle"}[run.block] if self.latent
                     else run.block)
            parts.append(f"{block} {layers}" + (f" ({steps})" if run.step and self.looped
                                                else ""))
        if self.coda:
            parts.append("coda layer 1" if self.coda == 1 else f"coda layers 1-{self.coda}")
        if self.head:
            parts.append("final norm + head")
        return ", ".join(parts)


def chain_length(model: ModelConfig) -> int:
    """J: layer applications per forward pass."""
    model = dataclasses.replace(model).resolve()
    return model.num_encoder_layers + model.num_iterations * model.num_decoder_layers


def reads_encoding(model: ModelConfig) -> bool:
    """Whether decoder layers read the encoder output H_E (so that it travels with the stream)."""
    return model.arch == "asymloop" and model.injection in ("global_kv", "additive")


def _runs(model: ModelConfig, start: int, stop: int) -> tuple[LayerRun, ...]:
    """Applications [start, stop) of the chain as runs of consecutive layers."""
    enc, dec = model.num_encoder_layers, model.num_decoder_layers
    runs, position = [], start
    while position < stop:
        if position < enc:
            end = min(stop, enc)
            runs.append(LayerRun("encoder", position + 1, end - position))
        else:
            step, offset = divmod(position - enc, dec)
            end = min(stop, enc + (step + 1) * dec)
            runs.append(LayerRun("decoder", offset + 1, end - position, step + 1))
        position = end
    return tuple(runs)


def _stage(model: ModelConfig, index: int, start: int, stop: int, last: bool) -> Stage:
    runs = _runs(model, start, stop)
    travels = reads_encoding(model)
    return Stage(index=index, start=start, runs=runs, embedding=start == 0, head=last,
                 global_kv=model.uses_global_kv and any(r.block == "decoder" for r in runs),
                 receives_encoding=travels and start > 0 and start >= model.num_encoder_layers,
                 sends_encoding=travels and not last and stop >= model.num_encoder_layers,
                 looped=model.num_iterations > 1, latent=model.arch == "latentloop",
                 coda=model.num_coda_layers if last else 0)


def plan_stages(model: ModelConfig, counts: list[int]) -> list[Stage]:
    """The stages of the chain cut into pieces of ``counts`` applications (assumed valid:
    ``check_split``)."""
    model = dataclasses.replace(model).resolve()
    stages, start = [], 0
    for index, count in enumerate(counts):
        stages.append(_stage(model, index, start, start + count, index == len(counts) - 1))
        start += count
    return stages


# -------------------------------------------------------------------------------------- costs

@dataclass(frozen=True)
class StageCosts:
    """Training FLOPs per token of the model's parts (megaloop.models.flops), for balancing."""

    encoder: Fraction  # one encoder layer application
    decoder: Fraction  # one decoder layer application
    global_kv: Fraction  # one decoder layer's Global KV projection, once per stage holding it
    head: Fraction

    def of(self, stage: Stage) -> Fraction:
        cost = self.head if stage.head else Fraction(0)
        cost += stage.global_kv_layers * self.global_kv
        for run in stage.runs:
            cost += run.count * (self.encoder if run.block == "encoder" else self.decoder)
        return cost


def stage_costs(model: ModelConfig, recompute: str = "none",
                modules: Sequence[str] = ("core_attn",)) -> StageCosts:
    """Forward + backward (+ the recomputed forward) FLOPs per token: matmuls 3x their forward,
    flash attention 3.5x (its backward recomputes the scores). ``recompute`` as parallel.recompute
    and ``modules`` its selective_modules, replayed as megaloop.models.flops
    executed_backward_flops counts them: full recomputation replays the layers (+1x) but not the
    Global KV projection or the head; selective recomputation replays each named module of every
    layer application (core_attn its attention term, mlp / moe / shared_experts their FFN's)."""
    from megaloop.models.flops import layer_application_flops

    model = dataclasses.replace(model).resolve()
    full = recompute == "full"
    selective = modules if recompute == "selective" else ()

    def train(matmul, attention, replayed):
        if full:
            replayed = matmul + attention
        return 3 * Fraction(matmul) + Fraction(7, 2) * Fraction(attention) + replayed

    encoder = train(*layer_application_flops(model, "encoder", selective))
    decoder = train(*layer_application_flops(model, "decoder", selective))
    g = model.num_query_groups * model.kv_channels
    global_kv = 3 * Fraction(2 * model.hidden_size * 2 * g) if model.uses_global_kv else Fraction(0)
    return StageCosts(encoder, decoder, global_kv, 3 * Fraction(2 * model.hidden_size
                                                                * model.vocab_size))


# The dry run's layout search asks for the same few splits once per layout and stage; each is a
# search over every cut of the chain (about 0.1 s for the 7B preset).
_SPLITS: dict[tuple, tuple[int, ...]] = {}
_SPLITS_KEPT = 64


def balanced_split(model: ModelConfig, stages: int, recompute: str = "none",
                   modules: Sequence[str] = ("core_attn",)) -> list[int]:
    """Per-stage application counts with the smallest slowest-stage cost and, among those, the
    smallest sum of squared stage costs (the even spread of the rest)."""
    model = dataclasses.replace(model).resolve()
    total = chain_length(model)
    if not 1 <= stages <= total:
        raise ConfigError(f"{stages} pipeline stages: a model of {total} layer applications "
                          f"(E + K x D) fits 1 to {total} stages")
    key = (repr(model), stages, recompute, tuple(modules))
    if key not in _SPLITS:
        if len(_SPLITS) >= _SPLITS_KEPT:
            _SPLITS.clear()
        costs = stage_costs(model, recompute, modules)
        _SPLITS[key] = tuple(_search_split(model, total, stages, costs))
    return list(_SPLITS[key])


def _search_split(model: ModelConfig, total: int, stages: int, costs: StageCosts) -> list[int]:
    # cost[a, b]: one stage running applications [a, b) (the last one also the head).
    cost = {(a, b): costs.of(_stage(model, 0, a, b, b == total))
            for a in range(total) for b in range(a + 1, total + 1)}

    def best(score, combine, limit=None):
        # table[s][b]: the best cut of applications [0, b) into s + 1 stages, and its last cut.
        table = [{b: (score(cost[0, b]), 0) for b in range(1, total + 1)
                  if limit is None or cost[0, b] <= limit}]
        for s in range(1, stages):
            row = {}
            for b in range(s + 1, total + 1):
                options = [(combine(table[s - 1][a][0], score(cost[a, b])), a)
                           for a in range(s, b) if a in table[s - 1]
                           and (limit is None or cost[a, b] <= limit)]
                if options:
                    row[b] = min(options)
            table.append(row)
        counts, b = [], total
        for s in range(stages - 1, -1, -1):
            a = table[s][b][1]
            counts.append(b - a)
            b = a
        return table[-1][total][0], counts[::-1]

    slowest, _ = best(lambda c: c, max)
    return best(lambda c: c * c, lambda x, y: x + y, limit=slowest)[1]


def stage_counts(model: ModelConfig, parallel) -> list[int]:
    """Layer applications per stage of ``parallel`` (a ParallelConfig): its ``pipeline_split``, or
    the balanced split."""
    if parallel.pipeline_split:
        return list(parallel.pipeline_split)
    return balanced_split(model, parallel.pipeline_stages, parallel.recompute,
                          parallel.selective_modules)


def check_split(model: ModelConfig, counts: list[int], stages: int, field: str) -> None:
    """One ConfigError line naming ``field`` unless ``counts`` cuts the chain into ``stages``
    pieces of at least one application each."""
    total = chain_length(model)
    if len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == total:
        return
    resolved = dataclasses.replace(model).resolve()
    parts = {"dense": f"num_layers {resolved.num_layers}",
             "fullloop": f"R {resolved.num_iterations} x L {resolved.num_layers}",
             "asymloop": f"E {resolved.num_encoder_layers} + K {resolved.num_iterations} x D "
                         f"{resolved.num_decoder_layers}"}.get(resolved.arch, "")
    hint = (f"; e.g. {balanced_split(model, stages)} (balanced)" if stages <= total
            else f" (at most {total} stages)")
    raise ConfigError(f"{field}={counts!r}: must be {stages} per-stage counts of layer "
                      f"applications, each >= 1, summing to {total} = {parts}{hint}")


# ------------------------------------------------------------------------------------ balance

@dataclass(frozen=True)
class Balance:
    """A split's compute balance: each stage's cost against the ideal (the whole model's cost
    over the stages) and the pipeline bubble of the schedule."""

    counts: tuple[int, ...]
    relative: tuple[float, ...]  # stage cost / ideal
    bubble: float  # idle fraction of a step: 1 - useful work / (ranks x step time)

    @property
    def slowest(self) -> float:
        return max(self.relative)


def balance(model: ModelConfig, counts: list[int], pipeline: int, micro_batches: int,
            recompute: str = "none", modules: Sequence[str] = ("core_attn",)) -> Balance:
    """Balance of ``counts`` over ``pipeline`` ranks (``len(counts) // pipeline`` chunks each) at
    ``micro_batches`` micro-batches per step. The step time under 1F1B is taken as
    (M * V + P - 1) slots of the slowest chunk; the ideal is a P-th of the unsplit model's work."""
    model = dataclasses.replace(model).resolve()
    costs = stage_costs(model, recompute, modules)
    ideal = costs.of(plan_stages(model, [chain_length(model)])[0]) / len(counts)
    stage_cost = [costs.of(s) for s in plan_stages(model, counts)]
    chunks = len(counts) // pipeline
    step = (micro_batches * chunks + pipeline - 1) * max(stage_cost)
    useful = micro_batches * chunks * ideal
    return Balance(tuple(counts), tuple(float(c / ideal) for c in stage_cost),
                   float(1 - useful / step))


def describe_split(model: ModelConfig, counts: list[int], pipeline: int, micro_batches: int,
                   chosen: bool, recompute: str = "none",
                   modules: Sequence[str] = ("core_attn",)) -> list[str]:
    """Lines for logs and the dry run: the split, its balance and bubble, each stage's contents."""
    found = balance(model, counts, pipeline, micro_batches, recompute, modules)
    origin = "balanced by the layout chooser" if chosen else "parallel.pipeline_split"
    lines = [f"pipeline split {list(counts)} ({origin}): slowest stage {found.slowest:.2f} x "
             f"ideal, bubble {found.bubble:.0%} at {micro_batches} micro-batches per step"]
    for stage, relative in zip(plan_stages(model, counts), found.relative):
        # "pipeline rank": beside the dry run's table of global ranks, a bare "rank" misleads
        # under tensor or data parallelism (stage 1 of tp2,pp2 is ranks 2 and 3).
        rank = f"pipeline rank {stage.index % pipeline}" + (
            f" chunk {stage.index // pipeline}" if len(counts) > pipeline else "")
        lines.append(f"stage {stage.index} ({rank}, {relative:.2f} x ideal): {stage.describe()}")
    return lines


def schedule_shapes(model, seq_length: int, pipeline: int, chunks: int = 1) -> dict:
    """The message shapes megatron-core's schedules send between the stages of ``model`` (one
    LoopedLM stage): the sequence length and, for the non-interleaved schedule, one per stage
    boundary ([stream; H_E] has twice the sequence)."""
    stage = model.stage
    if model.padded_messages:  # the interleaved schedule: one shape
        return {"seq_length": 2 * seq_length}
    if pipeline == 1 or chunks > 1:
        return {"seq_length": seq_length}

    def stacked(shapes, doubled):
        return [(length * (2 if doubled else 1), *rest) for length, *rest in shapes]

    return {"seq_length": seq_length,
            "adjust_tensor_shapes_fn": lambda recv, send: (
                stacked(recv, stage.receives_encoding), stacked(send, stage.sends_encoding))}
