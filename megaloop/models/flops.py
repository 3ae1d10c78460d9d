"""Analytical forward FLOPs per position, by the method of the AsymLoop paper (Appendix D).

Matmul FLOPs only (2 per multiply-accumulate); norms, RoPE, softmax and elementwise work are left out.
Attention is counted as the full N x N score matrix, as the paper and torch's FlopCounterMode do, so
that the analytical count can be checked against a counted one term by term.

Per layer and position, with d hidden, q = heads * head_dim, g = groups * head_dim, f FFN width:
    QKV 2d(q + 2g),  output proj 2qd,  SwiGLU FFN 6df,  scores + values 4Nq.
Full Loop: F = J * C + 2dV. AsymLoop adds the Global K/V projections (4dg per decoder layer, once per
forward) and N extra keys in every decoder attention (4Nq, K * D times).
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.config import ModelConfig


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward matmul FLOPs per position, split by where they are spent."""

    layers: int  # dense layer matmuls (QKV, proj, FFN) over all layer applications
    attention: int  # score and value matmuls over all layer applications
    global_kv: int  # AsymLoop's Global K/V projections (once per forward)
    head: int  # output projection to the vocabulary

    @property
    def total(self) -> int:
        return self.layers + self.attention + self.global_kv + self.head


def _layer_matmuls(d: int, q: int, g: int, ffn: int, local_kv: bool = True) -> int:
    qkv = 2 * d * (q + 2 * g) if local_kv else 2 * d * q
    return qkv + 2 * q * d + 6 * d * ffn


def forward_flops(cfg: ModelConfig, seq_length: int | None = None) -> FlopBreakdown:
    cfg = cfg.resolve()
    n = seq_length or cfg.seq_length
    d, q = cfg.hidden_size, cfg.num_attention_heads * cfg.kv_channels
    g = cfg.num_query_groups * cfg.kv_channels
    e, dec, k = cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.iterations
    decoder_applications = k * dec

    layers = e * _layer_matmuls(d, q, g, cfg.ffn_hidden_size)
    layers += decoder_applications * _layer_matmuls(d, q, g, cfg.decoder_ffn_hidden_size,
                                                    local_kv=cfg.local_kv or not cfg.uses_global_kv)
    keys_per_decoder_query = 2 * n if (cfg.uses_global_kv and cfg.local_kv) else n
    attention = e * 4 * n * q + decoder_applications * 4 * keys_per_decoder_query * q
    global_kv = dec * 2 * d * 2 * g if cfg.uses_global_kv else 0
    return FlopBreakdown(layers, attention, global_kv, head=2 * d * cfg.vocab_size)


def model_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token by the MFU convention: forward + backward = 3x forward.

    Work a kernel or recomputation chooses to repeat is not model work and is not counted here
    (see ``executed_backward_flops``)."""
    return 3 * forward_flops(cfg).total


def executed_backward_flops(cfg: ModelConfig, recompute: bool = False) -> float:
    """Backward FLOPs per token that actually execute, term by term:

    - every matmul's backward is two matmuls of its size (input and weight gradients): 2x forward;
    - flash-attention backward also recomputes the scores QK^T from q and k: +0.5x the forward
      attention term (5 N x N matmuls instead of 4);
    - full activation recomputation replays the forward of each TransformerBlock (layers and
      attention); the Global K/V projections and the head run outside the blocks and are not replayed.
    """
    fwd = forward_flops(cfg)
    executed = 2 * fwd.total + 0.5 * fwd.attention
    if recompute:
        executed += fwd.layers + fwd.attention
    return executed


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


def parameter_count(cfg: ModelConfig) -> int:
    """Exact parameter count of LoopedLM for ``cfg`` without building it (tests hold it to numel)."""
    cfg = cfg.resolve()
    d, hd = cfg.hidden_size, cfg.kv_channels
    q, g = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    qk_norms = 2 * hd if cfg.qk_norm else 0

    def layer(ffn: int, role: str) -> int:
        qkv = d * q if role == "global_only" else d * (q + 2 * g)
        global_kv = d * 2 * g + (d if cfg.global_kv_norm else 0) if role != "plain" else 0
        return 2 * d + qkv + q * d + qk_norms + 3 * d * ffn + global_kv

    total = cfg.num_encoder_layers * layer(cfg.ffn_hidden_size, "plain")
    total += cfg.num_decoder_layers * layer(cfg.decoder_ffn_hidden_size, cfg.decoder_attention)
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return total + embeddings + d  # + final norm
