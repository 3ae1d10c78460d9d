"""Analytical forward FLOPs per position, by the method of the AsymLoop paper (Appendix D).

Matmul FLOPs only (2 per multiply-accumulate); norms, RoPE, softmax and elementwise work are left out.
Attention is counted as the full N x N score matrix, as the paper and torch's FlopCounterMode do, so
that the analytical count can be checked against a counted one term by term.

Per layer application and position, with d hidden, q = heads * head_dim, g = groups * head_dim,
f FFN width:
    QKV 2d(q + 2g),  output proj 2qd,  SwiGLU FFN 6df,  scores + values 4Nq.
A MoE FFN costs its active parameters: router 2dE, top-k experts of width f_e 6df_e each, a shared
expert 6df_s. Full Loop: F = J * C + 2dV. AsymLoop adds the Global K/V projections (4dg per decoder
layer, once per forward) and N extra keys in every decoder attention (4Nq, K * D times). A LatentLoop
visit compressed k times runs its layers on N/k latents attending to N/k latents: per position, 1/k
of the projection and expert FLOPs and 1/k^2 of the score FLOPs. The other reduced visits run a
block of their own config (``ModelConfig.visit_block_config``): top_k routes to half the experts;
expert_ffn has experts of half the width; width runs at d/2 (every layer matmul has one d side, so
half of them; the scores are unchanged) between projections d -> d/2 -> d, 2d^2 per position,
which run outside the block. Counts are exact Fractions.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from megaloop.config import ModelConfig


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward matmul FLOPs per position, split by where they are spent."""

    layers: int | Fraction  # layer matmuls (QKV, proj, FFN / router + experts), all applications
    attention: int | Fraction  # score and value matmuls over all layer applications
    global_kv: int  # AsymLoop's Global K/V projections (once per forward)
    head: int  # output projection to the vocabulary
    projections: int = 0  # LatentLoop's width projections d -> d/2 -> d (width-reduced visits)

    @property
    def total(self) -> int | Fraction:
        return self.layers + self.attention + self.global_kv + self.head + self.projections


@dataclass(frozen=True)
class LayerApplications:
    """``count`` applications per forward of a layer kind, each on ``1 / stride`` of the positions
    (LatentLoop's compressed visits) attending to as many keys, ``keys_factor`` x that with
    AsymLoop's Global half. ``block`` is the config the layers are built from: widths, heads,
    experts and top-k (a LatentLoop reduced visit's own)."""

    count: int
    role: str  # attention role: plain | joint | global_only
    ffn: int  # dense FFN width (unused when moe)
    moe: bool
    block: ModelConfig
    stride: int = 1

    @property
    def keys_factor(self) -> int:
        return 2 if self.role == "joint" else 1


def layer_applications(cfg: ModelConfig, iterations: int | None = None) -> list[LayerApplications]:
    """Every layer application of one forward pass, grouped by kind."""
    cfg = cfg.resolve()
    steps = cfg.iterations if iterations is None else iterations
    before = cfg.num_encoder_layers  # AsymLoop encoder / LatentLoop prelude
    groups = [LayerApplications(before, "plain", cfg.ffn_hidden_size, cfg.moe_in("encoder"), cfg)]
    looped = cfg.num_decoder_layers
    if cfg.arch != "latentloop":
        groups.append(LayerApplications(steps * looped, cfg.decoder_attention,
                                        cfg.decoder_ffn_hidden_size, cfg.moe_in("decoder"), cfg))
        return [g for g in groups if g.count]
    for visit in range(1, steps + 1):
        sequence = cfg.visit_reduction(visit) == "sequence"
        groups.append(LayerApplications(looped, "plain", cfg.ffn_hidden_size, cfg.uses_moe,
                                        cfg.visit_block_config(visit),
                                        cfg.latent_stride if sequence else 1))
    groups.append(LayerApplications(cfg.num_coda_layers, "plain", cfg.ffn_hidden_size,
                                    cfg.uses_moe, cfg))
    return [g for g in groups if g.count]


def _ffn_parts(group: LayerApplications) -> dict[str, int]:
    """Forward FLOPs per position of one application's FFN, by the selective recomputation module
    (parallel.recompute_modules) that replays them: mlp, a dense FFN (megatron-core does not
    replay a MoE layer for it); moe, the router and the routed experts; shared_experts."""
    block = group.block
    d = block.hidden_size
    if not group.moe:
        return {"mlp": 6 * d * group.ffn}
    routed = block.moe_top_k * 6 * d * block.moe_ffn_hidden_size
    return {"moe": 2 * d * block.num_experts + routed,
            "shared_experts": 6 * d * block.moe_shared_expert_size}


def _application_flops(cfg: ModelConfig, group: LayerApplications,
                       n: int) -> tuple[Fraction, Fraction]:
    """(matmul, attention) forward FLOPs per position of one application of a layer of ``group``
    at sequence length ``n``."""
    q = cfg.num_attention_heads * cfg.kv_channels
    g = cfg.num_query_groups * cfg.kv_channels
    width = group.block.hidden_size
    projections = 2 * width * (q + 2 * g) if group.role != "global_only" else 2 * width * q
    per_position = Fraction(1, group.stride)
    matmul = per_position * (projections + 2 * q * width + sum(_ffn_parts(group).values()))
    attention = per_position * 4 * group.keys_factor * Fraction(n, group.stride) * q
    return matmul, attention


