"""The analytical FLOP count agrees with torch's FlopCounterMode, term by term (forward, backward,
selective and full recomputation), for every architecture, MoE and LatentLoop's compressed visits included."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaloop.config import ParallelConfig
from megaloop.models.flops import (executed_backward_flops, forward_flops,
                                   register_cpu_flash_flop_formulas)
from megaloop.models.model import build_model
from tests.models.variants import small_config


@pytest.mark.parametrize("variant", ["dense", "fullloop_olmo", "asymloop", "asymloop_no_local_kv",
                                     "asymloop_additive", "asymloop_tied_gqa1", "dense_moe_shared",
                                     "asymloop_moe", "latentloop_moe", "latentloop_stride3_lag1",
                                     "latentloop_moe_untied_v3", "latentloop_moe_topk",
                                     "latentloop_moe_width", "latentloop_moe_expert_ffn"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_counted_flops_equal_analytical(seeded, variant, recompute):
    register_cpu_flash_flop_formulas()
    cfg = small_config(variant)
    model = build_model(cfg, ParallelConfig(recompute=recompute))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    tokens = x.numel()
    with FlopCounterMode(display=False) as counter:
        loss = model(x, labels=x).mean()
    assert counter.get_total_flops() == forward_flops(cfg).total * tokens
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    assert counter.get_total_flops() == executed_backward_flops(cfg, recompute) * tokens
