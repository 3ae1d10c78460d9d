"""The run's other sections (parallel, train, data, checkpoint; alrs lives in megaloop.alrs) and
``RunConfig``, which holds them with the model and checks the settings that span sections."""

from __future__ import annotations

import dataclasses
import math
import string
from dataclasses import dataclass, field
from typing import Literal

from megaloop.alrs.schedule import ALRSConfig
from megaloop.config.errors import (ConfigError, divisors_text, require, require_finite,
                                    require_no_tilde)
from megaloop.config.model import ModelConfig
from megaloop.data.blend import SPLIT_RULE, parse_blend, split_weights  # split_weights re-exported
from megaloop.data.readers import DataError

# Transformer Engine FP8 scaling recipes: "current" (per-tensor current scaling, TE >= 2.2),
# "delayed" (amax history) and "mxfp8" (block scaling, Blackwell GPUs).
Fp8Recipe = Literal["current", "delayed", "mxfp8"]

# megatron-core's selective recomputation modules (--recompute-modules) that megaloop's layers have
# (not mla_up_proj: no multi-latent attention). ``parallel.recompute_modules`` empty: core_attn.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts")
# Those that megatron-core checkpoints with Transformer Engine's checkpoint under FP8 (their FP8
# weights' scales are saved per call for the replay) or that it refuses with delayed scaling.
FP8_SCALED_RECOMPUTE = ("layernorm", "mlp", "moe", "moe_act", "shared_experts")


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
    # Activation recomputation (megatron-core's --recompute-granularity): "full" replays every
    # layer in the backward pass, "selective" only ``recompute_modules`` of each layer.
    recompute: Literal["none", "full", "selective"] = "none"
    recompute_modules: list[str] = field(default_factory=list)
    virtual_pipeline: int = 1
    pipeline_split: list[int] = field(default_factory=list)
    # How long a collective waits for the other ranks before the run fails (megatron-core's
    # default for its groups; NCCL's own, 10, can be shorter than rank 0 building the dataset
    # indices of a large blend on the first launch while the others wait).
    distributed_timeout_minutes: int = 30
    # Megatron-LM's --overlap-grad-reduce / --overlap-param-gather: each DDP bucket's gradient
    # reduce(-scatter) starts in the backward pass of the last micro-batch as soon as the bucket is
    # complete, and (distributed optimizer only) the updated parameters' all-gather runs during the
    # next forward, bucket by bucket (megaloop.training.ddp). ddp_bucket_size: elements per bucket
    # (0: megatron-core's default, max(4e7, 1e6 x data-parallel size)).
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int = 0

    @property
    def selective_modules(self) -> list[str]:
        """The modules selective recomputation replays (megatron-core's default ["core_attn"]
        when ``recompute_modules`` is empty); [] unless recompute=selective."""
        if self.recompute != "selective":
            return []
        return list(self.recompute_modules) or ["core_attn"]

    @property
    def pipeline_stages(self) -> int:
        """Stages of the chain: pipeline ranks x model chunks per rank."""
        return self.pipeline * self.virtual_pipeline

    def validate(self, model: ModelConfig, prefix: str = "parallel") -> None:
        for name in ("tensor", "pipeline", "expert", "virtual_pipeline",
                     "distributed_timeout_minutes"):
            require(getattr(self, name) >= 1, prefix, name, getattr(self, name), ">= 1")
        # Beyond Python's timedelta (the process group's timeout) a traceback at start-up.
        require(self.distributed_timeout_minutes <= 10**9, prefix, "distributed_timeout_minutes",
                self.distributed_timeout_minutes, "<= 1000000000 (some 1900 years: for ever)")
        tp = self.tensor
        # Tensor parallelism splits heads, query groups, FFN columns and the vocabulary.
        split = {name: getattr(model, name) for name in (
            "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "decoder_ffn_hidden_size", "vocab_size")}
        if model.uses_moe and model.moe_ffn_hidden_size:  # experts split like the FFN
            split["moe_ffn_hidden_size"] = model.moe_ffn_hidden_size
        if model.uses_moe and model.moe_shared_expert_size:  # and the shared expert
            split["moe_shared_expert_size"] = model.moe_shared_expert_size
        undivided = [f"model.{name}={size}" for name, size in split.items() if size % tp]
        pad = "; or pad the vocabulary" if split["vocab_size"] % tp else ""
        require(not undivided, prefix, "tensor", tp,
                f"a divisor of {', '.join(undivided)} (tensor sizes that divide the heads, query "
                f"groups, FFN widths and vocabulary: {divisors_text(math.gcd(*split.values()))}"
                f"{pad})")
        require(not self.sequence_parallel or tp > 1, prefix, "sequence_parallel",
                self.sequence_parallel, "false unless tensor > 1 (it splits the sequence over TP)")
        require(not self.sequence_parallel or model.seq_length % tp == 0, prefix,
                "sequence_parallel", self.sequence_parallel,
                f"false, or parallel.tensor={tp} a divisor of model.seq_length="
                f"{model.seq_length} (sequence parallelism splits the sequence over the "
                f"tensor-parallel ranks; sizes that fit: {divisors_text(model.seq_length, 64)})")
        if self.expert > 1:
            require(model.uses_moe, prefix, "expert", self.expert,
                    "1 unless model.num_experts > 0 (expert parallelism splits the experts)")
            require(model.num_experts % self.expert == 0, prefix, "expert", self.expert,
                    f"a divisor of model.num_experts={model.num_experts}")
        require(not (self.sequence_parallel and model.arch == "latentloop"), prefix,
                "sequence_parallel", self.sequence_parallel,
                "false for model.arch=latentloop (the writeback shifts across sequence shards)")
        if model.uses_moe and tp > 1:
            require(self.sequence_parallel, prefix, "tensor", tp,
                    "1 for a MoE model unless parallel.sequence_parallel=true (megatron-core's "
                    "MoE layer needs sequence parallelism with tensor parallelism)")
        self._validate_recompute(model, prefix)
        self._validate_pipeline(model, prefix)

    def _validate_recompute(self, model: ModelConfig, prefix: str) -> None:
        modules = self.recompute_modules
        require(not modules or self.recompute == "selective", prefix, "recompute_modules",
                modules, "empty unless parallel.recompute=selective (it names what selective "
                "recomputation replays)")
        for name in modules:
            require(name in RECOMPUTE_MODULES, prefix, "recompute_modules", modules,
                    f"names from {', '.join(RECOMPUTE_MODULES)} ({name!r} is not one)")
            why = _recompute_module_absent(model, name)
            require(why is None, prefix, "recompute_modules", modules,
                    f"modules the model has ({name!r}: {why})")
        require(len(set(modules)) == len(modules), prefix, "recompute_modules", modules,
                "each module once")

    def _validate_pipeline(self, model: ModelConfig, prefix: str) -> None:
        from megaloop.models.pipeline import chain_length, check_split

        require(self.virtual_pipeline == 1 or self.pipeline > 1, prefix, "virtual_pipeline",
                self.virtual_pipeline, "1 unless parallel.pipeline > 1 (it interleaves the "
                "pipeline ranks' model chunks)")
        if self.pipeline == 1:
            require(not self.pipeline_split, prefix, "pipeline_split", self.pipeline_split,
                    "empty unless parallel.pipeline > 1")
            return
        require(model.arch != "latentloop", prefix, "pipeline", self.pipeline,
                "1 for model.arch=latentloop (its visits are distinct modules with their own "
                "compression and scales; pipeline parallelism covers dense, fullloop and "
                "asymloop: use tensor/data/expert parallelism)")
        require(self.virtual_pipeline == 1 or not model.uses_moe, prefix, "virtual_pipeline",
                self.virtual_pipeline, "1 for a MoE model (its routing statistics are kept "
                "per model chunk)")
        stages, total = self.pipeline_stages, chain_length(model)
        require(stages <= total, prefix, "pipeline", self.pipeline,
                f"such that pipeline x virtual_pipeline = {stages} stages get at least one of "
                f"the model's {total} layer applications each (at most {total} stages)")
        if self.pipeline_split:
            check_split(model, self.pipeline_split, stages, f"{prefix}.pipeline_split")

    def validate_overlap(self, distributed_optimizer: bool, prefix: str = "parallel") -> None:
        """The data-parallel overlap settings (``ddp_bucket_size`` read only with overlap)."""
        require(self.ddp_bucket_size >= 0, prefix, "ddp_bucket_size", self.ddp_bucket_size,
                ">= 0")
        require(not self.ddp_bucket_size or self.overlap_grad_reduce, prefix, "ddp_bucket_size",
                self.ddp_bucket_size, "0 unless parallel.overlap_grad_reduce=true (without "
                "overlap every gradient buffer is reduced as one bucket)")
        require(not self.overlap_param_gather or distributed_optimizer, prefix,
                "overlap_param_gather", True, "false unless train.distributed_optimizer=true "
                "(only the distributed optimizer all-gathers parameters)")
        require(not self.overlap_param_gather or self.overlap_grad_reduce, prefix,
                "overlap_param_gather", True, "false unless parallel.overlap_grad_reduce=true "
                "(megatron-core's parameter all-gather hooks expect overlapped reduction)")


def _recompute_module_absent(model: ModelConfig, name: str) -> str | None:
    """Why selective recomputation of ``name`` would replay nothing in ``model`` (None: it has
    such modules). megatron-core skips an absent module silently."""
    if name in ("moe", "moe_act") and not model.uses_moe:
        return "no MoE layer without model.num_experts > 0"
    if name == "shared_experts" and not (model.uses_moe and model.moe_shared_expert_size):
        return "no shared expert without model.moe_shared_expert_size > 0"
    if name == "mlp" and model.uses_moe and model.moe_layers == "all":
        return "every FFN is a MoE layer (recompute those with 'moe' or 'moe_act')"
    if name == "layernorm" and model.block == "olmo":
        return "model.block=olmo has no pre-norms (its norms sit inside the sublayers)"
    return None


def refuse_settings_while_off(section, switch: str, prefix: str, wanted: str) -> None:
    """A section that is off (its ``switch`` field empty) would ignore any other field set: the
    first one that differs from its default is refused, naming ``switch`` and ``wanted``."""
    default = type(section)()
    changed = [f.name for f in dataclasses.fields(section)
               if getattr(section, f.name) != getattr(default, f.name)]
    require(not changed, prefix, switch, getattr(section, switch),
            f"{wanted} when {prefix}.{changed[0] if changed else ''} is set")


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
    max_gen_toks: int | None = None  # new tokens of the generation tasks; None: each task's own

    def validate(self, prefix: str = "train.downstream_eval") -> None:
        if not self.tasks:
            refuse_settings_while_off(self, "tasks", prefix, "set (a list of task names or tags)")
            return
        require(self.data_dir is not None, prefix, "data_dir", self.data_dir,
                "the directory of the tasks' data files")
        require(self.limit is None or self.limit >= 1, prefix, "limit", self.limit,
                ">= 1 or null (all records)")
        for name, low in (("num_fewshot", 0), ("every", 1), ("batch_size", 1)):
            require(getattr(self, name) >= low, prefix, name, getattr(self, name), f">= {low}")
        require(self.max_gen_toks is None or self.max_gen_toks >= 1, prefix, "max_gen_toks",
                self.max_gen_toks, ">= 1 or null (each generation task's own)")


@dataclass
class ProfileConfig:
    """Traces of training steps ``steps`` = [first, last] (megaloop.training.profiling): a Chrome
    trace and an operator table per rank of ``ranks``, in ``dir`` (None: <train.out_dir>/profile).
    ``memory``: also CUDA's allocator history (GPU only). ``with_stack``: Python call stacks in the
    trace (larger files, slower steps). Empty ``steps``: off."""

    steps: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=lambda: [0])
    dir: str | None = None
    memory: bool = False
    with_stack: bool = False

    def validate(self, train_steps: int, prefix: str = "train.profile") -> None:
        if not self.steps:
            refuse_settings_while_off(self, "steps", prefix, "[first, last] (the steps to trace)")
            return
        require(len(self.steps) == 2 and 1 <= self.steps[0] <= self.steps[1] <= train_steps,
                prefix, "steps", self.steps,
                f"[first, last] with 1 <= first <= last <= train.train_steps={train_steps}")
        require(bool(self.ranks) and min(self.ranks) >= 0
                and len(set(self.ranks)) == len(self.ranks), prefix, "ranks", self.ranks,
                "a list of distinct global ranks >= 0")
        require(self.dir is None or bool(self.dir.strip()), prefix, "dir", self.dir,
                "a directory path, or null (<train.out_dir>/profile)")
        require_no_tilde(prefix, "dir", self.dir)


@dataclass
class TrainConfig:
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_steps: int = 100
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.1
    # After the linear warmup: cosine or linear decay to min_lr_ratio x lr at train_steps, or
    # "wsd" (warmup-stable-decay): lr until the last wsd_decay_fraction of the steps (None: 0.2),
    # then a wsd_decay_style decay (None: linear) to the floor. min_lr_ratio=1 holds lr constant.
    lr_schedule: Literal["cosine", "linear", "wsd"] = "cosine"
    wsd_decay_fraction: float | None = None
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] | None = None
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
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def validate(self, prefix: str = "train") -> None:
        for name in ("micro_batch_size", "global_batch_size", "train_steps", "log_interval",
                     "eval_iters", "max_nonfinite_steps"):
            require(getattr(self, name) >= 1, prefix, name, getattr(self, name), ">= 1")
        require(self.global_batch_size % self.micro_batch_size == 0, prefix,
                "global_batch_size", self.global_batch_size,
                f"a multiple of micro_batch_size={self.micro_batch_size}")
        require(self.lr > 0, prefix, "lr", self.lr, "> 0")
        require(0 <= self.min_lr_ratio <= 1, prefix, "min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        require(0 <= self.warmup_fraction < 1, prefix, "warmup_fraction", self.warmup_fraction,
                "in [0, 1)")
        for name in ("wsd_decay_fraction", "wsd_decay_style"):
            require(self.lr_schedule == "wsd" or getattr(self, name) is None, prefix, name,
                    getattr(self, name), f"unset unless {prefix}.lr_schedule='wsd'")
        if self.lr_schedule == "wsd":
            fraction, decay = self.resolved_wsd_decay_fraction, self.wsd_decay_steps
            warmup = self.warmup_steps
            require(0 < fraction <= 1 and warmup + decay <= self.train_steps, prefix,
                    "wsd_decay_fraction", fraction,
                    f"in (0, 1], for a decay that starts after the warmup (here {decay} decay + "
                    f"{warmup} warmup steps of train_steps={self.train_steps})")
        # torch's Adam and numpy's seeding would refuse these with a traceback once the model is
        # built; a negative clip_grad or weight_decay would turn clipping off or grow the weights.
        for name in ("adam_beta1", "adam_beta2"):
            require(0 <= getattr(self, name) < 1, prefix, name, getattr(self, name), "in [0, 1)")
        require(self.weight_decay >= 0, prefix, "weight_decay", self.weight_decay, ">= 0")
        require(self.clip_grad >= 0, prefix, "clip_grad", self.clip_grad, ">= 0 (0: no clipping)")
        require(0 <= self.seed < 2**32, prefix, "seed", self.seed, "in [0, 2**32 - 1]")
        require(self.eval_interval >= 0, prefix, "eval_interval", self.eval_interval, ">= 0")
        require(self.peak_tflops is None or self.peak_tflops > 0, prefix, "peak_tflops",
                self.peak_tflops, "> 0, or null (a known GPU's own peak; no MFU on CPU)")
        require(all(k >= 1 for k in self.eval_depths)
                and len(set(self.eval_depths)) == len(self.eval_depths), prefix, "eval_depths",
                self.eval_depths, "a list of distinct iteration counts >= 1")
        require(bool(self.out_dir.strip()), prefix, "out_dir", self.out_dir,
                "a directory path (metrics, config.yaml and by default checkpoints go there)")
        require_no_tilde(prefix, "out_dir", self.out_dir)
        require(self.fp8_recipe is None or self.precision == "fp8", prefix, "fp8_recipe",
                self.fp8_recipe, f"unset unless {prefix}.precision='fp8'")
        self.downstream_eval.validate(f"{prefix}.downstream_eval")
        self.profile.validate(self.train_steps, f"{prefix}.profile")

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_fraction * self.train_steps)

    @property
    def resolved_wsd_decay_fraction(self) -> float | None:
        """The WSD decay's share of the steps in effect; None for another schedule."""
        if self.lr_schedule != "wsd":
            return None
        return 0.2 if self.wsd_decay_fraction is None else self.wsd_decay_fraction

    @property
    def resolved_wsd_decay_style(self) -> str | None:
        return (self.wsd_decay_style or "linear") if self.lr_schedule == "wsd" else None

    @property
    def wsd_decay_steps(self) -> int | None:
        """Rounded down as the warmup's are, from 9 decimals so that 0.29 x 100 is 29, not 28."""
        fraction = self.resolved_wsd_decay_fraction
        return None if fraction is None else max(1, math.floor(round(fraction
                                                                     * self.train_steps, 9)))

    @property
    def resolved_fp8_recipe(self) -> str | None:
        """The FP8 recipe a run uses, None without FP8."""
        if self.precision != "fp8":
            return None
        return self.fp8_recipe or "current"


