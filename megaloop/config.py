"""Typed run configuration: dataclasses that round-trip through YAML and take dotted overrides.

A run is a ``RunConfig`` of six sections: model, parallel, train, data, checkpoint and alrs. Every
field has a default or is derived in ``resolve()``; ``validate()`` runs before any heavy work and
turns a user's mistake into one ``ConfigError`` line that names the field, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import secrets
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from megaloop.alrs.schedule import ALRSConfig

Arch = Literal["dense", "fullloop", "asymloop", "latentloop"]
Block = Literal["llama", "olmo"]
MoELayers = Literal["all", "encoder", "decoder"]
ResidualScale = Literal["learned", "fixed"]
# How LatentLoop's reduced visits (``latent_visits``) save compute, the paper's four first-visit
# reductions: sequence compression, half the router's top-k, the residual width d -> d/2 through a
# projection, half the expert FFN width (megaloop.models.latent).
LatentReduction = Literal["sequence", "top_k", "width", "expert_ffn"]
Injection = Literal["global_kv", "none", "additive"]
JointImpl = Literal["fused", "masked"]
# Transformer Engine FP8 scaling recipes: "current" (per-tensor current scaling, TE >= 2.2),
# "delayed" (amax history) and "mxfp8" (block scaling, Blackwell GPUs).
Fp8Recipe = Literal["current", "delayed", "mxfp8"]
# Head dimensions the CUDA flash kernel behind the fused joint attention takes.
FLASH_HEAD_DIM_MULTIPLE, FLASH_MAX_HEAD_DIM = 8, 256


# The paper's headline comparison at matched effective depth J = 2L: AsymLoop K = 3, Full Loop R = 2.
DEFAULT_ITERATIONS = {"dense": 1, "fullloop": 2, "asymloop": 3, "latentloop": 2}


# ModelConfig fields that only arch=latentloop reads.
_LATENTLOOP_FIELDS = ("prelude_layers", "coda_layers", "latent_visits", "latent_stride",
                      "latent_writeback_lag", "latent_reduction", "residual_scale",
                      "residual_scale_init", "untie_attention", "untie_moe")


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line."""


