"""Per-GPU memory of a training run: parameters, gradients, optimizer states and activations.

The estimate counts the bytes of live tensors on the busiest rank at the peak of a training step,
what a CUDA caching allocator reports as "allocated"; what the process holds besides (a GPU's CUDA
context and NCCL buffers, a CPU process's libraries) and the allocator's slack come on top, by device
(``OVERHEADS``, in ``MemoryEstimate.needed`` and the fit decision).

Resident between steps, per parameter held by the rank (tensor-parallel shard of its stage):
    weights    4 bytes (fp32) or 2 (bf16, fp8: Transformer Engine keeps bf16 weights) + 2 with fp8
               (the FP8 weight copies, row- and column-wise);
    gradients  4 (megaloop reduces gradients in fp32);
    optimizer  Adam moments 8, + 4 for fp32 main weights when the weights are bf16; divided by
               the data-parallel size with the distributed optimizer.
A MoE FFN: its router on every tensor-parallel rank, the experts split over the expert-parallel
ranks; with the distributed optimizer the experts' state is divided by the ranks holding the same
experts (data-parallel size / expert-parallel size). LatentLoop (one stage) adds its coda, untied
visit parts and reduction parameters.
Activations of one micro-batch of B sequences of N tokens, per layer application (a looped layer
saves its activations once per iteration, K times; a LatentLoop visit those of its reduced
block, on 1/k of the tokens when compressed), by the tensors autograd keeps for the backward pass
in megatron-core's layers, in ``_layer_saved`` below (a MoE FFN: each token's top-k experts).
Tensors laid out over the sequence (norm inputs and outputs, residuals) are split over the
tensor-parallel ranks only with sequence parallelism; attention and FFN tensors are split over
heads and FFN columns always.
With full recomputation a layer application keeps only its input, and one layer's activations
are rebuilt at a time. Selective recomputation of the core attention (``core_attn``, megatron-core's
default) drops what the core attention keeps beyond its inputs (``_core_attention_saved``: the
[N, 2N] probabilities of the masked joint attention, Korthikanti et al.'s 5as/h term; with flash
kernels only their output, log-sum-exps and repeated keys/values, while the values' view then keeps
the fused QKV output: little or nothing saved, as megatron-core warns); ``mlp``, ``moe`` and
``shared_experts`` drop their FFN tensors (``_replayable_saved``). Each replayed module is rebuilt
one call at a time (the largest of them in the working memory). AsymLoop's Global
KV (once per forward) stays saved, whatever the recomputation. Pipeline stage s of P under 1F1B
holds the activations of min(P - s, M) micro-batches (the interleaved schedule: its warm-up count
of chunk-micro-batches, at the chunks' mean).
The head adds the fp32 softmax megatron-core's vocab-parallel cross-entropy keeps (N x V / TP),
and, in bf16, the logits while it runs (in fp32 it works on them in place).

The element counts of ``_layer_saved`` follow megatron-core's local (CPU) layers, and are checked
against measured CPU training steps in the tests; the Transformer Engine variant differs where TE
saves less (a fused norm + linear keeps the norm's input and output, not its normalised input; its
attention takes grouped keys as they are) and with FP8, where linear inputs are kept in one byte.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from megaloop.config import ModelConfig, RunConfig, micro_batches_per_step
from megaloop.platform.fp8 import check_fp8_shapes
from megaloop.scale.layout import Layout, Stage, stage_layout

GIB = 1024**3
# Cheapest first: selective recomputation replays the core attention, full the whole layer.
RECOMPUTE_COST_ORDER = ("none", "selective", "full")


class Overhead(NamedTuple):
    """What a process needs besides its live tensors: ``fixed`` bytes, and ``slack``, the
    allocator's bytes per live tensor byte at the peak."""

    fixed: int
    slack: float