def micro_batches_per_step(train: TrainConfig, parallel: ParallelConfig,
                           data_parallel_size: int) -> int:
    """Micro-batches of one optimizer step on each of ``data_parallel_size`` data-parallel ranks;
    a ConfigError line for a global batch that does not split into them, which a launch must
    refuse at start-up (and a dry run or estimate must not call fine)."""
    per_step = train.micro_batch_size * data_parallel_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size}: must be a multiple of "
            f"micro_batch_size x data-parallel size = {train.micro_batch_size} x "
            f"{data_parallel_size} = {per_step}")
    micro = train.global_batch_size // per_step
    if parallel.virtual_pipeline > 1 and micro % parallel.pipeline:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size}: the interleaved schedule "
            f"(parallel.virtual_pipeline={parallel.virtual_pipeline}) runs micro-batches in "
            f"groups of parallel.pipeline={parallel.pipeline}, but a step has {micro} per "
            f"data-parallel rank; use a multiple of {per_step * parallel.pipeline}")
    return micro


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets written by tools/preprocess_data.py
    (``format=indexed``), or prompt/solution records for supervised fine-tuning (``format=sft``,
    megaloop.data.sft: .jsonl/.parquet files, loss on the solution tokens only)."""

    path: list[str] = field(default_factory=list)  # blend: [weight, prefix, ...] or [prefix, ...]
    split: str = "969,30,1"  # train,valid,test proportions of the blend
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None  # gives the EOD id and checks vocab_size
    # Encode as tools/preprocess_data.py --legacy-tokenizer did (SentencePieceTokenizer: EOD is an
    # added <EOD> id past the model's pieces), so training ends documents with the data's EOD id.
    legacy_tokenizer: bool = False
    eod_id: int | None = None  # only without tokenizer_model
    cache_dir: str | None = None  # shuffle-index cache; None: beside the first prefix
    eod_mask_loss: bool = False
    format: Literal["indexed", "sft"] = "indexed"
    # format=sft: Python format strings over a record's fields, tokenized separately.
    sft_prompt: str = "{prompt}"
    sft_solution: str = "{solution}"

    def validate(self, prefix: str = "data") -> None:
        from megaloop.data.tokenizer import LEGACY_CHANGES, TOKENIZER_TYPES

        require(bool(self.path), prefix, "path", self.path,
                "a non-empty list of dataset prefixes (optionally weighted)"
                if self.format == "indexed" else "a non-empty list of .jsonl/.parquet files")
        # "data.path=" (a value forgotten) is [""]: no file, and no field named where it failed.
        require(all(str(item).strip() for item in self.path), prefix, "path", self.path,
                "free of empty entries (an empty prefix or file names no data)")
        try:  # a bad weight, refused here, not once the run has started
            weights = parse_blend(self.path)[1]
        except DataError as e:
            raise ConfigError(f"{prefix}.path={self.path!r}: {e}") from None
        if self.format == "sft":
            require(weights is None, prefix, "path", self.path, "a list of .jsonl/.parquet "
                    "files, used whole (data.format='sft' takes no blend weights)")
            self._validate_sft(prefix)
        else:  # the SFT templates would be silently ignored
            for name in ("sft_prompt", "sft_solution"):
                require(getattr(self, name) == getattr(DataConfig, name), prefix, name,
                        getattr(self, name), "left at its default unless data.format='sft'")
        require((self.tokenizer_model is None) != (self.eod_id is None), prefix,
                "tokenizer_model", self.tokenizer_model, "given, or else data.eod_id (not both)")
        require(self.tokenizer_type in TOKENIZER_TYPES, prefix, "tokenizer_type",
                self.tokenizer_type, f"one of {', '.join(TOKENIZER_TYPES)}")
        require(self.tokenizer_model is not None
                or self.tokenizer_type == DataConfig.tokenizer_type, prefix, "tokenizer_type",
                self.tokenizer_type, f"left at its default {DataConfig.tokenizer_type!r} unless "
                f"{prefix}.tokenizer_model is given (with {prefix}.eod_id alone no tokenizer "
                "is loaded)")
        require(self.tokenizer_model is not None or not self.legacy_tokenizer, prefix,
                "legacy_tokenizer", self.legacy_tokenizer, f"false unless {prefix}.tokenizer_model "
                f"is given (with {prefix}.eod_id alone no tokenizer is loaded)")
        require(self.tokenizer_type in LEGACY_CHANGES or not self.legacy_tokenizer, prefix,
                "legacy_tokenizer", self.legacy_tokenizer,
                f"false with {prefix}.tokenizer_type={self.tokenizer_type!r}, which Megatron-LM's "
                f"legacy and new tokenizers encode alike (it changes {', '.join(LEGACY_CHANGES)})")
        require(split_weights(self.split) is not None, prefix, "split", self.split, SPLIT_RULE)
        for name in ("path", "tokenizer_model", "cache_dir"):
            require_no_tilde(prefix, name, getattr(self, name))

    def _validate_sft(self, prefix: str) -> None:
        require(self.tokenizer_model is not None, prefix, "tokenizer_model",
                self.tokenizer_model, "given for data.format='sft' (records are text)")
        for name in ("sft_prompt", "sft_solution"):
            require(template_fields(getattr(self, name)) is not None, prefix, name,
                    getattr(self, name), "a format string naming record fields, e.g. "
                    "'Question: {question}'")
        # Nothing is cached, and the EOD closing each solution is how the model learns to stop.
        require(self.cache_dir is None, prefix, "cache_dir", self.cache_dir,
                "unset for data.format='sft' (its datasets cache nothing)")
        require(not self.eod_mask_loss, prefix, "eod_mask_loss", self.eod_mask_loss,
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
    # True: a periodic save's write runs in the background (megatron-core's asynchronous save)
    # while training goes on; `latest` moves once every rank's write is complete. The
    # checkpoints are the same; a resume may change it.
    async_save: bool = False

    def validate(self, train_steps: int, prefix: str = "checkpoint") -> None:
        require(self.save_interval >= 0, prefix, "save_interval", self.save_interval, ">= 0")
        # The final save and a stop signal's wait for their write: only periodic saves gain, and
        # there is none with save_interval=0 or above train.train_steps.
        require(not self.async_save or 0 < self.save_interval <= train_steps, prefix,
                "async_save", self.async_save,
                f"false with {prefix}.save_interval={self.save_interval}"
                + (f" > train.train_steps={train_steps}" if self.save_interval else "")
                + " (only the final and stop-signal saves, which wait for their write, so it "
                "would change nothing)")
        require(self.keep_last >= 1, prefix, "keep_last", self.keep_last, ">= 1")
        for name in ("dir", "load"):
            require_no_tilde(prefix, name, getattr(self, name))
        require(self.load_optimizer or self.load is not None, prefix, "load_optimizer",
                self.load_optimizer, f"left at true unless {prefix}.load is given (it concerns "
                f"that checkpoint only; a run's own checkpoints in {prefix}.dir always resume "
                "with their optimizer state)")


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
        for section in dataclasses.fields(self):
            require_finite(getattr(self, section.name), section.name)
        self.model.validate()
        model = self.model
        require(model.arch != "latentloop" or model.seq_length % model.latent_stride == 0,
                "model", "latent_stride", model.latent_stride,
                f"a divisor of model.seq_length={model.seq_length} for training (whole latents in "
                "every training sequence; a loaded model infers at any length)")
        self.parallel.validate(self.model)
        self.parallel.validate_overlap(self.train.distributed_optimizer)
        self.train.validate()
        self.data.validate()
        self.checkpoint.validate(self.train.train_steps)
        require(not (self.train.eval_depths and self.parallel.pipeline > 1), "train",
                "eval_depths", self.train.eval_depths, "empty when parallel.pipeline > 1 (the "
                "stages unroll exactly model.iterations iterations)")
        require(not (self.train.eval_depths and self.model.arch == "dense"), "train",
                "eval_depths", self.train.eval_depths,
                "empty for model.arch=dense (a Dense model has no depth to vary)")
        # Checked here, not first by the final evaluation after the last step (before its save).
        refusal = next((f"{k}: {why}" for k in self.train.eval_depths
                        if (why := self.model.depth_refusal(k))), None)
        require(refusal is None, "train", "eval_depths", self.train.eval_depths,
                f"depths the model runs ({refusal})")
        if not self.train.use_alrs:  # the alrs section would be silently ignored
            # ...except granularity, which also shapes the optimizer's LR multipliers.
            changed = [f"alrs.{f.name}={getattr(self.alrs, f.name)!r}"
                       for f in dataclasses.fields(self.alrs) if f.name != "granularity"
                       and getattr(self.alrs, f.name) != getattr(ALRSConfig(), f.name)]
            require(not changed, "train", "use_alrs", False,
                    f"true when {changed[0] if changed else ''} is set (the alrs section is read "
                    "only with ALRS on)")
        downstream = self.train.downstream_eval
        if downstream.tasks:  # rank 0 evaluates its own copy of the whole model
            layout = (self.parallel.tensor, self.parallel.pipeline, self.parallel.expert)
            require(layout == (1, 1, 1), "train.downstream_eval", "tasks", downstream.tasks,
                    f"empty with parallel tensor/pipeline/expert sizes {layout} (rank 0 holds "
                    "only part of the model); evaluate the checkpoints with tools/evaluate.py")
            require(self.data.tokenizer_model is not None, "train.downstream_eval", "tasks",
                    downstream.tasks, "empty without data.tokenizer_model (the tasks are text)")
        self._validate_fp8_recompute()
        return self

    def _validate_fp8_recompute(self) -> None:
        """Delayed FP8 scaling with recomputation of modules that have FP8 weights.

        Transformer Engine's checkpoint (full recomputation; selective ``mlp``, ``moe``,
        ``shared_experts`` under FP8) replays delayed-scaling state first in, first out, but a
        weight-tied block recomputes its K calls last to first: call K would get call 1's scales.
        megatron-core refuses delayed scaling with ``layernorm`` and ``moe_act`` for any model.
        Selective ``core_attn`` is safe with every recipe: megatron-core replays it with its own
        checkpoint, and core attention holds no FP8 state (no weights; megaloop leaves FP8
        dot-product attention off, so Transformer Engine's attention computes in bf16 in the
        forward and the replay alike; the joint attention is megaloop's own kernel)."""
        if self.train.resolved_fp8_recipe != "delayed":
            return
        looped = self.model.num_iterations > 1
        require(not (self.parallel.recompute == "full" and looped), "train", "fp8_recipe",
                self.train.fp8_recipe,
                "'current' or 'mxfp8' with parallel.recompute=full and a looped model "
                "(delayed scaling would recompute iteration K with iteration 1's scales)")
        unsafe = [m for m in self.parallel.selective_modules if m in FP8_SCALED_RECOMPUTE
                  and (looped or m in ("layernorm", "moe_act"))]
        require(not unsafe, "train", "fp8_recipe", self.train.fp8_recipe,
                f"'current' or 'mxfp8' with parallel.recompute_modules={unsafe}"
                + (" and a looped model (delayed scaling would recompute iteration K with "
                   "iteration 1's scales)" if looped and set(unsafe) - {"layernorm", "moe_act"}
                   else " (megatron-core supports no delayed scaling there)"))
