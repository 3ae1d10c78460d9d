"""The fused joint attention equals the exact masked reference, values and gradients."""

import pytest
import torch

from megaloop.models.joint_attention import joint_attention_fused
from megaloop.reference.modeling_asymloop import joint_attention


def _inputs(b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, requires_grad=True) for _ in range(5)]


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 3, 17, 16), (1, 4, 130, 32)])
def test_fused_matches_masked_values_and_gradients(shape):
    inputs = _inputs(*shape)
    scale = shape[-1] ** -0.5
    fused = joint_attention_fused(*inputs, scale)
    masked = joint_attention(*inputs, scale)
    torch.testing.assert_close(fused, masked, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn_like(fused)
    g_fused = torch.autograd.grad(fused, inputs, grad_out)
    g_masked = torch.autograd.grad(masked, inputs, grad_out)
    for name, a, b in zip(["q", "k_glob", "v_glob", "k_loc", "v_loc"], g_fused, g_masked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"d{name} differs")


def test_joint_attention_is_causal_on_both_halves():
    q, kg, vg, kl, vl = _inputs(1, 2, 12, 8)
    base = joint_attention_fused(q, kg, vg, kl, vl, 0.3)
    t = 7
    for which in (1, 2, 3, 4):  # perturb position t of one key/value half
        perturbed = [x.detach().clone() for x in (q, kg, vg, kl, vl)]
        perturbed[which][:, :, t] += 1.0
        out = joint_attention_fused(*perturbed, 0.3)
        torch.testing.assert_close(out[:, :, :t], base[:, :, :t], atol=0, rtol=0)
        assert (out[:, :, t:] - base[:, :, t:]).abs().max() > 1e-4


def test_global_keys_share_the_softmax_with_local_keys():
    """One softmax: making the Global half dominate must starve the Local half (not a sum of two)."""
    q, kg, vg, kl, vl = (x.detach() for x in _inputs(1, 1, 6, 4))
    q = torch.ones_like(q)
    big = joint_attention_fused(q, torch.ones_like(kg) * 50, vg, kl, vl, 1.0)
    torch.testing.assert_close(big, vg.cumsum(2) / torch.arange(1, 7).view(1, 1, 6, 1),
                               atol=1e-4, rtol=1e-4)
