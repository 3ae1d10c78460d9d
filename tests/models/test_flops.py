"""The analytical FLOP count agrees with torch's FlopCounterMode, term by term (forward, backward,
selective and full recomputation), for every architecture, MoE and LatentLoop's compressed visits included."""

from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaloop.config import ParallelConfig
from megaloop.models.flops import (executed_backward_flops, forward_flops,
                                   register_cpu_flash_flop_formulas)
from megaloop.models.model import build_model
from tests.models.variants import small_config


def _counted(cfg, parallel: ParallelConfig) -> tuple[Fraction, Fraction]:
    """FlopCounterMode's forward and backward FLOPs per token of one training micro-batch."""
    register_cpu_flash_flop_formulas()
    model = build_model(cfg, parallel)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    with FlopCounterMode(display=False) as forward:
        loss = model(x, labels=x).mean()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return (Fraction(forward.get_total_flops(), x.numel()),
            Fraction(backward.get_total_flops(), x.numel()))


@pytest.mark.parametrize("variant", ["dense", "fullloop_olmo", "asymloop", "asymloop_no_local_kv",
                                     "asymloop_additive", "asymloop_tied_gqa1", "dense_moe_shared",
                                     "asymloop_moe", "latentloop_moe", "latentloop_stride3_lag1",
                                     "latentloop_moe_untied_v3", "latentloop_moe_topk",
                                     "latentloop_moe_width", "latentloop_moe_expert_ffn"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_counted_flops_equal_analytical(seeded, variant, recompute):
    cfg = small_config(variant)
    forward, backward = _counted(cfg, ParallelConfig(recompute=recompute))
    assert forward == forward_flops(cfg).total
    assert backward == executed_backward_flops(cfg, recompute)


@pytest.mark.parametrize("variant, modules", [
    ("dense", ["mlp"]), ("asymloop", ["core_attn", "mlp"]),
    ("asymloop_moe_decoder", ["mlp"]),  # the encoder's dense FFNs only: MoE layers ignore mlp
    ("asymloop_moe_decoder", ["core_attn", "mlp", "moe"]),
    ("dense_moe_shared", ["moe"]), ("dense_moe_shared", ["shared_experts"]),
    ("dense_moe_shared", ["moe", "shared_experts"]),  # the shared expert replayed twice
    ("latentloop_moe", ["moe"]),  # the compressed visit replays on half the positions
    ("latentloop_moe_width", ["moe", "shared_experts", "core_attn"]),
    ("latentloop_moe_expert_ffn", ["shared_experts"]),
])
def test_selective_recompute_of_ffn_modules_counts_their_replay(seeded, variant, modules):
    """Each named module's forward runs again in the backward pass: FLOPs executed, not free; a
    selection without core_attn replays no attention."""
    cfg = small_config(variant)
    _, backward = _counted(cfg, ParallelConfig(recompute="selective", recompute_modules=modules))
    assert backward == executed_backward_flops(cfg, "selective", modules)
    assert backward > executed_backward_flops(cfg, "selective", ["core_attn"] if "core_attn"
                                              in modules else [])
