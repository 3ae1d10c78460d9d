"""Initialisation by effective depth: every residual-branch output projection (attention's
linear_proj, the FFN's linear_fc2, wherever they live) starts with std = init_std / sqrt(2 J), J
the number of layer applications the residual stream accumulates (Dense L, Full Loop R * L,
AsymLoop E + K * D), not the physical layer count; every other matrix with std = init_std."""

import math

import pytest

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
