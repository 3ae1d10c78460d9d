"""The fused joint attention equals the exact masked reference, values and gradients."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    g_fused = torch.autograd.grad(fused, inputs, grad_out, retain_graph=True)
    g_masked = torch.autograd.grad(masked, inputs, grad_out)
    for name, a, b in zip(["q", "k_glob", "v_glob", "k_loc", "v_loc"], g_fused, g_masked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"d{name} differs")
    # A gradient in another layout (or broadcast) is copied into the output's: the same bits.
    for other in (grad_out.transpose(1, 2).contiguous().transpose(1, 2),
                  grad_out.mean().expand_as(grad_out)):
        again = torch.autograd.grad(fused, inputs, other, retain_graph=True)
        expected = torch.autograd.grad(fused, inputs, other.contiguous(), retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, expected))


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


def test_the_kernel_falls_back_exactly_where_runs_masked_formula_says(monkeypatch):
    """The start-up note (megaloop.models.model) and the kernel read one predicate; here it is
    made to say "fallback" on the CPU, where the flash path would otherwise run."""
    from megaloop.models import joint_attention as kernel

    inputs = [x.detach() for x in _inputs(1, 2, 33, 16)]
    masked = joint_attention(*inputs, 0.25)
    flash = joint_attention_fused(*inputs, 0.25)
    assert not torch.equal(flash, masked)  # else this test could not tell the paths apart
    seen = []
    monkeypatch.setattr(kernel, "runs_masked_formula",
                        lambda device, dtype: seen.append((device, dtype)) or True)
    assert torch.equal(joint_attention_fused(*inputs, 0.25), masked)
    assert seen == [(torch.device("cpu"), torch.float32)]


@pytest.mark.parametrize("device, dtype, masked", [
    ("cuda", torch.float32, True), ("cuda", torch.bfloat16, False), ("cuda", torch.float16, False),
    ("cpu", torch.float32, False), ("cpu", torch.bfloat16, False)])
def test_runs_masked_formula_only_in_fp32_on_cuda(device, dtype, masked):
    from megaloop.models.joint_attention import runs_masked_formula

    assert runs_masked_formula(torch.device(device), dtype) is masked


# ------------------------------------------------------------------------------------------------
# megatron-core's layouts (shared with the CUDA check in tests/models/test_gpu.py)
# ------------------------------------------------------------------------------------------------

def megatron_layout_leaves(b, n, heads, groups, d, dtype=torch.float32, device="cpu", seed=0):
    """The tensors a decoder layer's core attention is cut from: the fused QKV projection output
    [N, B, groups, (heads/groups + 2) * D] and this layer's Global KV slice [N, B, groups, 2D]."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(n, b, groups, (heads // groups + 2) * d, generator=g)
    global_kv = torch.randn(n, b, groups, 2 * d, generator=g)
    return [t.to(device, dtype).requires_grad_() for t in (mixed, global_kv)]


