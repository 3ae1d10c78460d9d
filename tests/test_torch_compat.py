"""The private torch APIs that megaloop calls only on a GPU, held on CPU to the calling conventions
it uses. CPU CI never runs those calls, so a torch release that moved them would first fail on a
GPU; these read torch's own operator schemas and signatures instead. torch 2.9.1, 2.11.0 and 2.13.0
have the same ones (setup.py's lower bound)."""

import inspect

import torch

_aten = torch.ops.aten


def _names(arguments):
    return [argument.name for argument in arguments]


def test_cuda_flash_attention_ops_take_and_return_what_joint_attention_passes():
    """megaloop.models.joint_attention on CUDA: the forward is called with six positional
    arguments and scale=, and its nine outputs unpacked by position (logsumexp second, the RNG
    state seventh and eighth); the backward takes them back in that order."""
    forward = _aten._scaled_dot_product_flash_attention.default._schema
    assert _names(forward.arguments)[:6] == ["query", "key", "value", "dropout_p", "is_causal",
                                             "return_debug_mask"]
    assert "scale" in _names(forward.arguments)
    returns = _names(forward.returns)
    assert len(returns) == 9 and returns[:2] == ["output", "logsumexp"], returns
    assert returns[2:6] == ["cum_seq_q", "cum_seq_k", "max_q", "max_k"], returns
    backward = _aten._scaled_dot_product_flash_attention_backward.default._schema
    assert _names(backward.arguments)[:14] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
        "max_q", "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset"]
    assert "scale" in _names(backward.arguments)
    assert len(backward.returns) == 3


def test_cuda_memory_history_takes_the_arguments_profiling_passes():
    """megaloop.training.profiling (train.profile.memory on a GPU) starts the allocator's history
    with max_entries= and stops it with enabled=None."""
    parameters = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= set(parameters)
    assert list(inspect.signature(torch.cuda.memory._dump_snapshot).parameters)[0] == "filename"
