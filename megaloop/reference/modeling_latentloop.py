"""Plain-PyTorch reference of LatentLoop (torch only, like the rest of the reference).

    h = Prelude(Embed(x))
    for v = 1..V:
        compressed v:  z_i = mean(h[ki], .., h[ki+k-1]);  D = Middle(z) - z
                       h[ki+k-1+l+s] += a_v * w_{v,s} * D_i,   s = 0..k-1
        full v:        h = h + a_v * (Middle(h) - h)
    logits = Head(Norm(Coda(h)))

Positions 0-based; latents are complete groups of k tokens at the RoPE position of their last token;
l is the writeback lag. Visits 2..V use their own attention and/or FFN when untied; a visit with the
top-k reduction routes to half as many experts. Written as explicit loops over latents and receivers,
for clarity; the canonical model (megaloop.models.latent) is held to it by parity tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .modeling_asymloop import Block, ReferenceConfig, rope_tables


@dataclass
class LatentLoopConfig(ReferenceConfig):
    arch: str = "latentloop"
    prelude_layers: int = 1
    coda_layers: int = 1
    latent_visits: list = field(default_factory=lambda: [1])  # compressed visits, 1-based
    latent_stride: int = 2
    latent_writeback_lag: int = 0
    latent_reduction: str = "sequence"  # sequence | top_k
    residual_scale: str = "learned"  # learned | fixed
    residual_scale_init: list = field(default_factory=list)  # per visit; empty: 1.0
    untie_attention: bool = False
    untie_moe: bool = False


class _Part(nn.Module):
    """One sublayer of a Block, with its norm: attention (attn_norm, attn) or FFN (mlp_norm,
    mlp), for the visits that untie it."""

    def __init__(self, block: Block, attention: bool):
        super().__init__()
        if attention:
            self.attn_norm, self.attn = block.attn_norm, block.attn
        else:
            self.mlp_norm, self.mlp = block.mlp_norm, block.mlp


class LatentLoopLM(nn.Module):
    def __init__(self, cfg: LatentLoopConfig):
        super().__init__()
        self.cfg = cfg
        d, moe = cfg.hidden_size, cfg.num_experts > 0
        middle = cfg.num_layers - cfg.prelude_layers - cfg.coda_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)

        def blocks(n):
            return nn.ModuleList(Block(cfg, cfg.ffn_hidden_size, moe=moe) for _ in range(n))

        self.prelude, self.middle, self.coda = (blocks(cfg.prelude_layers), blocks(middle),
                                                blocks(cfg.coda_layers))
        # visit v >= 2 with untied parts: "<v>" -> per middle layer, the attention / FFN part
        self.untied_attention = nn.ModuleDict({
            str(v): nn.ModuleList(_Part(b, attention=True) for b in blocks(middle))
            for v in range(2, cfg.iterations + 1) if cfg.untie_attention})
        self.untied_ffn = nn.ModuleDict({
            str(v): nn.ModuleList(_Part(b, attention=False) for b in blocks(middle))
            for v in range(2, cfg.iterations + 1) if cfg.untie_moe})
        scales = torch.tensor(cfg.residual_scale_init or [1.0] * cfg.iterations)
        if cfg.residual_scale == "learned":
            self.residual_scales = nn.Parameter(scales)
        else:
            self.register_buffer("residual_scales", scales, persistent=False)
        compressed = self.compressed_visits()
        # writeback channel scales w_{v,s} of each compressed visit: "<v>" -> [k, d]
        self.writeback = nn.ParameterDict({str(v): nn.Parameter(torch.ones(cfg.latent_stride, d))
                                           for v in compressed})
        self.norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def compressed_visits(self) -> list[int]:
        return self.cfg.latent_visits if self.cfg.latent_reduction == "sequence" else []

    def _middle(self, h, cos, sin, visit: int):
        cfg = self.cfg
        reduced = visit in cfg.latent_visits and cfg.latent_reduction == "top_k"
        top_k = {"top_k": cfg.moe_top_k // 2} if reduced else {}
        for index, block in enumerate(self.middle):
            attention = self.untied_attention[str(visit)][index] \
                if str(visit) in self.untied_attention else block
            ffn = self.untied_ffn[str(visit)][index] if str(visit) in self.untied_ffn else block
            h = h + attention.attn(attention.attn_norm(h), cos, sin)
            h = h + ffn.mlp(ffn.mlp_norm(h), **top_k)
        return h

    def forward(self, input_ids):
        cfg = self.cfg
        n, k, lag = input_ids.shape[1], cfg.latent_stride, cfg.latent_writeback_lag
        cos, sin = rope_tables(n, cfg.head_dim, cfg.rotary_base, input_ids.device)
        h = self.embed_tokens(input_ids)
        for block in self.prelude:
            h = block(h, cos, sin)
        for visit in range(1, cfg.iterations + 1):
            scale = self.residual_scales[visit - 1]
            if visit not in self.compressed_visits():
                h = h + scale * (self._middle(h, cos, sin, visit) - h)
                continue
            groups = n // k
            if groups == 0:
                continue
            latents = torch.stack([h[:, i * k:(i + 1) * k].mean(dim=1) for i in range(groups)], 1)
            ends = [i * k + k - 1 for i in range(groups)]  # RoPE position of each latent
            delta = self._middle(latents, cos[ends], sin[ends], visit) - latents
            w = self.writeback[str(visit)]
            update = torch.zeros_like(h)
            for i in range(groups):
                for s in range(k):
                    if ends[i] + lag + s < n:
                        update[:, ends[i] + lag + s] += w[s] * delta[:, i]
            h = h + scale * update
        for block in self.coda:
            h = block(h, cos, sin)
        return self.lm_head(self.norm(h))
