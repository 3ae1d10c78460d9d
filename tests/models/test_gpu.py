"""GPU-only checks (marker ``gpu``; skipped without CUDA): the CUDA flash path of the fused joint
attention and the Transformer Engine layer specs, including FP8."""

import pytest
import torch

from megaloop.models.joint_attention import joint_attention_fused
from megaloop.reference.modeling_asymloop import joint_attention
from tests.models.variants import small_config

pytestmark = pytest.mark.gpu


def test_cuda_fused_joint_attention_matches_masked_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(2, 4, 256, 64, device="cuda", generator=g, dtype=torch.bfloat16,
                          requires_grad=True) for _ in range(5)]
    fused = joint_attention_fused(*inputs, 0.125)
    reference = joint_attention(*[t.float() for t in inputs], 0.125)
    torch.testing.assert_close(fused.float(), reference, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(fused)
    g_fused = torch.autograd.grad(fused, inputs, grad)
    g_ref = torch.autograd.grad(reference, inputs, grad.float())
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("variant", ["dense", "asymloop", "asymloop_olmo", "asymloop_no_local_kv"])
def test_transformer_engine_spec_trains_in_bf16(mcore, variant):
    pytest.importorskip("transformer_engine")
    from megaloop.models.model import build_model

    cfg = small_config(variant, hidden_size=128, seq_length=128)
    model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16).cuda()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
    loss = model(x, labels=x).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_transformer_engine_fp8_forward(mcore):
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import DelayedScaling

    from megaloop.models.model import build_model

    cfg = small_config("asymloop", hidden_size=128, seq_length=128, vocab_size=256)
    model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16).cuda()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        loss = model(x, labels=x).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