OVERHEADS = {
    # CUDA context, NCCL communicators, cuBLAS / cuDNN workspaces; caching-allocator slack.
    "gpu": Overhead(3 * GIB, 1.10),
    # No CUDA context. Measured here (VmRSS / VmHWM of /proc/self/status, OMP_NUM_THREADS 1 and 2):
    # a process that has imported torch, megatron-core and megaloop's Trainer and initialised gloo
    # and megatron-core's groups (init_distributed) holds 0.36 GiB; a built Trainer ~0.1 GiB more
    # than its weights and gradients (data indices, buffers' bookkeeping): 0.5 GiB. The peak RSS
    # of CPU training steps (asymloop, hidden 512-1024, 4-8 layers, 512-1024 tokens, micro-batch
    # 2-4, 3-8 steps) above that idle process was 1.43x to 1.63x the estimate's total, 1.2 to
    # 4.1 GiB (glibc's malloc keeps the memory of freed tensors for reuse): 1.7.
    "cpu": Overhead(GIB // 2, 1.7),
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank (the busiest pipeline stage unless a stage was asked for) of a run on
    ``device`` ("gpu" or "cpu")."""

    stage: int
    parameters: int  # parameter count held by the rank
    weights: int
    grads: int
    optimizer: int
    activations: int  # saved for backward, all micro-batches in flight, at the peak
    transient: int  # working memory on top at the peak (logits, recomputed layer, gradients)
    device: str

    @property
    def resident(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.resident + self.activations + self.transient

    @property
    def needed(self) -> int:
        """Bytes of device memory the process needs: the live tensors with the allocator's slack,
        and what the process holds besides on its device (``OVERHEADS``)."""
        overhead = OVERHEADS[self.device]
        return int(self.total * overhead.slack) + overhead.fixed

    def fits(self, device_bytes: int) -> bool:
        return self.needed <= device_bytes

    def as_dict(self) -> dict:
        gib = {k: round(v / GIB, 3) for k, v in dataclasses.asdict(self).items()
               if k not in ("stage", "parameters", "device")}
        return {"stage": self.stage, "parameters": self.parameters, **gib,
                "total": round(self.total / GIB, 3)}


# ------------------------------------------------------------------------------------ params

def _attention_params(model: ModelConfig, tp: int, role: str = "plain") -> int:
    """One rank's share of a layer's attention with its norm; ``role`` (ModelConfig.
    decoder_attention) "joint" or "global_only" adds AsymLoop's Global KV, and the latter has no
    Local keys and values."""
    d, q, g = model.hidden_size, model.num_attention_heads * model.kv_channels, \
        model.num_query_groups * model.kv_channels
    linear = d * (q if role == "global_only" else q + 2 * g) + q * d
    norms = d + (2 * model.kv_channels if model.qk_norm else 0)
    if role != "plain":
        linear += 2 * d * g
        norms += d if model.global_kv_norm else 0
    return linear // tp + norms


def _ffn_params(model: ModelConfig, ffn: int, tp: int, moe: bool, ep: int) -> tuple[int, int]:
    """(parameters outside the experts, expert parameters) of one rank's share of a layer's FFN
    with its norm. A MoE FFN: the router (replicated on the tensor-parallel ranks), the shared
    expert, and the experts split over the ``ep`` expert-parallel ranks, each expert's width over
    the tensor-parallel ranks (megatron-core's expert tensor parallel size is the tensor size)."""
    d = model.hidden_size
    if not moe:
        return d + 3 * d * ffn // tp, 0
    return (d + d * model.num_experts + 3 * d * model.moe_shared_expert_size // tp,
            model.num_experts // ep * 3 * d * model.moe_ffn_hidden_size // tp)


def _latentloop_params(model: ModelConfig, tp: int, ep: int) -> tuple[int, int]:
    """What a LatentLoop model holds besides its prelude and shared middle block (one stage: it has
    no pipeline): the coda, the visits' untied attention / FFN, their reductions' parameters
    (writeback scales, width projections) and learned residual scales."""
    attention = _attention_params(model, tp)
    ffn_dense, ffn_expert = _ffn_params(model, model.ffn_hidden_size, tp, model.uses_moe, ep)
    untied = (model.num_iterations - 1) * model.num_decoder_layers
    dense = (model.num_coda_layers * (attention + ffn_dense)
             + untied * ((attention if model.untie_attention else 0)
                         + (ffn_dense if model.untie_moe else 0)))
    expert = (model.num_coda_layers + (untied if model.untie_moe else 0)) * ffn_expert
    d, reduced = model.hidden_size, len(model.latent_visits)
    if model.latent_reduction == "sequence":
        dense += reduced * model.latent_stride * d
    elif model.latent_reduction == "width":
        dense += reduced * d * d
    dense += model.num_iterations if model.residual_scale == "learned" else 0
    return dense, expert


def stage_parameters(model: ModelConfig, stage: Stage, tp: int, ep: int = 1) -> tuple[int, int]:
    """(parameters outside the experts, expert parameters) one tensor- and expert-parallel rank
    of ``stage`` holds."""
    model = dataclasses.replace(model).resolve()
    count = 0
    if stage.embedding:
        count += model.vocab_size * model.hidden_size // tp
    if stage.head:
        count += model.hidden_size  # final norm
        if not (model.tie_embeddings and stage.embedding):
            count += model.vocab_size * model.hidden_size // tp
    experts = 0
    for block in ("encoder", "decoder"):  # each layer held once, however often it runs
        decoder = block == "decoder"
        ffn = model.decoder_ffn_hidden_size if decoder else model.ffn_hidden_size
        ffn_dense, ffn_expert = _ffn_params(model, ffn, tp, model.moe_in(block), ep)
        layers = len(stage.held(block))
        count += layers * (_attention_params(model, tp, model.decoder_attention if decoder
                                             else "plain") + ffn_dense)
        experts += layers * ffn_expert
    if model.arch == "latentloop":
        dense, expert = _latentloop_params(model, tp, ep)
        count, experts = count + dense, experts + expert
    return count, experts


# ------------------------------------------------------------------------------- activations

@dataclass(frozen=True)
class _Saved:
    """Elements per token kept for backward: over the sequence (``seq``), split over heads or
    FFN columns (``split``), of which ``linear_input`` are linear-layer inputs (FP8-able), and
    fp32 statistics (``fp32``: norm rsqrt, attention log-sum-exp)."""

    seq: float = 0
    split: float = 0
    linear_input: float = 0
    fp32: float = 0


def _layer_saved(model: ModelConfig, ffn: int, joint: bool, te: bool, moe: bool = False, *,
                 replayed: Sequence[str] = (), masked: bool = False) -> _Saved:
    """One application of one layer (see the module docstring), less what the modules that
    selective recomputation replays (``replayed``) would keep (``_replayable_saved``);
    ``masked``: the joint attention runs the masked formula."""
    d = model.hidden_size
    q = model.num_attention_heads * model.kv_channels
    g = model.num_query_groups * model.kv_channels
    # The local core attention repeats grouped keys/values to every head before the kernel.
    expand = not te and g < q
    # Layer input; per norm its normalised input and output (TE: the output only); the residual.
    seq = d + (2 if te else 4) * d + d
    split = q + g                               # rotated queries and keys (RoPE writes new ones)
    # The fused QKV output, kept by views of it: the values the kernel (or, recomputed, the
    # replay) gets, or the QK-norm's inputs.
    if model.qk_norm or not expand or "core_attn" in replayed:
        split += q + 2 * g
    if model.qk_norm and not te:                # QK-norm's normalised q and k
        split += q + g
    split += q                                  # the projection's input
    saved = _Saved(seq, split, 2 * d + q, 2)  # linear inputs: QKV, fc1 (norm outputs), proj
    pieces = _replayable_saved(model, ffn, joint, te, moe, masked)
    dropped = {*replayed, *(["shared_experts"] if "moe" in replayed else [])}
    for name, piece in pieces.items():
        if name not in dropped:
            saved = _add(saved, piece)
    return saved


def _replayable_saved(model: ModelConfig, ffn: int, joint: bool, te: bool, moe: bool,
                      masked: bool) -> dict[str, _Saved]:
    """What the modules of a layer application that selective recomputation can replay keep
    beyond their inputs (a checkpoint keeps its inputs only, which the layer keeps anyway):
    core_attn (``_core_attention_saved``); a dense FFN (mlp): SwiGLU's fc1 output (2f), silu,
    linear half and product (fc2's input); a MoE FFN (moe): each token through its
    top-k experts' SwiGLU, and what ``_moe_saved`` counts; its shared expert (shared_experts,
    replayed with the MoE layer too). Under Transformer Engine the dense FFN's replay also drops
    the output of the pre-FFN norm fused into fc1 (d per token), which this leaves counted."""
    pieces = {"core_attn": _core_attention_saved(model, joint, te, masked)}
    if not moe:
        pieces["mlp"] = _Saved(split=5 * ffn, linear_input=ffn)
        return pieces
    moe_seq, moe_fp32 = _moe_saved(model)
    routed, shared = model.moe_top_k * model.moe_ffn_hidden_size, model.moe_shared_expert_size
    pieces["moe"] = _Saved(moe_seq, 5 * routed, routed, moe_fp32)
    pieces["shared_experts"] = _Saved(split=5 * shared, linear_input=shared)
    return pieces


def _rebuilt(model: ModelConfig, ffn: int, joint: bool, te: bool, moe: bool, masked: bool,
             replayed: Sequence[str]) -> list[_Saved]:
    """What each checkpoint of ``replayed`` rebuilds in the backward pass, one at a time (a MoE
    layer's with its shared expert)."""
    pieces = _replayable_saved(model, ffn, joint, te, moe, masked)
    return [_add(pieces[name], pieces["shared_experts"]) if name == "moe" else pieces[name]
            for name in replayed if name in pieces]


def _core_attention_saved(model: ModelConfig, joint: bool, te: bool, masked: bool) -> _Saved:
    """What the core attention keeps for its backward pass beyond its inputs (selective
    recomputation replays it instead): keys repeated to every head and values (the local
    kernel; the joint one also the Global keys/values, every iteration); the flash kernels' output
    (the projection gets a copy; TE's is the projection's input itself) and fp32 log-sum-exps;
    the masked joint attention (model.joint_attention=masked, or fused in fp32 on a GPU, where
    it runs the masked formula) its [N, 2N] softmax probabilities per head instead (Korthikanti
    et al.'s attention-score term; no dropout mask, attention dropout is 0)."""
    heads = model.num_attention_heads
    q, g = heads * model.kv_channels, model.num_query_groups * model.kv_channels
    expand = not te and g < q
    split = 2 * q - g if expand else 0
    if joint and expand:
        split += 2 * q
    if joint and masked:
        return _Saved(split=split + heads * 2 * model.seq_length)
    return _Saved(split=split + (0 if te else q), fp32=heads * (2 if joint else 1))


def _add(a: _Saved, b: _Saved) -> _Saved:
    return _Saved(*(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))


def _moe_saved(model: ModelConfig) -> tuple[int, int]:
    """What a MoE FFN keeps per token on top of its experts' SwiGLU tensors, as (seq, fp32)
    elements: the tokens permuted to their k experts and the experts' outputs before the
    weighted sum (k x d each), and the fp32 router: its input cast to fp32, logits, scores and
    probabilities over the E experts."""
    d, k, e = model.hidden_size, model.moe_top_k, model.num_experts
    return 2 * k * d, d + 4 * e


def _global_kv_saved(model: ModelConfig, te: bool) -> _Saved:
    """Global KV of one decoder layer, once per forward: its norm, the projection's output and the
    stacked, rotated keys/values the iterations read."""
    d, g = model.hidden_size, model.num_query_groups * model.kv_channels
    norm = (1 if te else 2) * d if model.global_kv_norm else 0
    split = 2 * g + 2 * g + (g if model.qk_norm and not te else 0)
    return _Saved(norm, split, d, 1)


def _bytes(saved: _Saved, tokens: int, tp: int, sp: bool, act_bytes: int, fp8: bool) -> float:
    seq = saved.seq / (tp if sp else 1)
    elems = seq + saved.split / tp
    total = elems * act_bytes + saved.fp32 * 4
    if fp8:  # linear inputs kept in FP8 (one byte) instead of the activation dtype
        total -= saved.linear_input / tp * (act_bytes - 1)
    return tokens * total


def estimate(cfg: RunConfig, layout: Layout, *, device: str = "gpu",
             stage: int | None = None) -> MemoryEstimate:
    """Per-rank memory of ``cfg`` under ``layout``; ``device`` "gpu" (Transformer Engine, bf16 by
    default) or "cpu" (local spec, fp32 by default); ``stage``: the pipeline rank, None for the
    busiest. With the interleaved schedule a rank holds one model chunk per virtual stage."""
    # The config's own pipeline split when the layout is the config's; else the balanced one.
    stages = stage_layout(cfg.model, cfg.parallel if cfg.parallel.pipeline == layout.pipeline
                          and cfg.parallel.virtual_pipeline == layout.virtual
                          else layout.parallel_config())
    busiest = range(layout.pipeline) if stage is None else [stage]
    return max((_stage_estimate(cfg, layout, stages, device, s) for s in busiest),
               key=lambda e: e.total)


def _stage_estimate(cfg: RunConfig, layout: Layout, stages: list[Stage], device: str,
                    stage: int) -> MemoryEstimate:
    model = dataclasses.replace(cfg.model).resolve()
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device == "gpu" else "fp32"
    te, fp8 = device == "gpu", precision == "fp8"
    act_bytes = 4 if precision == "fp32" else 2
    tp, sp, dp = layout.tensor, layout.sequence_parallel, layout.data
    chunks = stages[stage::layout.pipeline]

    held = [stage_parameters(model, chunk, tp, layout.expert) for chunk in chunks]
    dense, experts = sum(h[0] for h in held), sum(h[1] for h in held)
    params = dense + experts
    weights = params * (4 if precision == "fp32" else 2) + (2 * params if fp8 else 0)
    grads = params * 4
    state = 8 + (0 if precision == "fp32" else 4)
    if cfg.train.distributed_optimizer:  # experts: over the ranks that hold the same experts
        optimizer = dense * state // dp + experts * state // (dp // layout.expert)
    else:
        optimizer = params * state

    tokens = cfg.train.micro_batch_size * model.seq_length
    size = dict(tokens=tokens, tp=tp, sp=sp, act_bytes=act_bytes, fp8=fp8)
    layer_input = _bytes(_Saved(seq=model.hidden_size), **size)
    vocab_split = tokens * model.vocab_size / tp
    saved, largest_layer, largest_replay = [], 0.0, 0.0  # per chunk and micro-batch
    # The joint attention's masked formula: asked for, or fused in fp32 on a GPU (whose flash
    # kernel takes bf16/fp16 only).
    masked = model.joint_attention == "masked" or te and act_bytes == 4
    replayed = layout.apply(cfg).parallel.selective_modules
    for chunk in chunks:
        chunk_saved = 0.0
        for count, block, ffn, joint, moe, stride in _applications(model, chunk):
            run_size = dict(size, tokens=tokens // stride)
            per_layer = _bytes(_layer_saved(block, ffn, joint, te, moe, replayed=replayed,
                                            masked=masked), **run_size)
            # A replayed module keeps its inputs and is rebuilt one call at a time.
            for rebuilt in _rebuilt(block, ffn, joint, te, moe, masked, replayed):
                largest_replay = max(largest_replay, _bytes(rebuilt, **run_size))
            largest_layer = max(largest_layer, per_layer)
            chunk_saved += count * (_bytes(_Saved(seq=block.hidden_size), **run_size)
                                    if layout.recompute == "full" else per_layer)
        if chunk.global_kv_layers:
            chunk_saved += chunk.global_kv_layers * _bytes(_global_kv_saved(model, te), **size)
        if chunk.head:
            chunk_saved += (_bytes(_Saved(seq=3 * model.hidden_size, fp32=1), **size)
                            + 4 * vocab_split)
        saved.append(chunk_saved)
    micro = _microbatches(cfg, layout)
    if layout.virtual == 1:
        in_flight = min(layout.pipeline - stage, micro)
    else:  # megatron-core's interleaved warm-up, then one more, in chunk-micro-batches
        in_flight = min(micro * layout.virtual,
                        2 * (layout.pipeline - stage - 1) + (layout.virtual - 1) * layout.pipeline
                        + 1)
    # At the peak: the logits in the activation dtype next to the fp32 softmax; the layer that
    # recomputation rebuilds; the gradient of one layer's output and input.
    # (In fp32 the cross-entropy works on the logits in place: no second copy.)
    head = any(chunk.head for chunk in chunks)
    logits = act_bytes * vocab_split if head and act_bytes != 4 else 0
    transient = logits + 2 * layer_input
    if layout.recompute == "full":
        transient += largest_layer
    transient += largest_replay
    return MemoryEstimate(stage, params, int(weights), int(grads), int(optimizer),
                          int(in_flight * sum(saved) / len(saved)), int(transient), device)


def _applications(model: ModelConfig, chunk: Stage):
    """(count, block config, FFN width, joint attention, MoE, token stride) of the layer
    applications of ``chunk``: its runs of encoder and decoder layers; a LatentLoop visit runs the
    block of its reduction (ModelConfig.visit_block_config) on 1 / latent_stride of the tokens
    when compressed; the coda runs on the last stage (Stage.coda)."""
    latent = model.arch == "latentloop"
    for run in chunk.runs:
        decoder = run.block == "decoder"
        if latent and decoder:
            sequence = model.visit_reduction(run.step) == "sequence"
            yield (run.count, model.visit_block_config(run.step), model.ffn_hidden_size, False,
                   model.uses_moe, model.latent_stride if sequence else 1)
            continue
        yield (run.count, model, model.decoder_ffn_hidden_size if decoder else
               model.ffn_hidden_size, decoder and model.decoder_attention == "joint",
               model.moe_in(run.block), 1)
    if chunk.coda:
        yield chunk.coda, model, model.ffn_hidden_size, False, model.uses_moe, 1


def _microbatches(cfg: RunConfig, layout: Layout) -> int:
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.data))


def fitting_layouts(cfg: RunConfig, world_size: int, device_bytes: int,
                    device: str = "gpu") -> list[tuple[Layout, MemoryEstimate]]:
    """Layouts of ``world_size`` ranks that the run of ``cfg`` (a valid config) accepts
    (tensor parallel within 8 GPUs, under FP8 only where every GEMM split keeps the sizes
    Transformer Engine's FP8 GEMMs take, sequence parallelism with it, pipeline stages the
    architecture supports, a MoE model's experts split over 1 to 8 of the data-parallel ranks,
    without, with selective and with full recomputation) and whose estimate
    fits ``device_bytes``, cheapest first: no recomputation, then selective (the core attention
    again), then full (a third more compute); then the fewest model-parallel ranks (the least
    communication), then the fewest expert-parallel ranks."""
    found = []
    par = cfg.parallel
    # The run's own sizes too (pipeline 3 of 3 GPUs): else a layout the dry run just found to fit
    # would be missing, and with nothing else valid the search reported that nothing fits.
    sizes = (1, 2, 4, 8)
    experts = sorted({*sizes, par.expert}) if cfg.model.uses_moe else (1,)
    for tp, pp, ep in itertools.product(sorted({*sizes, par.tensor}),
                                        sorted({*sizes, par.pipeline}), experts):
        if world_size % (tp * pp) or world_size // (tp * pp) % ep:
            continue
        for recompute in RECOMPUTE_COST_ORDER:
            layout = Layout(tensor=tp, pipeline=pp, data=world_size // (tp * pp), expert=ep,
                            sequence_parallel=tp > 1, recompute=recompute)
            trial = layout.apply(cfg)
            try:  # what the run refuses at start-up under this layout does not fit either
                trial.validate()
                micro_batches_per_step(trial.train, trial.parallel, layout.data)
                check_fp8_shapes(trial)  # under FP8: tensor parallelism splits the GEMMs
            except ValueError:
                continue
            mem = estimate(trial, layout, device=device)
            if mem.fits(device_bytes):
                found.append((layout, mem))
    return sorted(found, key=lambda item: (RECOMPUTE_COST_ORDER.index(item[0].recompute),
                                           item[0].tensor * item[0].pipeline,
                                           item[0].pipeline, item[0].expert))