def _replayed_flops(cfg: ModelConfig, group: LayerApplications, n: int,
                    modules: Sequence[str]) -> Fraction:
    """Forward FLOPs per position that selective recomputation of ``modules`` runs again in the
    backward pass, per application of a layer of ``group``. megatron-core checkpoints each named
    module on its own: core_attn replays the score and value matmuls; moe the whole MoE layer, its
    shared expert included, so that with shared_experts too the shared expert, checkpointed within
    the MoE layer's checkpoint, runs a third time."""
    parts = _ffn_parts(group)
    replayed = sum(parts.get(name, 0) for name in modules)
    if "moe" in modules:
        replayed += parts.get("shared_experts", 0)
    _, attention = _application_flops(cfg, group, n)
    return (Fraction(replayed, group.stride)
            + (attention if "core_attn" in modules else Fraction(0)))


def layer_application_flops(cfg: ModelConfig, block: str, modules: Sequence[str] = ()
                            ) -> tuple[Fraction, Fraction, Fraction]:
    """(matmul, attention, replayed) forward FLOPs per position of one application of one layer
    of ``block``: "encoder" (the layers before the loop) or "decoder" (the looped layers);
    replayed: what selective recomputation of ``modules`` runs again in the backward pass."""
    cfg = cfg.resolve()
    if block == "encoder":
        group = LayerApplications(1, "plain", cfg.ffn_hidden_size, cfg.moe_in("encoder"), cfg)
    else:
        group = LayerApplications(1, cfg.decoder_attention, cfg.decoder_ffn_hidden_size,
                                  cfg.moe_in("decoder"), cfg)
    return (*_application_flops(cfg, group, cfg.seq_length),
            _replayed_flops(cfg, group, cfg.seq_length, modules))


def forward_flops(cfg: ModelConfig, seq_length: int | None = None,
                  iterations: int | None = None) -> FlopBreakdown:
    cfg = cfg.resolve()
    n = seq_length or cfg.seq_length
    d, g = cfg.hidden_size, cfg.num_query_groups * cfg.kv_channels
    layers = attention = Fraction(0)
    for group in layer_applications(cfg, iterations):
        matmul, scores = _application_flops(cfg, group, n)
        layers += group.count * matmul
        attention += group.count * scores
    global_kv = cfg.num_decoder_layers * 2 * d * 2 * g if cfg.uses_global_kv else 0
    width_visits = (len(cfg.latent_visits) if cfg.arch == "latentloop"
                    and cfg.latent_reduction == "width" else 0)
    return FlopBreakdown(_exact(layers), _exact(attention), global_kv,
                         head=2 * d * cfg.vocab_size, projections=width_visits * 2 * d * d)


def _exact(count: Fraction) -> int | Fraction:
    """A whole count as an int (what callers that print or serialise counts expect); a count with
    a fraction per position (a compressed visit) stays an exact Fraction."""
    return int(count) if count.denominator == 1 else count


def model_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token by the MFU convention: forward + backward = 3x forward.

    Work a kernel or recomputation chooses to repeat is not model work and is not counted here
    (see ``executed_backward_flops``), as in Megatron-LM's MFU, whose FLOPs per iteration are
    the same with and without (full or selective) recomputation."""
    return float(3 * forward_flops(cfg).total)


def executed_backward_flops(cfg: ModelConfig, recompute: str = "none",
                            modules: Sequence[str] = ("core_attn",)) -> Fraction:
    """Backward FLOPs per token that actually execute, term by term, with ``recompute`` as
    parallel.recompute (none, full, selective) and ``modules`` as its selective_modules:

    - every matmul's backward is two matmuls of its size (input and weight gradients): 2x forward;
    - flash-attention backward also recomputes the scores QK^T from q and k: +0.5x the forward
      attention term (5 N x N matmuls instead of 4);
    - full activation recomputation replays the forward of each TransformerBlock (layers and
      attention); the Global K/V projections, LatentLoop's width projections and the head run
      outside the blocks and are not replayed;
    - selective recomputation replays the forward of each named module of every layer
      application: core_attn the score and value matmuls (+ 1x the attention term), mlp a dense
      FFN, moe a MoE layer (router, routed and shared experts), shared_experts the shared expert
      (``_replayed_flops``); layernorm and moe_act replay no matmul.
    """
    fwd = forward_flops(cfg)
    executed = 2 * fwd.total + fwd.attention / 2
    if recompute == "full":
        executed += fwd.layers + fwd.attention
    elif recompute == "selective":
        cfg = cfg.resolve()
        executed += sum(group.count * _replayed_flops(cfg, group, cfg.seq_length, modules)
                        for group in layer_applications(cfg))
    return executed


def kv_cache_per_token(cfg: ModelConfig) -> Fraction:
    """Key/value cache elements per generated token: 2 * groups * head_dim per layer application
    with local keys (a compressed visit caches one entry per latent), plus AsymLoop's Global KV."""
    cfg = cfg.resolve()
    g = cfg.num_query_groups * cfg.kv_channels
    cached = sum(Fraction(group.count, group.stride) for group in layer_applications(cfg)
                 if group.role != "global_only")
    return 2 * g * (cached + (cfg.num_decoder_layers if cfg.uses_global_kv else 0))


