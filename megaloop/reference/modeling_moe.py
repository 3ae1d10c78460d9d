"""Plain-PyTorch mixture-of-experts FFN of the reference model (torch only, like the rest of the
reference, so that it can ship as Hugging Face modeling code).

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
from torch import nn


class MoEFeedForward(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, expert_size: int,
                 shared_expert_size: int = 0):
        from .modeling_asymloop import MLP

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
