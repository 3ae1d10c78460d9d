"""megaloop.models.norms.RMSNorm: the local spec's norm, torch's RMSNorm with a hand-written backward.

The forward must be bitwise torch's ``rms_norm`` and the gradients equal to autograd's through it up
to rounding; the backward must stay cheap (AsymLoop runs 37 norms per forward in the step-time
benchmark, Full Loop 17: each pass over the input counts there).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaloop.models.norms import RMSNorm


def _config(sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32):
    return SimpleNamespace(sequence_parallel=sequence_parallel, params_dtype=params_dtype)


def _pair(width: int, dtype: torch.dtype, sequence_parallel: bool = False,
          weight_dtype: torch.dtype | None = None):
    weight_dtype = weight_dtype or dtype
    ours = RMSNorm(_config(sequence_parallel, weight_dtype), width, eps=1e-5)
    torch_norm = torch.nn.RMSNorm(width, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        ours.weight.normal_()
        torch_norm.weight.copy_(ours.weight)
    return ours, torch_norm


# (dtype, weight dtype, shape, relative tolerance of the input gradient): a QK-norm's
# [N, B, heads, head_dim] and a hidden norm's [N, B, d]; bf16 is rounded once on the way out in
# both. Beside a wider weight, the output keeps the input's dtype, as torch's does (it was promoted
# to fp32, and the bf16 matmul after it failed on a GPU: "expected mat1 and mat2 to have the same
# dtype").
@pytest.mark.parametrize("dtype, weight_dtype, shape, rtol", [
    (torch.float32, None, (64, 2, 4, 32), 1e-6),
    (torch.float32, None, (64, 2, 96), 1e-6),
    (torch.float64, None, (16, 3, 24), 1e-13),
    (torch.bfloat16, None, (64, 2, 96), 1e-2),
    (torch.bfloat16, torch.float32, (64, 2, 96), 1e-2),
])
def test_matches_torch_rms_norm(dtype, weight_dtype, shape, rtol):
    torch.manual_seed(0)
    ours, torch_norm = _pair(shape[-1], dtype, weight_dtype=weight_dtype)
    x = torch.randn(shape, dtype=dtype)
    grad = torch.randn(shape, dtype=dtype)
    x_ours, x_torch = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_torch = ours(x_ours), torch_norm(x_torch)
    assert out_ours.dtype == out_torch.dtype
    assert torch.equal(out_ours, out_torch)
    out_ours.backward(grad)
    out_torch.backward(grad)
    scale = x_torch.grad.abs().max()
    assert (x_ours.grad - x_torch.grad).abs().max() <= rtol * scale
    assert torch.equal(ours.weight.grad, torch_norm.weight.grad)


def test_gradcheck_fp64():
    torch.manual_seed(0)
    norm = RMSNorm(_config(params_dtype=torch.float64), 8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


def test_sequence_parallel_flag_on_weight():
    ours, _ = _pair(16, torch.float32, sequence_parallel=True)
    assert ours.weight.sequence_parallel is True


def test_weight_in_the_models_parameter_dtype():
    """As megatron-core's linear layers and Transformer Engine's norms; torch's default left a bf16
    model's norms in fp32."""
    assert RMSNorm(_config(params_dtype=torch.bfloat16), 16).weight.dtype == torch.bfloat16


class _FullSizeOps(TorchDispatchMode):
    """Counts the ops that write a tensor of ``shape``: the passes over the input."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape and func not in (
                torch.ops.aten.view.default, torch.ops.aten.expand.default,
                torch.ops.aten.detach.default, torch.ops.aten.ones.default):
            self.count += 1
        return out


def test_backward_is_few_passes_over_the_input():
    """torch's composite backward writes 9 input-sized tensors (pow, mean and rsqrt backward, the
    two broadcast multiplications); the hand-written one 5: g w, g x_hat, g w x_hat, the addcmul
    and its in-place scaling."""
    shape = (32, 2, 4, 64)
    ours, _ = _pair(shape[-1], torch.float32)
    out = ours(torch.randn(shape, requires_grad=True))
    with _FullSizeOps(shape) as counted:
        out.backward(torch.ones(shape))
    assert counted.count <= 5
