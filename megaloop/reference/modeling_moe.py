"""The feed-forward layers of the reference model: the SwiGLU MLP and the mixture-of-experts FFN
built from it (torch only, like the rest of the reference, so that it can ship as Hugging Face
modeling code).

    MLP(x) = W_down (silu(W_gate x) * W_up x)

    logits = x W_r^T                                  in fp32, whatever the activations' dtype
    (l_1..l_k, e_1..e_k) = top-k of logits            per token, no capacity limit (dropless)
    p = softmax(l_1..l_k)                             over the chosen experts only
    y = sum_i p_i * Expert_{e_i}(x)  (+ SharedExpert(x))

Experts are SwiGLU MLPs. This is the canonical model's megatron-core MoELayer (TopKRouter with
softmax after top-k, SequentialMLP experts, optional shared expert) written for clarity: a loop over
experts. The load-balancing and z-losses are training terms of the canonical model; they do not
change the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, expert_size: int,
                 shared_expert_size: int = 0):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden_size, expert_size) for _ in range(num_experts))
        self.shared_expert = MLP(hidden_size, shared_expert_size) if shared_expert_size else None

    def forward(self, x: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
        """``top_k`` overrides the routing width for this call (LatentLoop's reduced visits)."""
        flat = x.reshape(-1, x.shape[-1])
        logits = flat.float() @ self.router.weight.float().t()
        top_logits, chosen = logits.topk(top_k or self.top_k, dim=-1)
        probs = top_logits.softmax(dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            if rows.numel():
                weight = probs[rows, slot].unsqueeze(-1).to(flat.dtype)
                out.index_add_(0, rows, expert(flat[rows]) * weight)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view_as(x)