def active_parameter_count(cfg: ModelConfig) -> int:
    """Parameters a token's forward pass uses: all but the expert hidden units its router does not
    pick. Each physical MoE layer counts its widest application: one that only LatentLoop's
    reduced visits run (untie_moe, or every visit reduced) routes to their moe_top_k // 2 experts
    (top_k) or uses half of each expert's hidden units (expert_ffn)."""
    cfg = cfg.resolve()
    if not cfg.uses_moe:
        return parameter_count(cfg)
    full = [cfg]
    copies = [(cfg.num_encoder_layers if cfg.moe_in("encoder") else 0, full),
              (cfg.num_coda_layers, full)]  # (layers, the block configs that apply them)
    if cfg.arch == "latentloop":
        visits = [cfg.visit_block_config(v) for v in range(1, cfg.iterations + 1)]
        copies += ([(cfg.num_decoder_layers, [block]) for block in visits] if cfg.untie_moe
                   else [(cfg.num_decoder_layers, visits)])
    elif cfg.moe_in("decoder"):
        copies.append((cfg.num_decoder_layers, full))

    def hidden_units(block: ModelConfig, experts: int) -> int:  # of routed and shared experts
        return experts * block.moe_ffn_hidden_size + block.moe_shared_expert_size

    built = hidden_units(cfg, cfg.num_experts)
    unused = sum(layers * (built - max(hidden_units(b, b.moe_top_k) for b in blocks))
                 for layers, blocks in copies)
    return parameter_count(cfg) - 3 * cfg.hidden_size * unused


def budget(cfg: ModelConfig) -> dict[str, float]:
    """What budget-matched comparisons hold equal (LatentLoop paper): parameters, KV cache per
    token, and training FLOPs per token (x tokens per step = FLOPs per step; x steps = total)."""
    return {"parameters": parameter_count(cfg), "active_parameters": active_parameter_count(cfg),
            "kv_cache_per_token": float(kv_cache_per_token(cfg)),
            "train_flops_per_token": model_flops_per_token(cfg)}


def register_cpu_flash_flop_formulas() -> None:
    """Teaches torch's FlopCounterMode the CPU flash-attention kernels (it knows only the CUDA ones).

    Idempotent. The formulas are torch's own SDPA counts, applied to the CPU ops' shapes.
    """
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    if aten._scaled_dot_product_flash_attention_for_cpu in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                  **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape,
                                                     value_shape)


def _ffn_params(cfg: ModelConfig, ffn: int, moe: bool) -> int:
    d = cfg.hidden_size
    if not moe:
        return 3 * d * ffn
    return (cfg.num_experts * d + cfg.num_experts * 3 * d * cfg.moe_ffn_hidden_size
            + 3 * d * cfg.moe_shared_expert_size)


def parameter_count(cfg: ModelConfig) -> int:
    """Exact parameter count of the model for ``cfg`` without building it (tests hold it to numel)."""
    cfg = cfg.resolve()
    d, hd = cfg.hidden_size, cfg.kv_channels
    q, g = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    qk_norms = 2 * hd if cfg.qk_norm else 0

    def attention(role: str) -> int:  # input norm, projections, QK-norms, Global KV
        qkv = d * q if role == "global_only" else d * (q + 2 * g)
        global_kv = d * 2 * g + (d if cfg.global_kv_norm else 0) if role != "plain" else 0
        return d + qkv + q * d + qk_norms + global_kv

    def ffn(width: int, moe: bool) -> int:  # pre-FFN norm and the FFN
        return d + _ffn_params(cfg, width, moe)

    total = cfg.num_encoder_layers * (attention("plain")
                                      + ffn(cfg.ffn_hidden_size, cfg.moe_in("encoder")))
    looped = cfg.num_decoder_layers
    if cfg.arch == "latentloop":
        visits = cfg.iterations
        total += looped * (attention("plain") * (visits if cfg.untie_attention else 1)
                           + ffn(cfg.ffn_hidden_size, cfg.uses_moe) * (visits if cfg.untie_moe else 1))
        total += cfg.num_coda_layers * (attention("plain") + ffn(cfg.ffn_hidden_size, cfg.uses_moe))
        reduced = len(cfg.latent_visits)
        if cfg.latent_reduction == "sequence":
            total += reduced * cfg.latent_stride * d  # writeback channel scales
        if cfg.latent_reduction == "width":
            total += reduced * d * d  # projections d -> d/2 -> d
        total += visits if cfg.residual_scale == "learned" else 0
    else:
        total += looped * (attention(cfg.decoder_attention)
                           + ffn(cfg.decoder_ffn_hidden_size, cfg.moe_in("decoder")))
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return total + embeddings + d  # + final norm
