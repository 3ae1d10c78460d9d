"""Plain-PyTorch reference of megaloop's models (Dense, Full Loop, AsymLoop), independent of
megatron-core.

This file imports only torch so that it can ship as self-contained Hugging Face modeling code. It is
the second of the project's two model definitions; parity tests hold it to the canonical
megatron-core model (logits and gradients to 1e-5 in fp32 given the same weights). Attention here is
the exact masked softmax, written for clarity, not speed.

Model (L physical layers, E encoder layers, D = L - E decoder layers, K iterations):
    H_E = Enc(Embed(x))                                # once
    G_l = (k_norm(Wgk_l RMSNorm_l(H_E)), Wgv_l RMSNorm_l(H_E))   # once per decoder layer l
    z_0 = H_E;  z_t = Dec(z_{t-1}; G), t = 1..K        # weight-tied decoder
    logits = Head(FinalNorm(z_K))
Dense is E = 0, D = L, K = 1; Full Loop is E = 0, D = L, K = R. H_E enters the decoder un-normalised
(the residual stream continues); only the Global KV projections see it through a per-layer RMSNorm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ReferenceConfig:
    arch: str = "asymloop"  # dense | fullloop | asymloop
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 344
    decoder_ffn_hidden_size: int = 344
    num_attention_heads: int = 4
    num_query_groups: int = 4
    kv_channels: int = 0  # head dim; 0: hidden_size // num_attention_heads
    vocab_size: int = 32128
    encoder_layers: int = 2
    iterations: int = 3
    block: str = "llama"  # llama: pre-norm; olmo: norm on sublayer outputs inside the residual
    qk_norm: bool = True
    injection: str = "global_kv"  # global_kv | none | additive
    local_kv: bool = True
    global_kv_norm: bool = True  # RMSNorm of H_E before the Global K/V projections
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Mixture-of-experts FFNs (modeling_moe): 0 experts keeps the SwiGLU MLP.
    num_experts: int = 0
    moe_layers: str = "all"  # all | encoder | decoder
    moe_top_k: int = 2
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_size: int = 0

    @property
    def num_encoder_layers(self) -> int:
        return self.encoder_layers if self.arch == "asymloop" else 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


def causal_attention(q, k, v, scale):
    """[B, H, N, D] queries against N keys, causal."""
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * scale
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def joint_attention(q, k_glob, v_glob, k_loc, v_loc, scale):
    """One softmax over [Global; Local] keys; query i sees Global <= i and Local <= i."""
    n = q.shape[-2]
    keys = torch.cat([k_glob, k_loc], dim=-2)
    values = torch.cat([v_glob, v_loc], dim=-2)
    scores = (q @ keys.transpose(-1, -2)) * scale
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1).repeat(1, 2)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ values


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_tables(n, head_dim, base, device):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 tables would promote bf16 activations
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig, global_kv: bool, local_kv: bool):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.num_query_groups, hd
        self.local_kv = local_kv
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        if local_kv:
            self.k_proj = nn.Linear(d, self.groups * hd, bias=False)
            self.v_proj = nn.Linear(d, self.groups * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        if global_kv:
            self.global_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.global_kv_norm else nn.Identity()
            self.global_k_proj = nn.Linear(d, self.groups * hd, bias=False)
            self.global_v_proj = nn.Linear(d, self.groups * hd, bias=False)

    def _heads(self, x, n_heads):
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim).transpose(1, 2)

    def _expand(self, kv):  # grouped-query attention: each kv head serves heads/groups queries
        return kv.repeat_interleave(self.heads // self.groups, dim=1)

    def global_kv(self, h_enc):
        """Projects the encoder output into this layer's Global keys/values (before RoPE)."""
        x = self.global_norm(h_enc)
        k = self.k_norm(self._heads(self.global_k_proj(x), self.groups))
        return k, self._heads(self.global_v_proj(x), self.groups)

    def forward(self, x, cos, sin, global_kv=None):
        scale = 1.0 / math.sqrt(self.head_dim)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), cos, sin)
        if global_kv is not None:
            k_glob = self._expand(apply_rope(global_kv[0], cos, sin))
            v_glob = self._expand(global_kv[1])
        if self.local_kv:
            k = self._expand(apply_rope(self.k_norm(self._heads(self.k_proj(x), self.groups)), cos, sin))
            v = self._expand(self._heads(self.v_proj(x), self.groups))
        if global_kv is None:
            out = causal_attention(q, k, v, scale)
        elif not self.local_kv:
            out = causal_attention(q, k_glob, v_glob, scale)
        else:
            out = joint_attention(q, k_glob, v_glob, k, v, scale)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _moe_feed_forward(cfg: ReferenceConfig) -> nn.Module:
    from .modeling_moe import MoEFeedForward

    return MoEFeedForward(cfg.hidden_size, cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size,
                          cfg.moe_shared_expert_size)


class Block(nn.Module):
    def __init__(self, cfg: ReferenceConfig, ffn: int, global_kv: bool = False, local_kv: bool = True,
                 moe: bool = False):
        super().__init__()
        self.post_norm = cfg.block == "olmo"
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg, global_kv, local_kv)
        self.mlp = MLP(cfg.hidden_size, ffn) if not moe else _moe_feed_forward(cfg)

    def forward(self, h, cos, sin, global_kv=None):
        if self.post_norm:  # OLMo 2: h + Norm(Attn(h)), then h + Norm(MLP(h))
            h = h + self.attn_norm(self.attn(h, cos, sin, global_kv))
            return h + self.mlp_norm(self.mlp(h))
        h = h + self.attn(self.attn_norm(h), cos, sin, global_kv)
        return h + self.mlp(self.mlp_norm(h))


class LoopedLM(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.num_encoder_layers
        use_global = cfg.arch == "asymloop" and cfg.injection == "global_kv"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        moe = {part: cfg.num_experts > 0 and cfg.moe_layers in ("all", part)
               for part in ("encoder", "decoder")}
        self.encoder = nn.ModuleList(Block(cfg, cfg.ffn_hidden_size, moe=moe["encoder"])
                                     for _ in range(e))
        self.decoder = nn.ModuleList(
            Block(cfg, cfg.decoder_ffn_hidden_size, use_global, cfg.local_kv or not use_global,
                  moe["decoder"])
            for _ in range(cfg.num_layers - e)
        )
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, num_iterations: int | None = None):
        cfg = self.cfg
        steps = cfg.iterations if num_iterations is None else num_iterations
        cos, sin = rope_tables(input_ids.shape[1], cfg.head_dim, cfg.rotary_base, input_ids.device)
        h = self.embed_tokens(input_ids)
        for block in self.encoder:
            h = block(h, cos, sin)
        global_kvs = [None] * len(self.decoder)
        if cfg.arch == "asymloop" and cfg.injection == "global_kv":
            global_kvs = [block.attn.global_kv(h) for block in self.decoder]
        additive = cfg.arch == "asymloop" and cfg.injection == "additive"
        z = torch.zeros_like(h) if additive else h
        for _ in range(steps):
            if additive:
                z = z + h
            for block, gkv in zip(self.decoder, global_kvs):
                z = block(z, cos, sin, gkv)
        return self.lm_head(self.norm(z))
