"""megaloop's layer modules: no per-call host data in the loop, one stack-sized Global KV gradient."""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megaloop.config import ParallelConfig
from megaloop.models.model import build_model
from tests.models.variants import small_config

# Ways to build a tensor from host data: on a GPU each is a host-to-device copy from pageable
# memory, which synchronises the host with the device.
HOST_DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.from_numpy)


class CountHostData(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_DATA_FACTORIES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv", "fullloop"])
def test_training_step_builds_no_tensor_from_host_data(seeded, variant, recompute):
    """Each decoder layer call selects its Global KV slice on the device: D x K calls per forward
    (and again in recomputation) used to copy an index tensor from the host."""
    cfg = small_config(variant, iterations=4)
    model = build_model(cfg, ParallelConfig(recompute=recompute))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    with CountHostData() as counter:
        model(x, labels=x).sum().backward()
    assert counter.calls == []


class CountStackSized(TorchDispatchMode):
    """Counts the operators allocating an output of ``numel`` elements and at least five
    dimensions: in a small AsymLoop model only the stacked Global KV of all decoder layers and
    tensors of its size (one layer's share has four dimensions, or five and 1/D of the
    elements). A view (of an input's storage) allocates nothing."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.numel() == self.numel and t.dim() >= 5
                    and t.untyped_storage().data_ptr() not in inputs):
                self.ops.append(str(func))
        return out


def _loss_and_stack(model, x):
    """The loss of ``model`` on ``x`` and the stacked Global KV its forward computed."""
    stacks = []
    global_kv = model.global_kv
    model.global_kv = lambda *args: stacks.append(global_kv(*args)) or stacks[-1]
    try:
        return model(x, labels=x).sum(), stacks[0]
    finally:
        del model.global_kv


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv"])
def test_the_backward_pass_allocates_the_stacked_global_kv_once(seeded, variant):
    """Each of the D x K decoder layer calls used to index the stacked Global KV, whose backward
    gave each call a gradient of the stack's size (zero-filled, the slice copied in, then added
    up: 2 x 4 + 7 stack-sized results here); the layers' views are now unbound once per forward,
    and their gradients meet in one stack-sized tensor."""
    cfg = small_config(variant, iterations=4)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    loss, stack = _loss_and_stack(model, x)
    with CountStackSized(stack.numel()) as counter:
        loss.backward()
    assert len(counter.ops) == 1, counter.ops


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv", "asymloop_tied_gqa1"])
def test_unbound_global_kv_views_change_no_loss_or_gradient_bit(seeded, variant, recompute,
                                                                  monkeypatch):
    """The views unbound once per forward (LoopedLM._global_kv_views) against indexing the stack
    in every layer call, which megatron-core's recomputation replays still do."""
    from megaloop.models.model import LoopedLM

    cfg = small_config(variant)
    model = build_model(cfg, ParallelConfig(recompute=recompute))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(x, labels=x).sum()
        loss.backward()
        return [loss] + [p.grad for p in model.parameters()]

    unbound = loss_and_grads()
    monkeypatch.setattr(LoopedLM, "_global_kv_views",
                        lambda self, context: contextlib.nullcontext())
    indexed = loss_and_grads()
    assert all(torch.equal(a, b) for a, b in zip(unbound, indexed, strict=True))
