"""Initialisation by effective depth: every residual-branch output projection (attention's
linear_proj, the FFN's linear_fc2, wherever they live) starts with std = init_std / sqrt(2 J), J
the number of layer applications the residual stream accumulates (Dense L, Full Loop R * L,
AsymLoop E + K * D), not the physical layer count; every other matrix with std = init_std.
A CPU build with expert parallelism starts from the weights of the same seed without it."""

import math
import re

import pytest
import torch

from megaloop.config import ModelConfig
from megaloop.models.model import LoopedLM

INIT_STD = 0.02
RESIDUAL_OUTPUTS = ("linear_proj", "linear_fc2")


@pytest.mark.parametrize("fields, effective_depth", [
    (dict(arch="dense", num_layers=4, iterations=1), 4),
    (dict(arch="fullloop", num_layers=2, iterations=2), 4),
    (dict(arch="fullloop", num_layers=2, iterations=3), 6),
    (dict(arch="asymloop", num_layers=4, iterations=1), 2 + 1 * 2),
    (dict(arch="asymloop", num_layers=4, iterations=3), 2 + 3 * 2),
    (dict(arch="asymloop", num_layers=4, iterations=5), 2 + 5 * 2),
    (dict(arch="asymloop", num_layers=6, encoder_layers=2, iterations=3), 2 + 3 * 4),
    (dict(arch="asymloop", num_layers=4, iterations=3, block="olmo"), 2 + 3 * 2),
])
def test_residual_output_init_follows_effective_depth(seeded, fields, effective_depth):
    model = LoopedLM(ModelConfig(hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                                 vocab_size=128, init_std=INIT_STD, **fields))
    residual = INIT_STD / math.sqrt(2 * effective_depth)
    checked = 0
    for name, param in model.named_parameters():
        if param.dim() != 2:
            continue
        is_output = any(f".{part}." in name for part in RESIDUAL_OUTPUTS)
        expected = residual if is_output else INIT_STD
        # 4096+ samples per matrix: the sample std is within 3% of the true one (> 5 sigma).
        assert param.std().item() == pytest.approx(expected, rel=0.05), name
        checked += is_output
    layers = fields["num_layers"]
    assert checked == 2 * layers, "every layer's two output projections were checked"


def _initial_weights(rank, world_size, expert):
    """This rank's initial weights (by layout-independent name: experts by global index) of a
    MoE AsymLoop built from seed 1234 with ``expert``-way expert parallelism."""
    from megaloop.alrs import experts
    from megaloop.config import ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed
    from tests.models.variants import small_config

    init_distributed(expert_parallel=expert, seed=1234)
    model = build_model(small_config("asymloop", num_experts=4, moe_top_k=2),
                        ParallelConfig(expert=expert))
    return {name: param.detach().clone() for name, param in experts.named_parameters(model)}


def test_expert_parallelism_changes_no_initial_weight():
    """A CPU build with expert parallelism (EP=2, two experts a rank) starts from the weights of
    the same seed without it (EP=1, the replicas on two data-parallel ranks alike), and so every
    expert starts different: megatron-core's CPU initialisation drew each rank's local experts
    from where rank 0 drew its own (expert 2 started as a copy of expert 0, 3 of 1), and every
    weight after the first MoE layer from another point of the generator than EP=1."""
    from megaloop.alrs.experts import expert_index
    from tests.distributed import run_distributed

    split, replicas = (run_distributed(_initial_weights, world_size=2, expert=ep) for ep in (2, 1))
    whole = replicas[0]
    assert replicas[1].keys() == whole.keys()
    for name, weight in whole.items():
        assert torch.equal(weight, replicas[1][name]), name
    held = {name: rank for rank, weights in enumerate(split) for name in weights}
    assert held.keys() == whole.keys()
    for name, rank in held.items():
        assert torch.equal(split[rank][name], whole[name]), name
        if expert_index(name) is None:  # replicated: alike on both ranks
            assert torch.equal(split[1 - rank][name], whole[name]), name
    experts_of = {}
    for name, weight in whole.items():
        if expert_index(name) is not None:
            experts_of.setdefault(re.sub(r"local_experts\.\d+\.", "", name), []).append(weight)
    assert experts_of and all(len(weights) == 4 for weights in experts_of.values())
    for matrix, weights in experts_of.items():
        for i in range(4):
            assert not any(torch.equal(weights[i], weights[j]) for j in range(i)), (matrix, i)
