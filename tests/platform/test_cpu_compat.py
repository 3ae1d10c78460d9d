"""The CPU layer redirects megatron-core's CUDA assumptions without stubbing their semantics."""

import torch

from megaloop.platform import cpu_compat


def test_enabled_without_cuda(mcore):
    assert cpu_compat.enable() is (not torch.cuda.is_available())
    assert cpu_compat.is_enabled()


def test_cuda_allocations_land_on_cpu(mcore):
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"  # what the optimizer compares
    assert torch.ones(2).type(torch.float64).dtype == torch.float64  # conversions untouched


def test_model_parallel_rng_tracker_forks_and_restores(mcore):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(5)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default stream"
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(inside, second), "the tracked stream must advance"
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    with tracker.fork():
        assert torch.equal(torch.rand(4), inside), "the tracked stream is seeded deterministically"