def _split(mixed, global_kv, heads, d):
    """Cuts q, k, v and the Global halves as megatron-core's SelfAttention and megaloop's
    GlobalKVMixin do: k and v stay strided views of the fused output, q is reshaped."""
    groups = mixed.shape[2]
    q, k, v = torch.split(mixed, [heads // groups * d, d, d], dim=3)
    q = q.reshape(q.shape[0], q.shape[1], heads, d)
    return (q, k, v), global_kv.split(d, dim=-1)


def joint_core_attention(mixed, global_kv, heads, d, impl="fused"):
    """megaloop's JointCoreAttention on megatron-core's [N, B, heads, D] views -> [N, B, heads*D]."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megaloop.models.layers import JointCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=mixed.shape[2], kv_channels=d)
    core = JointCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                              impl=impl)
    (q, k, v), core.global_kv = _split(mixed, global_kv, heads, d)
    return core(q, k, v)


def fp64_reference(mixed, global_kv, heads, d):
    """The masked joint attention in float64 on the same values; returns (output, grad leaves)."""
    leaves = [t.detach().double().requires_grad_() for t in (mixed, global_kv)]
    (q, k, v), (k_glob, v_glob) = _split(*leaves, heads, d)
    n, b, groups = k.shape[:3]

    def heads_first(x):
        return x.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)

    out = joint_attention(q.permute(1, 2, 0, 3), heads_first(k_glob), heads_first(v_glob),
                          heads_first(k), heads_first(v), d ** -0.5)
    return out.permute(2, 0, 1, 3).reshape(n, b, heads * d), leaves


def relative_error(actual, expected) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def layout_errors(b, n, heads, groups, d, dtype, device):
    """Relative errors of the fused kernel on megatron-core's layouts against float64: the output
    and the gradients of both leaves (the fused QKV output and the Global KV slice)."""
    mixed, global_kv = megatron_layout_leaves(b, n, heads, groups, d, dtype, device)
    out = joint_core_attention(mixed, global_kv, heads, d)
    expected, leaves = fp64_reference(mixed, global_kv, heads, d)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, [mixed, global_kv], grad_out.to(dtype))
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    return {"out": relative_error(out, expected),
            "d_qkv": relative_error(grads[0], expected_grads[0]),
            "d_global_kv": relative_error(grads[1], expected_grads[1])}


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_fused_on_megatron_layouts_matches_fp64(heads, groups):
    errors = layout_errors(2, 130, heads, groups, 32, torch.float32, "cpu")
    assert max(errors.values()) < 1e-5, errors


def test_bf16_merge_rounds_once():
    """The log-sum-exp merge runs in fp32 and rounds once: its bf16 output is within 1.75x the
    error of rounding the exact result to bf16 (a bf16 merge gives about 2.1x)."""
    inputs = [t.detach().bfloat16() for t in _inputs(2, 4, 257, 64)]
    exact = joint_attention(*[t.double() for t in inputs], 0.125)
    fused = joint_attention_fused(*inputs, 0.125)
    assert relative_error(fused, exact) < 1.75 * relative_error(exact.bfloat16(), exact)


def test_bf16_merge_equals_the_fp32_formula_rounded_once():
    """Type promotion inside the merge's fp32 ops gives the bits of fp32 copies of the kernels'
    bf16 outputs merged in fp32 and rounded once."""
    inputs = [t.detach().bfloat16() for t in _inputs(2, 4, 257, 64)]
    q, kg, vg, kl, vl = inputs
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_g, lse_g = flash(q, kg, vg, 0.0, True, scale=0.125)
    out_l, lse_l = flash(q, kl, vl, 0.0, True, scale=0.125)
    lse = torch.logaddexp(lse_g, lse_l)
    weights = [torch.exp(part - lse).unsqueeze(-1) for part in (lse_g, lse_l)]
    merged = torch.addcmul(weights[0] * out_g.float(), weights[1], out_l.float()).bfloat16()
    assert torch.equal(joint_attention_fused(*inputs, 0.125), merged)


class CountCopies(TorchDispatchMode):
    COPIES = ("aten._to_copy", "aten.clone", "aten.copy_", "aten.contiguous")

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.COPIES):
            self.copies.append(str(func))
        return func(*args, **(kwargs or {}))


def test_joint_core_attention_in_bf16_copies_nothing():
    """On megatron-core's layouts (no GQA repeat) the bf16 forward and backward copy no tensor:
    they did cast both blocks' outputs to fp32 and the merged one back, and the merged output's
    layout (not the kernels') made the [N, B, H*D] reshape after it a copy."""
    mixed, global_kv = megatron_layout_leaves(2, 64, 4, 4, 32, torch.bfloat16)
    grad_out = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    with CountCopies() as counter:
        out = joint_core_attention(mixed, global_kv, 4, 32)
        torch.autograd.grad(out, [mixed, global_kv], grad_out)
    assert counter.copies == []