@dataclass
class ModelConfig:
    """Architecture. ``num_layers`` counts *physical* layers L; the effective depth is derived.

    - dense: L layers run once.
    - fullloop: the L-layer stack, weights shared, applied ``iterations`` (R) times.
    - asymloop: ``encoder_layers`` (E) run once, the remaining D = L - E decoder layers are iterated
      ``iterations`` (K) times, attending to per-layer Global KV projected from the encoder output.
    - latentloop: ``prelude_layers`` (P) once, the middle M = L - P - C layers visited ``iterations``
      (V) times, ``coda_layers`` (C) once; the visits in ``latent_visits`` run on a sequence
      compressed ``latent_stride`` times (megaloop.models.latent).

    ``num_experts`` > 0 turns FFNs into megatron-core MoE layers (megaloop.models.moe).
    """

    arch: Arch = "asymloop"
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 344
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    vocab_size: int = 32128
    seq_length: int = 128
    encoder_layers: int | None = None  # asymloop E; None: L // 2
    iterations: int | None = None  # K (asymloop) or R (fullloop); None: DEFAULT_ITERATIONS[arch]
    block: Block = "llama"  # "olmo": RMSNorm on sublayer outputs inside the residual, QK-norm
    qk_norm: bool | None = None  # None: on for asymloop and the olmo block
    injection: Injection = "global_kv"  # asymloop: how the decoder sees the encoder output
    local_kv: bool = True  # asymloop ablation: False makes the decoder attend to Global KV only
    # RMSNorm of H_E before each decoder layer's Global K/V projection: megaloop's choice (the
    # paper does not state one); False projects the un-normalised encoder output.
    global_kv_norm: bool = True
    decoder_ffn_hidden_size: int | None = None  # None: ffn_hidden_size (set for widened ablations)
    joint_attention: JointImpl = "fused"
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False
    # Mixture of experts: 0 experts keeps the dense SwiGLU FFN.
    num_experts: int = 0
    moe_layers: MoELayers = "all"  # asymloop: MoE in the encoder, the decoder or both
    moe_top_k: int = 2
    moe_ffn_hidden_size: int | None = None  # per expert; None: ffn_hidden_size // moe_top_k
    moe_shared_expert_size: int = 0  # FFN width of an always-active shared expert (0: none)
    moe_aux_loss_coeff: float = 0.01  # load balancing, per MoE layer application
    moe_z_loss_coeff: float = 0.001  # router z-loss, per MoE layer application
    # LatentLoop (arch=latentloop)
    prelude_layers: int | None = None  # None: num_layers // 4 (at least 1)
    coda_layers: int | None = None  # None: num_layers // 4 (at least 1)
    latent_visits: list[int] = field(default_factory=lambda: [1])  # reduced visits, 1-based
    latent_stride: int = 2  # tokens per latent
    latent_writeback_lag: int = 0  # 1: latent j writes to the k positions one later
    # sequence: the reduced visits run on latents; top_k: they route to moe_top_k // 2 experts;
    # width: they run at hidden_size // 2 between learned projections; expert_ffn: their experts
    # use the first half of each expert's hidden units
    latent_reduction: LatentReduction = "sequence"
    residual_scale: ResidualScale = "learned"  # alpha_v of h + alpha_v * f(h), per visit
    residual_scale_init: list[float] = field(default_factory=list)  # per visit; []: all 1.0
    untie_attention: bool = False  # every visit its own attention weights
    untie_moe: bool = False  # every visit its own FFN / experts

    @property
    def num_encoder_layers(self) -> int:
        """Layers before the loop: the AsymLoop encoder (E) or the LatentLoop prelude (P)."""
        if self.arch == "latentloop":
            return self.num_prelude_layers
        if self.arch != "asymloop":
            return 0
        return self.num_layers // 2 if self.encoder_layers is None else self.encoder_layers

    @property
    def num_prelude_layers(self) -> int:
        if self.arch != "latentloop":
            return 0
        return max(1, self.num_layers // 4) if self.prelude_layers is None else self.prelude_layers

    @property
    def num_coda_layers(self) -> int:
        if self.arch != "latentloop":
            return 0
        return max(1, self.num_layers // 4) if self.coda_layers is None else self.coda_layers

    @property
    def uses_moe(self) -> bool:
        return self.num_experts > 0

    def moe_in(self, part: str) -> bool:
        """Whether the layers of ``part`` ("encoder" = layers before the loop, "decoder" = the
        looped layers, "coda") have MoE FFNs."""
        return self.uses_moe and self.moe_layers in ("all", part)

    @property
    def num_decoder_layers(self) -> int:
        """The looped layers: AsymLoop decoder (D), Full Loop / Dense stack, LatentLoop middle (M)."""
        return self.num_layers - self.num_encoder_layers - self.num_coda_layers

    @property
    def effective_depth(self) -> int:
        """J = E + K * D (dense: L; fullloop: R * L; latentloop: P + V * M + C)."""
        return (self.num_encoder_layers + self.num_iterations * self.num_decoder_layers
                + self.num_coda_layers)

    @property
    def num_iterations(self) -> int:
        return DEFAULT_ITERATIONS[self.arch] if self.iterations is None else self.iterations

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def uses_global_kv(self) -> bool:
        return self.arch == "asymloop" and self.injection == "global_kv"

    @property
    def decoder_attention(self) -> str:
        """Attention role of decoder layers: "plain", "joint" [Global; Local] or "global_only"."""
        if not self.uses_global_kv:
            return "plain"
        return "joint" if self.local_kv else "global_only"

    def visit_reduction(self, visit: int) -> str | None:
        """LatentLoop: how visit ``visit`` (1-based) is reduced (``latent_reduction``), or None."""
        return self.latent_reduction if visit in self.latent_visits else None

    def visit_block_config(self, visit: int) -> "ModelConfig":
        """LatentLoop: the (resolved) config of the middle block that visit ``visit`` runs: this
        one, or the reduced block of a top_k, width or expert_ffn visit."""
        cfg = dataclasses.replace(self).resolve()
        reduction = cfg.visit_reduction(visit)
        if reduction == "top_k":
            return dataclasses.replace(cfg, moe_top_k=cfg.moe_top_k // 2)
        if reduction == "width":  # the heads and head dim stay: only the residual width halves
            return dataclasses.replace(cfg, hidden_size=cfg.hidden_size // 2,
                                       head_dim=cfg.kv_channels)
        if reduction == "expert_ffn":
            return dataclasses.replace(cfg, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size // 2,
                                       moe_shared_expert_size=cfg.moe_shared_expert_size // 2)
        return cfg

    def resolve(self) -> "ModelConfig":
        """Fills derived defaults; idempotent."""
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.iterations is None:
            self.iterations = DEFAULT_ITERATIONS[self.arch]
        if self.arch == "asymloop" and self.encoder_layers is None:
            self.encoder_layers = self.num_layers // 2
        if self.qk_norm is None:
            self.qk_norm = self.arch == "asymloop" or self.block == "olmo"
        if self.decoder_ffn_hidden_size is None:
            self.decoder_ffn_hidden_size = self.ffn_hidden_size
        if self.arch == "latentloop":
            self.prelude_layers, self.coda_layers = self.num_prelude_layers, self.num_coda_layers
        if self.uses_moe and self.moe_ffn_hidden_size is None:
            # Paper App. I: top-k experts of width FFN / k keep the active FFN parameters.
            self.moe_ffn_hidden_size = max(1, self.ffn_hidden_size // self.moe_top_k)
        return self

    def validate(self, prefix: str = "model") -> None:
        self.resolve()
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "seq_length", "iterations",
                     "decoder_ffn_hidden_size"):
            _require(getattr(self, name) >= 1, prefix, name, getattr(self, name), ">= 1")
        if self.head_dim is None:
            _require(self.hidden_size % self.num_attention_heads == 0, prefix, "hidden_size",
                     self.hidden_size, f"a multiple of num_attention_heads="
                     f"{self.num_attention_heads} (or set head_dim)")
        else:
            _require(self.head_dim >= 2, prefix, "head_dim", self.head_dim, ">= 2")
        _require(self.num_attention_heads % self.num_query_groups == 0, prefix,
                 "num_query_groups", self.num_query_groups,
                 f"a divisor of num_attention_heads={self.num_attention_heads}")
        # The field that sets the head dim, to name in errors.
        head_field = ("head_dim", self.head_dim) if self.head_dim else ("hidden_size",
                                                                         self.hidden_size)
        _require(self.kv_channels % 2 == 0, prefix, *head_field,
                 "such that the head dim is even (RoPE rotates pairs)")
        if self.decoder_attention == "joint" and self.joint_attention == "fused":
            head_dim = self.kv_channels
            _require(head_dim % FLASH_HEAD_DIM_MULTIPLE == 0 and head_dim <= FLASH_MAX_HEAD_DIM,
                     prefix, *head_field, f"such that the head dim (here {head_dim}) is a multiple of "
                     f"{FLASH_HEAD_DIM_MULTIPLE} and at most {FLASH_MAX_HEAD_DIM}, the limits of "
                     "the CUDA flash kernel behind joint_attention=fused (or use "
                     "joint_attention=masked)")
        if self.arch == "dense":
            _require(self.iterations == 1, prefix, "iterations", self.iterations,
                     "1 for arch=dense (use arch=fullloop to loop the stack)")
        if self.arch == "asymloop":
            e = self.encoder_layers
            _require(1 <= e < self.num_layers, prefix, "encoder_layers", e,
                     f"in [1, {self.num_layers - 1}] so that E + D = num_layers={self.num_layers} "
                     "with D >= 1")
            _require(self.local_kv or self.injection == "global_kv", prefix, "local_kv",
                     self.local_kv, "true unless injection=global_kv (the decoder needs some keys)")
        else:
            _require(self.injection == "global_kv" and self.local_kv, prefix, "injection",
                     self.injection, "left at its defaults unless arch=asymloop")
            _require(self.decoder_ffn_hidden_size == self.ffn_hidden_size, prefix,
                     "decoder_ffn_hidden_size", self.decoder_ffn_hidden_size,
                     "unset unless arch=asymloop (widen ffn_hidden_size instead)")
        self._validate_moe(prefix)
        if self.arch == "latentloop":
            self._validate_latentloop(prefix)
        else:  # a LatentLoop switch set on another architecture would be silently ignored
            for f in dataclasses.fields(self):
                if f.name in _LATENTLOOP_FIELDS:
                    default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                        else f.default
                    _require(getattr(self, f.name) == default, prefix, f.name,
                             getattr(self, f.name), f"left at its default {default!r} unless "
                             "arch=latentloop")

    def _validate_moe(self, prefix: str) -> None:
        _require(self.num_experts >= 0, prefix, "num_experts", self.num_experts,
                 ">= 0 (0: dense FFN)")
        if not self.uses_moe:
            return
        _require(1 <= self.moe_top_k <= self.num_experts, prefix, "moe_top_k", self.moe_top_k,
                 f"in [1, num_experts={self.num_experts}]")
        _require(self.moe_ffn_hidden_size >= 1, prefix, "moe_ffn_hidden_size",
                 self.moe_ffn_hidden_size, ">= 1")
        _require(self.moe_shared_expert_size >= 0, prefix, "moe_shared_expert_size",
                 self.moe_shared_expert_size, ">= 0 (0: no shared expert)")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            _require(getattr(self, name) >= 0, prefix, name, getattr(self, name), ">= 0")
        _require(self.block == "llama", prefix, "block", self.block,
                 "'llama' for a MoE model (the OLMo-2 norm after a MoE layer is not built)")
        _require(self.moe_layers == "all" or self.arch == "asymloop", prefix, "moe_layers",
                 self.moe_layers, "'all' unless arch=asymloop (which has an encoder and a decoder)")

    def _validate_latentloop(self, prefix: str) -> None:
        p, c, visits = self.prelude_layers, self.coda_layers, self.iterations
        _require(p >= 0, prefix, "prelude_layers", p, ">= 0")
        _require(c >= 0 and p + c < self.num_layers, prefix, "coda_layers", c,
                 f">= 0 with prelude_layers + coda_layers < num_layers={self.num_layers} "
                 "(the middle block needs a layer)")
        _require(all(1 <= v <= visits for v in self.latent_visits)
                 and len(set(self.latent_visits)) == len(self.latent_visits), prefix,
                 "latent_visits", self.latent_visits,
                 f"distinct visit numbers in [1, iterations={visits}]")
        _require(2 <= self.latent_stride <= 4, prefix, "latent_stride", self.latent_stride,
                 "2, 3 or 4")
        _require(self.seq_length % self.latent_stride == 0, prefix, "latent_stride",
                 self.latent_stride, f"a divisor of seq_length={self.seq_length} (whole latents "
                 "in every training sequence)")
        _require(self.latent_writeback_lag in (0, 1), prefix, "latent_writeback_lag",
                 self.latent_writeback_lag, "0 or 1")
        self._validate_latent_reduction(prefix)
        _require(not self.residual_scale_init or len(self.residual_scale_init) == visits, prefix,
                 "residual_scale_init", self.residual_scale_init,
                 f"empty or one value per visit (iterations={visits})")
        _require(not self.untie_moe or self.uses_moe, prefix, "untie_moe", self.untie_moe,
                 "false unless num_experts > 0")

    def _validate_latent_reduction(self, prefix: str) -> None:
        reduction = self.latent_reduction
        # Settings that the reduction in use would ignore.
        if reduction != "sequence" or not self.latent_visits:
            why = ("unless latent_reduction='sequence'" if self.latent_visits
                   else "while latent_visits is empty (no visit is reduced)")
            for name, default in (("latent_stride", 2), ("latent_writeback_lag", 0)):
                _require(getattr(self, name) == default, prefix, name, getattr(self, name),
                         f"left at its default {default} {why}")
            _require(self.latent_visits or reduction == "sequence", prefix, "latent_reduction",
                     reduction, f"left at its default 'sequence' {why}")
        if reduction == "top_k":
            _require(self.uses_moe and self.moe_top_k >= 4, prefix, "latent_reduction", reduction,
                     "'sequence' unless num_experts > 0 and moe_top_k >= 4 (the reduced visits "
                     "route to moe_top_k // 2 >= 2 experts)")
        elif reduction == "width":
            _require(self.hidden_size % 2 == 0, prefix, "hidden_size", self.hidden_size,
                     "even for latent_reduction='width' (the reduced visits run at half the "
                     "hidden size)")
        elif reduction == "expert_ffn":
            _require(self.uses_moe, prefix, "latent_reduction", reduction,
                     "one of 'sequence', 'width' unless num_experts > 0 (the reduced visits halve "
                     "the experts' FFN)")
            for name in ("moe_ffn_hidden_size", "moe_shared_expert_size"):
                _require(getattr(self, name) % 2 == 0, prefix, name, getattr(self, name),
                         "even for latent_reduction='expert_ffn' (the reduced visits use half of "
                         "each expert's hidden units)")
        if reduction in ("width", "expert_ffn"):
            # A narrowed visit computes with a part of the shared weights; a visit with weights of
            # its own (untied, visits 2..V) would need narrow weights of its own, not built.
            untied = [v for v in self.latent_visits if v > 1 and (
                self.untie_moe or self.untie_attention and reduction == "width")]
            _require(not untied, prefix, "latent_visits", self.latent_visits,
                     f"visits that use the shared middle block for latent_reduction={reduction!r}"
                     f" (visits {untied} have untied weights; reduce visit 1, or untie nothing)")


@dataclass
class ParallelConfig:
    """Model-parallel sizes (the data-parallel size is what the world leaves over).

    Pipeline parallelism unrolls the model's chain of layer applications over the stages
    (megaloop.models.pipeline): ``pipeline_split`` lists each stage's count of applications
    (pipeline x virtual_pipeline entries, stage v * pipeline + p being chunk v of rank p); empty:
    the split with the best compute balance. ``virtual_pipeline`` > 1 runs megatron-core's
    interleaved schedule with that many model chunks per pipeline rank.
    """

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    sequence_parallel: bool = False
    recompute: Literal["none", "full"] = "none"
    virtual_pipeline: int = 1
    pipeline_split: list[int] = field(default_factory=list)

    @property
    def pipeline_stages(self) -> int:
        """Stages of the chain: pipeline ranks x model chunks per rank."""
        return self.pipeline * self.virtual_pipeline

    def validate(self, model: ModelConfig, prefix: str = "parallel") -> None:
        for name in ("tensor", "pipeline", "expert", "virtual_pipeline"):
            _require(getattr(self, name) >= 1, prefix, name, getattr(self, name), ">= 1")
        tp = self.tensor
        # Tensor parallelism splits heads, query groups, FFN columns and the vocabulary.
        split = {name: getattr(model, name) for name in (
            "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "decoder_ffn_hidden_size", "vocab_size")}
        if model.uses_moe and model.moe_ffn_hidden_size:  # experts split like the FFN
            split["moe_ffn_hidden_size"] = model.moe_ffn_hidden_size
        undivided = [f"model.{name}={size}" for name, size in split.items() if size % tp]
        pad = "; or pad the vocabulary" if split["vocab_size"] % tp else ""
        _require(not undivided, prefix, "tensor", tp,
                 f"a divisor of {', '.join(undivided)} (tensor sizes that divide the heads, query "
                 f"groups, FFN widths and vocabulary: {_divisors(math.gcd(*split.values()))}"
                 f"{pad})")
        _require(not self.sequence_parallel or tp > 1, prefix, "sequence_parallel",
                 self.sequence_parallel, "false unless tensor > 1 (it splits the sequence over TP)")
        _require(not self.sequence_parallel or model.seq_length % tp == 0, prefix,
                 "sequence_parallel", self.sequence_parallel,
                 f"false, or parallel.tensor={tp} a divisor of model.seq_length="
                 f"{model.seq_length} (sequence parallelism splits the sequence over the "
                 f"tensor-parallel ranks; sizes that fit: {_divisors(model.seq_length, 64)})")
        if self.expert > 1:
            _require(model.uses_moe, prefix, "expert", self.expert,
                     "1 unless model.num_experts > 0 (expert parallelism splits the experts)")
            _require(model.num_experts % self.expert == 0, prefix, "expert", self.expert,
                     f"a divisor of model.num_experts={model.num_experts}")
        _require(not (self.sequence_parallel and model.arch == "latentloop"), prefix,
                 "sequence_parallel", self.sequence_parallel,
                 "false for model.arch=latentloop (the writeback shifts across sequence shards)")
        if model.uses_moe and tp > 1:
            _require(self.sequence_parallel, prefix, "tensor", tp,
                     "1 for a MoE model unless parallel.sequence_parallel=true (megatron-core's "
                     "MoE layer needs sequence parallelism with tensor parallelism)")
        self._validate_pipeline(model, prefix)

    def _validate_pipeline(self, model: ModelConfig, prefix: str) -> None:
        from megaloop.models.pipeline import chain_length, check_split

        _require(self.virtual_pipeline == 1 or self.pipeline > 1, prefix, "virtual_pipeline",
                 self.virtual_pipeline, "1 unless parallel.pipeline > 1 (it interleaves the "
                 "pipeline ranks' model chunks)")
        if self.pipeline == 1:
            _require(not self.pipeline_split, prefix, "pipeline_split", self.pipeline_split,
                     "empty unless parallel.pipeline > 1")
            return
        _require(model.arch != "latentloop", prefix, "pipeline", self.pipeline,
                 "1 for model.arch=latentloop (its visits are distinct modules with their own "
                 "compression and scales; pipeline parallelism covers dense, fullloop and "
                 "asymloop: use tensor/data/expert parallelism)")
        _require(self.virtual_pipeline == 1 or not model.uses_moe, prefix, "virtual_pipeline",
                 self.virtual_pipeline, "1 for a MoE model (its routing statistics are kept "
                 "per model chunk)")
        stages, total = self.pipeline_stages, chain_length(model)
        _require(stages <= total, prefix, "pipeline", self.pipeline,
                 f"such that pipeline x virtual_pipeline = {stages} stages get at least one of "
                 f"the model's {total} layer applications each (at most {total} stages)")
        if self.pipeline_split:
            check_split(model, self.pipeline_split, stages, f"{prefix}.pipeline_split")


@dataclass
class DownstreamEvalConfig:
    """Downstream accuracy of the run's checkpoints while it trains (megaloop.training.downstream):
    after every ``every``-th periodic checkpoint save and after the final one, rank 0 runs the LM
    Evaluation Harness on ``tasks`` (examples/eval task names or tags, their files in
    ``data_dir``) and appends a row per task to metrics.jsonl. Empty ``tasks``: off."""

    tasks: list[str] = field(default_factory=list)
    data_dir: str | None = None
    task_dir: str | None = None  # None: the repository's examples/eval
    limit: int | None = None  # the first N records of each task; None: all
    num_fewshot: int = 0
    every: int = 1  # evaluate every N-th periodic save (the final checkpoint always)
    batch_size: int = 8

    def validate(self, prefix: str = "train.downstream_eval") -> None:
        if not self.tasks:  # off: any other field set would be ignored
            changed = [f.name for f in dataclasses.fields(self)
                       if getattr(self, f.name) != getattr(DownstreamEvalConfig(), f.name)]
            _require(not changed, prefix, "tasks", self.tasks,
                     f"set (a list of task names or tags) when {prefix}."
                     f"{changed[0] if changed else ''} is")
            return
        _require(self.data_dir is not None, prefix, "data_dir", self.data_dir,
                 "the directory of the tasks' data files")
        _require(self.limit is None or self.limit >= 1, prefix, "limit", self.limit,
                 ">= 1 or null (all records)")
        for name, low in (("num_fewshot", 0), ("every", 1), ("batch_size", 1)):
            _require(getattr(self, name) >= low, prefix, name, getattr(self, name), f">= {low}")


@dataclass
class TrainConfig:
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_steps: int = 100
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # Only with precision=fp8; None: "current". "delayed" keeps an amax history of 2K calls (max).
    fp8_recipe: Fp8Recipe | None = None
    distributed_optimizer: bool = True  # shard optimizer state over data-parallel ranks
    use_alrs: bool = False  # layerwise LR multipliers from the `alrs` section
    out_dir: str = "runs/default"
    log_interval: int = 10
    eval_interval: int = 0  # 0: evaluate at the end only
    eval_iters: int = 10  # validation batches per evaluation
    eval_depths: list[int] = field(default_factory=list)  # extra K for a test-time depth table
    max_nonfinite_steps: int = 5  # consecutive NaN/Inf losses tolerated (skipped) before abort
    tensorboard: bool = True
    wandb_project: str | None = None
    peak_tflops: float | None = None  # per device, for MFU; None: known GPUs auto, CPU none
    downstream_eval: DownstreamEvalConfig = field(default_factory=DownstreamEvalConfig)

    def validate(self, prefix: str = "train") -> None:
        for name in ("micro_batch_size", "global_batch_size", "train_steps", "log_interval",
                     "eval_iters", "max_nonfinite_steps"):
            _require(getattr(self, name) >= 1, prefix, name, getattr(self, name), ">= 1")
        _require(self.global_batch_size % self.micro_batch_size == 0, prefix,
                 "global_batch_size", self.global_batch_size,
                 f"a multiple of micro_batch_size={self.micro_batch_size}")
        _require(self.lr > 0, prefix, "lr", self.lr, "> 0")
        _require(0 <= self.min_lr_ratio <= 1, prefix, "min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        _require(0 <= self.warmup_fraction < 1, prefix, "warmup_fraction", self.warmup_fraction,
                 "in [0, 1)")
        _require(self.eval_interval >= 0, prefix, "eval_interval", self.eval_interval, ">= 0")
        _require(all(k >= 1 for k in self.eval_depths), prefix, "eval_depths", self.eval_depths,
                 "a list of iteration counts >= 1")
        _require(bool(self.out_dir.strip()), prefix, "out_dir", self.out_dir,
                 "a directory path (metrics, config.yaml and by default checkpoints go there)")
        _require(self.fp8_recipe is None or self.precision == "fp8", prefix, "fp8_recipe",
                 self.fp8_recipe, f"unset unless {prefix}.precision='fp8'")
        self.downstream_eval.validate(f"{prefix}.downstream_eval")

    @property
    def resolved_fp8_recipe(self) -> str | None:
        """The FP8 recipe a run uses, None without FP8."""
        if self.precision != "fp8":
            return None
        return self.fp8_recipe or "current"


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets written by tools/preprocess_data.py
    (``format=indexed``), or prompt/solution records for supervised fine-tuning (``format=sft``,
    megaloop.data.sft: .jsonl/.parquet files, loss on the solution tokens only)."""

    path: list[str] = field(default_factory=list)  # blend: [weight, prefix, ...] or [prefix, ...]
    split: str = "969,30,1"  # train,valid,test proportions of the blend
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None  # gives the EOD id and checks vocab_size
    eod_id: int | None = None  # only without tokenizer_model
    cache_dir: str | None = None  # shuffle-index cache; None: beside the first prefix
    eod_mask_loss: bool = False
    format: Literal["indexed", "sft"] = "indexed"
    # format=sft: Python format strings over a record's fields, tokenized separately.
    sft_prompt: str = "{prompt}"
    sft_solution: str = "{solution}"

    def validate(self, prefix: str = "data") -> None:
        from megaloop.data.tokenizer import TOKENIZER_TYPES

        _require(bool(self.path), prefix, "path", self.path,
                 "a non-empty list of dataset prefixes (optionally weighted)"
                 if self.format == "indexed" else "a non-empty list of .jsonl/.parquet files")
        if self.format == "sft":
            self._validate_sft(prefix)
        else:  # the SFT templates would be silently ignored
            for name in ("sft_prompt", "sft_solution"):
                _require(getattr(self, name) == getattr(DataConfig, name), prefix, name,
                         getattr(self, name), "left at its default unless data.format='sft'")
        _require((self.tokenizer_model is None) != (self.eod_id is None), prefix,
                 "tokenizer_model", self.tokenizer_model, "given, or else data.eod_id (not both)")
        _require(self.tokenizer_type in TOKENIZER_TYPES, prefix, "tokenizer_type",
                 self.tokenizer_type, f"one of {', '.join(TOKENIZER_TYPES)}")
        _require(split_weights(self.split) is not None, prefix, "split", self.split,
                 "up to three non-negative numbers train,valid,test with train > 0, e.g. '969,30,1'")

    def _validate_sft(self, prefix: str) -> None:
        _require(self.tokenizer_model is not None, prefix, "tokenizer_model",
                 self.tokenizer_model, "given for data.format='sft' (records are text)")
        for name in ("sft_prompt", "sft_solution"):
            _require(template_fields(getattr(self, name)) is not None, prefix, name,
                     getattr(self, name), "a format string naming record fields, e.g. "
                     "'Question: {question}'")
        # Nothing is cached, and the EOD closing each solution is how the model learns to stop.
        _require(self.cache_dir is None, prefix, "cache_dir", self.cache_dir,
                 "unset for data.format='sft' (its datasets cache nothing)")
        _require(not self.eod_mask_loss, prefix, "eod_mask_loss", self.eod_mask_loss,
                 "false for data.format='sft' (the EOD after a solution teaches the model to stop)")


def template_fields(template: str) -> tuple[str, ...] | None:
    """The record fields a format string names, in order of first use; None when it is malformed,
    names no field, or uses positional, attribute or index fields ("{}", "{a.b}", "{a[0]}")."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:
        return None
    names = [name for _, name, _, _ in parsed if name is not None]
    if not names or not all(name.isidentifier() for name in names):
        return None
    return tuple(dict.fromkeys(names))


def split_weights(split: str) -> list[float] | None:
    """A Megatron ``--split`` string ("969,30,1"; "/" also separates) as three weights, or None
    when malformed. megatron-core's own parser reads any digits it finds ("-1,2" as 1,2; "abc" as
    0,0,0, then divides by zero)."""
    parts = re.split(r"[,/]", split.strip())
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        return None
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights):
        return None
    return (weights + [0.0, 0.0])[:3] if weights[0] > 0 else None


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <train.out_dir>/checkpoints
    save_interval: int = 0  # 0: at the end (and on SIGTERM/SIGUSR1) only
    keep_last: int = 3
    resume: bool = True  # continue from the latest checkpoint in `dir` when there is one
    load: str | None = None  # a checkpoint directory to start from when `dir` has none
    # On resume the config's LR schedule (train_steps, warmup, lr, floor, Adam betas, weight
    # decay) replaces the checkpoint's, each change logged; true keeps the checkpoint's.
    keep_schedule: bool = False
    # A damaged checkpoint to resume from is an error naming the file; true resumes from the
    # newest earlier complete checkpoint instead (the damaged one is renamed *.damaged).
    fallback_to_previous: bool = False
    # dp_reshardable: fast, fully parallel, reloadable only with the same TP/PP layout;
    # fully_reshardable: gathers optimizer state at save so any TP/PP/DP layout can resume.
    optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    # False: only the weights of `load` (fine-tuning, a new parallel layout); the run's own
    # checkpoints in `dir` still resume with optimizer and progress.
    load_optimizer: bool = True

    def validate(self, prefix: str = "checkpoint") -> None:
        _require(self.save_interval >= 0, prefix, "save_interval", self.save_interval, ">= 0")
        _require(self.keep_last >= 1, prefix, "keep_last", self.keep_last, ">= 1")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    alrs: ALRSConfig = field(default_factory=ALRSConfig)

    def validate(self) -> "RunConfig":
        """Everything a training run needs, checked before any heavy work."""
        self.model.validate()
        self.parallel.validate(self.model)
        self.train.validate()
        self.data.validate()
        self.checkpoint.validate()
        _require(not (self.train.eval_depths and self.parallel.pipeline > 1), "train",
                 "eval_depths", self.train.eval_depths, "empty when parallel.pipeline > 1 (the "
                 "stages unroll exactly model.iterations iterations)")
        _require(not (self.train.eval_depths and self.model.arch == "dense"), "train",
                 "eval_depths", self.train.eval_depths,
                 "empty for model.arch=dense (a Dense model has no depth to vary)")
        downstream = self.train.downstream_eval
        if downstream.tasks:  # rank 0 evaluates its own copy of the whole model
            layout = (self.parallel.tensor, self.parallel.pipeline, self.parallel.expert)
            _require(layout == (1, 1, 1), "train.downstream_eval", "tasks", downstream.tasks,
                     f"empty with parallel tensor/pipeline/expert sizes {layout} (rank 0 holds "
                     "only part of the model); evaluate the checkpoints with tools/evaluate.py")
            _require(self.data.tokenizer_model is not None, "train.downstream_eval", "tasks",
                     downstream.tasks, "empty without data.tokenizer_model (the tasks are text)")
        # Transformer Engine's recompute replays delayed-scaling state first in, first out, but a
        # weight-tied block recomputes its K calls last to first: call K would get call 1's scales.
        _require(not (self.train.resolved_fp8_recipe == "delayed"
                      and self.parallel.recompute == "full" and self.model.num_iterations > 1),
                 "train", "fp8_recipe", self.train.fp8_recipe,
                 "'current' or 'mxfp8' with parallel.recompute=full and a looped model "
                 "(delayed scaling would recompute iteration K with iteration 1's scales)")
        return self


def _divisors(n: int, limit: int | None = None) -> str:
    """"1, 2, 4, 8": the divisors of ``n`` up to ``limit``, for error messages."""
    return ", ".join(str(d) for d in range(1, min(n, limit or n) + 1) if n % d == 0)


def _require(ok: bool, prefix: str, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{prefix}.{name}={value!r}: must be {allowed}")


# --------------------------------------------------------------------------------------------
# dict / YAML round trip and dotted overrides
# --------------------------------------------------------------------------------------------

def to_dict(cfg) -> dict:
    """Plain dict of a config; tuples become lists so that yaml.safe_dump can write it."""
    return dataclasses.asdict(cfg, dict_factory=lambda items: {
        k: list(v) if isinstance(v, tuple) else v for k, v in items})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Checks ``value`` against a field's type hint, converting ints to floats where declared."""
    origin = get_origin(hint)
    if origin is Literal:
        if value not in get_args(hint):
            allowed = ", ".join(repr(a) for a in get_args(hint))
            raise ConfigError(f"{where}={value!r}: must be one of {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(get_args(hint)):
            return None
        return _coerce(value, args[0], where)
    if origin is list:
        item = get_args(hint)[0]
        if not isinstance(value, list):  # a single value where a list is expected
            value = [value]
        if item is str:  # blend weights in a data path arrive as YAML numbers
            value = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                     for v in value]
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a mapping of {hint.__name__} fields")
        return from_dict(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and not isinstance(value, hint) or (
        hint is int and isinstance(value, bool)
    ):
        raise ConfigError(f"{where}={value!r}: must be of type {hint.__name__}")
    return value


def from_dict(cls, data: dict, where: str = ""):
    """Builds dataclass ``cls`` from a (possibly partial) dict, rejecting unknown keys."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown field {path}{hint}")
        kwargs[key] = _coerce(value, hints[key], path)
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own __post_init__ checks (e.g. ALRSConfig)
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Applies ``section.field=value`` strings; values are parsed as YAML scalars."""
    data = to_dict(cfg)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected the form section.field=value")
        node, parts = data, key.split(".")
        for depth, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth + 1])} is not a section")
            node = node[part]
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML (quote it, or "
                              "write lists as [a, b])") from None
    return from_dict(RunConfig, data)


def _deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _deep_merge(merged[key], value)
        merged[key] = value
    return merged


def load_yaml(path: str | os.PathLike, base: RunConfig | None = None) -> RunConfig:
    """Reads a (possibly partial) YAML run config; its fields replace those of ``base``."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    try:
        return from_dict(RunConfig, _deep_merge(to_dict(base or RunConfig()), data))
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes a temporary file in the same directory, then renames it over ``path``. The file gets
    the permissions a plain ``open`` gives (0666 less the umask: 0644 under umask 022), not
    ``tempfile.mkstemp``'s 0600, so that teammates can read a shared run."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_yaml(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Writes atomically (``write_text_atomic``)."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
