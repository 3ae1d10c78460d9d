"""The model section of a run: ``ModelConfig``, its architectures and their derived defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from megaloop.config.errors import require, require_finite

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
# Head dimensions the CUDA flash kernel behind the fused joint attention takes.
FLASH_HEAD_DIM_MULTIPLE, FLASH_MAX_HEAD_DIM = 8, 256


# The paper's headline comparison at matched effective depth J = 2L: AsymLoop K = 3, Full Loop R = 2.
DEFAULT_ITERATIONS = {"dense": 1, "fullloop": 2, "asymloop": 3, "latentloop": 2}


# ModelConfig fields that only some models read: (whether this model reads them, the models that
# do). One set on another model would be silently ignored, so validate() refuses it.
_LATENTLOOP_ONLY = (lambda m: m.arch == "latentloop", "arch=latentloop")
_MOE_ONLY = (lambda m: m.uses_moe, "num_experts > 0")
_CONDITIONAL_FIELDS = {
    **dict.fromkeys(("encoder_layers", "injection", "local_kv"),
                    (lambda m: m.arch == "asymloop", "arch=asymloop")),
    "global_kv_norm": (lambda m: m.uses_global_kv, "arch=asymloop with injection='global_kv'"),
    "joint_attention": (lambda m: m.decoder_attention == "joint",
                        "arch=asymloop with injection='global_kv' and local_kv=true"),
    **dict.fromkeys(("moe_layers", "moe_top_k", "moe_ffn_hidden_size", "moe_shared_expert_size",
                     "moe_aux_loss_coeff", "moe_z_loss_coeff"), _MOE_ONLY),
    **dict.fromkeys(("prelude_layers", "coda_layers", "latent_visits", "latent_stride",
                     "latent_writeback_lag", "latent_reduction", "residual_scale",
                     "residual_scale_init", "untie_attention", "untie_moe"), _LATENTLOOP_ONLY),
}


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
    latent_visits: list[int] = field(default_factory=lambda: [1])  # reduced visits, 1-based, any order
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

    def depth_refusal(self, depth: int) -> str | None:
        """Why this model cannot run test-time depth ``depth`` (a phrase naming the arch, for the
        caller to put after the value it was given as); None where it can. Dense has no depth but
        its own 1; LatentLoop's visits each have their own scales, so it runs exactly its
        configured number; the looped models run any depth >= 1."""
        if depth < 1:
            return "must be >= 1"
        if self.arch == "dense" and depth != 1:
            return ("arch=dense has no depth to vary (it would loop its layers; arch=fullloop is "
                    "the looped stack)")
        if self.arch == "latentloop" and depth != self.num_iterations:
            return (f"arch=latentloop runs exactly its iterations={self.num_iterations} visits "
                    "(each has its own scales)")
        return None

    def replaced_by_loaded_weights(self) -> dict[str, str]:
        """{field: why} for the initial values that weights loaded from a checkpoint replace, so
        that a value of them other than the checkpoint's has no effect on a loaded model."""
        replaced = {"init_std": "it initialises weights, and these come from the checkpoint"}
        if self.residual_scale == "learned":
            replaced["residual_scale_init"] = ("learned residual scales are weights, restored "
                                               "from the checkpoint")
        return replaced

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
        # A set of visit numbers: [2, 1] and [1, 2] are one model (checkpoints, config.json).
        self.latent_visits = sorted(self.latent_visits)
        # A moe_top_k below 1 is refused by validate, which resolves first: nothing to derive.
        if self.uses_moe and self.moe_ffn_hidden_size is None and self.moe_top_k >= 1:
            # Paper App. I: top-k experts of width FFN / k keep the active FFN parameters.
            self.moe_ffn_hidden_size = max(1, self.ffn_hidden_size // self.moe_top_k)
        return self

    def validate(self, prefix: str = "model") -> None:
        self.resolve()
        require_finite(self, prefix)
        self._validate_unused(prefix)
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "seq_length", "iterations",
                     "decoder_ffn_hidden_size"):
            require(getattr(self, name) >= 1, prefix, name, getattr(self, name), ">= 1")
        # Refused here, not as a traceback from torch at initialisation or NaN steps from RoPE.
        for name, low in (("rotary_base", 0), ("init_std", 0)):
            require(getattr(self, name) > low, prefix, name, getattr(self, name), f"> {low}")
        require(self.norm_eps >= 0, prefix, "norm_eps", self.norm_eps, ">= 0")
        if self.head_dim is None:
            require(self.hidden_size % self.num_attention_heads == 0, prefix, "hidden_size",
                    self.hidden_size, f"a multiple of num_attention_heads="
                    f"{self.num_attention_heads} (or set head_dim)")
        else:
            require(self.head_dim >= 2, prefix, "head_dim", self.head_dim, ">= 2")
        require(self.num_attention_heads % self.num_query_groups == 0, prefix,
                "num_query_groups", self.num_query_groups,
                f"a divisor of num_attention_heads={self.num_attention_heads}")
        # The field that sets the head dim, to name in errors.
        head_field = ("head_dim", self.head_dim) if self.head_dim else ("hidden_size",
                                                                         self.hidden_size)
        require(self.kv_channels % 2 == 0, prefix, *head_field,
                "such that the head dim is even (RoPE rotates pairs)")
        if self.decoder_attention == "joint" and self.joint_attention == "fused":
            head_dim = self.kv_channels
            require(head_dim % FLASH_HEAD_DIM_MULTIPLE == 0 and head_dim <= FLASH_MAX_HEAD_DIM,
                    prefix, *head_field, f"such that the head dim (here {head_dim}) is a multiple of "
                    f"{FLASH_HEAD_DIM_MULTIPLE} and at most {FLASH_MAX_HEAD_DIM}, the limits of "
                    "the CUDA flash kernel behind joint_attention=fused (or use "
                    "joint_attention=masked)")
        if self.arch == "dense":
            require(self.iterations == 1, prefix, "iterations", self.iterations,
                    "1 for arch=dense (use arch=fullloop to loop the stack)")
        if self.arch == "asymloop":
            e = self.encoder_layers
            require(1 <= e < self.num_layers, prefix, "encoder_layers", e,
                    f"in [1, {self.num_layers - 1}] so that E + D = num_layers={self.num_layers} "
                    "with D >= 1")
            require(self.local_kv or self.injection == "global_kv", prefix, "local_kv",
                    self.local_kv, "true unless injection=global_kv (the decoder needs some keys)")
            dense_decoder_ffn = not self.moe_in("decoder")
            require(dense_decoder_ffn or self.decoder_ffn_hidden_size == self.ffn_hidden_size,
                    prefix, "decoder_ffn_hidden_size", self.decoder_ffn_hidden_size,
                    "unset when the decoder's FFNs are MoE layers "
                    f"(moe_layers={self.moe_layers!r}), which use moe_ffn_hidden_size")
        else:
            require(self.decoder_ffn_hidden_size == self.ffn_hidden_size, prefix,
                    "decoder_ffn_hidden_size", self.decoder_ffn_hidden_size,
                    "unset unless arch=asymloop (widen ffn_hidden_size instead)")
        self._validate_moe(prefix)
        if self.arch == "latentloop":
            self._validate_latentloop(prefix)

    def _validate_unused(self, prefix: str) -> None:
        """Refuses a field set away from its default on a model that does not read it."""
        for f in dataclasses.fields(self):
            if f.name not in _CONDITIONAL_FIELDS:
                continue
            reads, readers = _CONDITIONAL_FIELDS[f.name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            require(reads(self) or getattr(self, f.name) == default, prefix, f.name,
                    getattr(self, f.name), f"left at its default {default!r} unless {readers} "
                    "(the only models that use it)")

    def _validate_moe(self, prefix: str) -> None:
        require(self.num_experts == 0 or self.num_experts >= 2, prefix, "num_experts",
                self.num_experts, "0 (dense FFN) or >= 2 (every token is routed to moe_top_k >= 2 "
                "experts)")
        if not self.uses_moe:
            return
        # Top-1 would softmax over one chosen expert: a router without gradient (megatron-core
        # refuses it unless the softmax comes before the choice, which megaloop does not build).
        require(2 <= self.moe_top_k <= self.num_experts, prefix, "moe_top_k", self.moe_top_k,
                f"in [2, num_experts={self.num_experts}] (top-1 routing would give the router no "
                "gradient)")
        require(self.moe_ffn_hidden_size >= 1, prefix, "moe_ffn_hidden_size",
                self.moe_ffn_hidden_size, ">= 1")
        require(self.moe_shared_expert_size >= 0, prefix, "moe_shared_expert_size",
                self.moe_shared_expert_size, ">= 0 (0: no shared expert)")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            require(getattr(self, name) >= 0, prefix, name, getattr(self, name), ">= 0")
        require(self.block == "llama", prefix, "block", self.block,
                "'llama' for a MoE model (the OLMo-2 norm after a MoE layer is not built)")
        require(self.moe_layers == "all" or self.arch == "asymloop", prefix, "moe_layers",
                self.moe_layers, "'all' unless arch=asymloop (which has an encoder and a decoder)")

    def _validate_latentloop(self, prefix: str) -> None:
        p, c, visits = self.prelude_layers, self.coda_layers, self.iterations
        require(p >= 0, prefix, "prelude_layers", p, ">= 0")
        require(c >= 0 and p + c < self.num_layers, prefix, "coda_layers", c,
                f">= 0 with prelude_layers + coda_layers < num_layers={self.num_layers} "
                "(the middle block needs a layer)")
        require(all(1 <= v <= visits for v in self.latent_visits)
                and len(set(self.latent_visits)) == len(self.latent_visits), prefix,
                "latent_visits", self.latent_visits,
                f"distinct visit numbers in [1, iterations={visits}]")
        # seq_length % latent_stride is a rule for training (RunConfig.validate): inference pools
        # the complete groups of any length.
        require(2 <= self.latent_stride <= 4, prefix, "latent_stride", self.latent_stride,
                "2, 3 or 4")
        require(self.latent_writeback_lag in (0, 1), prefix, "latent_writeback_lag",
                self.latent_writeback_lag, "0 or 1")
        self._validate_latent_reduction(prefix)
        require(not self.residual_scale_init or len(self.residual_scale_init) == visits, prefix,
                "residual_scale_init", self.residual_scale_init,
                f"empty or one value per visit (iterations={visits})")
        require(not self.untie_moe or self.uses_moe, prefix, "untie_moe", self.untie_moe,
                "false unless num_experts > 0")
        for name in ("untie_attention", "untie_moe"):  # they give visits 2..V their own weights
            require(not getattr(self, name) or visits >= 2, prefix, name, getattr(self, name),
                    f"false with iterations={visits} (a single visit has no other visit to "
                    "untie from)")

    def _validate_latent_reduction(self, prefix: str) -> None:
        reduction = self.latent_reduction
        # Settings that the reduction in use would ignore.
        if reduction != "sequence" or not self.latent_visits:
            why = ("unless latent_reduction='sequence'" if self.latent_visits
                   else "while latent_visits is empty (no visit is reduced)")
            for name, default in (("latent_stride", 2), ("latent_writeback_lag", 0)):
                require(getattr(self, name) == default, prefix, name, getattr(self, name),
                        f"left at its default {default} {why}")
            require(self.latent_visits or reduction == "sequence", prefix, "latent_reduction",
                    reduction, f"left at its default 'sequence' {why}")
        if reduction == "top_k":
            require(self.uses_moe and self.moe_top_k >= 4, prefix, "latent_reduction", reduction,
                    "'sequence' unless num_experts > 0 and moe_top_k >= 4 (the reduced visits "
                    "route to moe_top_k // 2 >= 2 experts)")
        elif reduction == "width":
            require(self.hidden_size % 2 == 0, prefix, "hidden_size", self.hidden_size,
                    "even for latent_reduction='width' (the reduced visits run at half the "
                    "hidden size)")
        elif reduction == "expert_ffn":
            require(self.uses_moe, prefix, "latent_reduction", reduction,
                    "one of 'sequence', 'width' unless num_experts > 0 (the reduced visits halve "
                    "the experts' FFN)")
            for name in ("moe_ffn_hidden_size", "moe_shared_expert_size"):
                require(getattr(self, name) % 2 == 0, prefix, name, getattr(self, name),
                        "even for latent_reduction='expert_ffn' (the reduced visits use half of "
                        "each expert's hidden units)")
        if reduction in ("width", "expert_ffn"):
            # A narrowed visit computes with a part of the shared weights; a visit with weights of
            # its own (untied, visits 2..V) would need narrow weights of its own, not built.
            untied = [v for v in self.latent_visits if v > 1 and (
                self.untie_moe or self.untie_attention and reduction == "width")]
            require(not untied, prefix, "latent_visits", self.latent_visits,
                    f"visits that use the shared middle block for latent_reduction={reduction!r}"
                    f" (visits {untied} have untied weights; reduce visit 1, or untie nothing)")
