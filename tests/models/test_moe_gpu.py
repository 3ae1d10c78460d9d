"""GPU checks of MoE and LatentLoop (marker ``gpu``; skipped without CUDA), run by tools/gpu_check.sh:
the CUDA path's alltoall dispatcher with local experts (fp32: parity with the reference to 1e-4) and
Transformer Engine's grouped-GEMM experts (bf16: no farther from float64 than a bf16 reference)."""

import pytest
import torch
import torch.nn.functional as F

from megaloop.models.export import reference_state_dict, to_reference
from megaloop.models.model import build_model
from tests.models.test_gpu import (_tokens, _transformer_engine, assert_parity, model_vs_reference,
                                   record)
from tests.models.variants import small_config

pytestmark = pytest.mark.gpu
NO_AUX = dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)  # the reference has no training terms


@pytest.mark.parametrize("variant", ["asymloop_moe", "latentloop_moe", "latentloop_moe_topk",
                                     "latentloop_moe_width", "latentloop_moe_expert_ffn"])
def test_alltoall_dispatch_fp32_on_cuda_matches_reference(seeded, variant):
    cfg = small_config(variant, **NO_AUX)
    model = build_model(cfg, use_te=False).cuda()
    assert model.config.moe_token_dispatcher_type == "alltoall"
    reference = to_reference(model).cuda()
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    torch.testing.assert_close(model(x), reference(x).logits, atol=1e-4, rtol=1e-4)
    model(x, labels=labels).mean().backward()
    F.cross_entropy(reference(x).logits.flatten(0, 1), labels.flatten()).backward()
    expected = reference_state_dict({n: p.grad for n, p in model.named_parameters()}, cfg)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(expected[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


# LatentLoop's narrowed visits cut Transformer Engine's weights (fused-norm linears, grouped
# experts' weight<e>) per call, as they do the local modules'.
@pytest.mark.parametrize("variant", ["asymloop_moe", "latentloop_moe_width",
                                     "latentloop_moe_expert_ffn"])
def test_te_grouped_gemm_experts_match_reference_in_bf16(seeded, variant):
    _transformer_engine()
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    cfg = small_config(variant, hidden_size=128, seq_length=128, **NO_AUX)
    model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16).cuda()
    assert isinstance(model.decoder.layers[0].mlp.experts, TEGroupedMLP)
    errors = model_vs_reference(model, cfg)
    record("te_grouped_moe_bf16_vs_fp64", variant=variant,
           worst=max(errors.items(), key=lambda kv: kv[1][0]))
    assert_parity(errors, floor=2e-2)
