"""RMSNorm for megatron-core's local (CPU) spec that supports sequence parallelism.

megatron-core's local norm (``WrappedTorchNorm``) refuses ``sequence_parallel``; its Transformer
Engine and apex norms accept it. Under sequence parallelism each tensor-parallel rank normalises its
own slice of the sequence, so the weight gradient on a rank is a partial sum over that slice.
megatron-core's ``finalize_model_grads`` sums the gradients of every parameter flagged
``sequence_parallel`` over the tensor-parallel group; the Transformer Engine and apex norms set that
flag from the config, and so does this one. Without sequence parallelism the flag is False and every
rank already holds the full gradient.

The backward pass is written by hand: torch's CPU ``rms_norm`` is a composite of elementwise ops,
whose autograd backward runs about a dozen passes over the input (pow, mean, rsqrt, two broadcast
multiplications and their backward nodes). That cost is no matmul, so the analytical FLOP count
misses it, and AsymLoop pays it more often than Full Loop (QK-norm on q, Local k and Global k, and
the Global KV's norm: 37 norms per forward of the step-time benchmark's AsymLoop against Full
Loop's 17; docs/benchmarks.md "Step time").
"""

from __future__ import annotations

import torch


class _RMSNormFunction(torch.autograd.Function):
    """y = x_hat * w rounded once to x's dtype, x_hat = x * rsqrt(mean(x^2) + eps) over the last
    dimension, computed in fp32 (or wider): the ops of torch's CPU ``rms_norm``, so the forward is
    bitwise the same, its dtype too (x's, also beside a wider weight: a bf16 model's activations
    stay bf16 for the matmuls that follow). Saves x, the rsqrt and, in fp32, x_hat (what autograd saved
    through torch's ops); a narrower x_hat is recomputed instead of kept in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        upcast = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True).add_(eps))
        x_hat = upcast.mul(rstd)
        ctx.save_for_backward(x, rstd, weight, x_hat if x_hat.dtype == x.dtype else None)
        return x_hat.mul(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight, x_hat = ctx.saved_tensors
        if x_hat is None:
            x_hat = x.to(rstd.dtype).mul(rstd)
        grad = grad.to(rstd.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.mul(x_hat).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        # d(x r)/dx applied to g: r (g - x_hat mean(g x_hat)), g the gradient at x_hat.
        grad_x_hat = grad.mul(weight)
        mean = grad_x_hat.mul(x_hat).mean(-1, keepdim=True)
        grad_x = torch.addcmul(grad_x_hat, x_hat, mean, value=-1).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way megatron-core builds a norm (``config``, ``hidden_size``,
    ``eps``); state-dict keys are those of megatron-core's local norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_backend_options):
        # In the model's parameter dtype, as megatron-core's other layers and Transformer Engine's
        # norms are: torch's default (fp32) left a bf16 model's norms fp32.
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # torch's fused CUDA kernels, forward and backward. The hand-written function runs a
            # norm as several elementwise kernels (fp32 casts, pow, mean, mul, addcmul): on an
            # H200 the 1B preset's step (tools/bench/step_time.py) took 851 ms with it against
            # 727 ms with these for AsymLoop, 645 against 582 ms for Full Loop.
            return super().forward(x)
        return _RMSNormFunction.apply(x, self.weight, self.eps)
