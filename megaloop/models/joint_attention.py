"""Fused joint Global+Local attention: two causal flash calls merged by their log-sum-exps.

Query i attends to Global keys <= i and Local keys <= i under one softmax. That equals two ordinary
causal attentions (q against Global, q against Local) whose outputs are merged with weights
exp(lse_block - lse), lse = logaddexp(lse_global, lse_local). Each block costs one causal N x N
flash attention, so the joint softmax needs no [N, 2N] score matrix.

The backward is written by hand because the flash kernels' backward ignores any gradient flowing
into their logsumexp output, so autograd through a naive merge gives wrong gradients. As in ring
attention, each block's flash backward is called with the *merged* output and *merged* lse: the
kernel then rebuilds the block's true share of the joint softmax, exp(S_block - lse), and its
rowsum(dO * O) term is the joint one, so the block gradients are exact and dq is their sum.

The exact masked formula lives in megaloop.reference (the self-contained reference model); tests hold
this kernel to it, values and gradients.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten


def _flash_forward(q, k, v, scale):
    """Causal flash attention returning (out, lse, saved) with q, k, v in [B, H, N, D]."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _flash_backward(grad_out, q, k, v, out, lse, saved, scale):
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return _aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
            scale=scale,
        )
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, True, scale=scale
    )


class _JointFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_glob, v_glob, k_loc, v_loc, scale):
        out_g, lse_g, saved_g = _flash_forward(q, k_glob, v_glob, scale)
        out_l, lse_l, saved_l = _flash_forward(q, k_loc, v_loc, scale)
        lse = torch.logaddexp(lse_g, lse_l)  # fp32, as the kernels return it
        # Weights of each block in the joint softmax, broadcast over the head dimension. The merge
        # runs in fp32 and rounds once: in bf16 the weights, both products and the sum would each
        # be rounded (relative error 3.3e-3 against 2.5e-3 for the masked softmax in bf16).
        w_g = torch.exp(lse_g - lse).unsqueeze(-1)
        w_l = torch.exp(lse_l - lse).unsqueeze(-1)
        # Type promotion reads the (bf16) block outputs as fp32 inside the fp32 ops (exact, as
        # .float() copies would be) and addcmul rounds its fp32 result once into the output's
        # dtype. The output takes the kernels' memory layout ([B, N, H, D] on CUDA), which their
        # backward needs contiguous: in any other layout it copies it at each of the two calls.
        out = torch.addcmul(w_g * out_g, w_l, out_l, out=torch.empty_like(out_g))
        ctx.save_for_backward(q, k_glob, v_glob, k_loc, v_loc, out, lse)
        ctx.saved_rng = (saved_g, saved_l)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_glob, v_glob, k_loc, v_loc, out, lse = ctx.saved_tensors
        saved_g, saved_l = ctx.saved_rng
        # One copy into the output's layout (see forward), which both backward calls then take
        # as it is.
        grad_out = grad_out if grad_out.stride() == out.stride() else (
            torch.empty_like(out).copy_(grad_out))
        dq_g, dk_g, dv_g = _flash_backward(grad_out, q, k_glob, v_glob, out, lse, saved_g, ctx.scale)
        dq_l, dk_l, dv_l = _flash_backward(grad_out, q, k_loc, v_loc, out, lse, saved_l, ctx.scale)
        return dq_g + dq_l, dk_g, dv_g, dk_l, dv_l, None


def runs_masked_formula(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``joint_attention_fused`` on tensors of this device and dtype runs the exact masked
    formula ([N, 2N] scores) instead of the flash kernels: CUDA's flash kernel takes only
    fp16/bf16. The one rule, also behind the model's start-up note
    (megaloop.models.model.note_fp32_joint_attention)."""
    return device.type == "cuda" and dtype == torch.float32


def joint_attention_fused(q, k_glob, v_glob, k_loc, v_loc, scale: float):
    """Joint causal attention over [Global; Local] keys. All tensors [B, H, N, D] (any strides),
    equal head counts.

    Returns [B, H, N, D]. Equal to megaloop.reference.modeling_asymloop.joint_attention, which
    runs instead where the flash kernels cannot (``runs_masked_formula``).
    """
    if runs_masked_formula(q.device, q.dtype):
        from megaloop.reference.modeling_asymloop import joint_attention

        return joint_attention(q, k_glob, v_glob, k_loc, v_loc, scale)
    # The flash kernels take strided inputs, so megatron-core's [N, B, H, D] tensors arrive as
    # permuted views without copies.
    return _JointFlashAttention.apply(q, k_glob, v_glob, k_loc, v_loc, scale)
