"""megaloop's layer modules: no per-call host data in the loop, no stack-sized Global KV
gradient."""

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


def _loss_and_stack_size(model, x):
    """The loss of ``model`` on ``x`` and the size of the stacked Global KV of its forward."""
    results = []
    global_kv = model.global_kv
    model.global_kv = lambda *args: results.append(global_kv(*args)) or results[-1]
    try:
        return model(x, labels=x).sum(), sum(t.numel() for t in tree_leaves(results))
    finally:
        del model.global_kv


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv"])
def test_the_backward_pass_allocates_nothing_of_the_stacked_global_kv_s_size(seeded, variant):
    """Each of the D x K decoder layer calls used to index the stacked Global KV, whose backward
    gave each call a gradient of the stack's size (zero-filled, the slice copied in, then added
    up: 2 x 4 + 7 stack-sized results here); the layers now read their projections themselves,
    whose gradients add up in their own size."""
    cfg = small_config(variant, iterations=4)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    loss, size = _loss_and_stack_size(model, x)
    with CountStackSized(size) as counter:
        loss.backward()
    assert counter.ops == []


def _assert_bitwise_unchanged(cfg, recompute, dtype, patch):
    """The loss and every parameter's gradient of one step are the same bits before and after
    ``patch()`` swaps in the former way of computing them."""
    model = build_model(cfg, ParallelConfig(recompute=recompute), params_dtype=dtype)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(x, labels=x).float().mean()
        loss.backward()
        return [loss] + [p.grad for p in model.parameters()]

    now = loss_and_grads()
    patch()
    before = loss_and_grads()
    assert all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


def _indexing_the_stack(layer, context):
    """What every decoder layer call did before (and recomputation replays still do); without
    recomputation, which has no stack, a stack of this layer's projections."""
    if context is None:
        return tuple(torch.stack(layer.global_kv_projections[1]())[None][0].unbind(0))
    return tuple(context[layer.context_index].unbind(0))


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv", "asymloop_tied_gqa1"])
def test_reading_the_projections_changes_no_loss_or_gradient_bit(seeded, variant, recompute,
                                                                 monkeypatch):
    """The decoder layers reading their Global KV projections themselves
    (LoopedTransformerLayer._global_kv_slice) against indexing the stacked Global KV."""
    from megaloop.models.layers import LoopedTransformerLayer

    _assert_bitwise_unchanged(small_config(variant), recompute, torch.float32, lambda: (
        monkeypatch.setattr(LoopedTransformerLayer, "_global_kv_slice", _indexing_the_stack)))


@pytest.mark.parametrize("recompute, training, stacks", [("none", True, 0), ("full", False, 0),
                                                          ("full", True, 1)])
@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv"])
def test_the_forward_stacks_the_global_kv_only_for_full_recomputation(seeded, variant, recompute,
                                                                      training, stacks):
    """The decoder layers read their projections; only megatron-core's full recomputation (in
    training, where its checkpointed forward runs) replays a layer on the stacked Global KV. The
    stack used to be built in every forward: a stack-sized copy held until the loop ended."""
    cfg = small_config(variant, iterations=4)
    model = build_model(cfg, ParallelConfig(recompute=recompute)).train(training)
    batch = 2
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length))
    size = (cfg.num_decoder_layers * 2 * cfg.seq_length * batch * cfg.num_query_groups
            * cfg.kv_channels)
    with CountStackSized(size) as counter:
        loss = model(x, labels=x).sum()
    assert len(counter.ops) == stacks, counter.ops
    if training:
        loss.backward()


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_masked"])
def test_the_k_calls_of_a_layer_read_one_copy_of_its_repeated_global_heads(seeded, variant):
    """Under GQA the joint core attention attends to the Global KV with its heads repeated; it
    used to repeat them in each of the K calls (K copies per layer, each held for the backward
    pass). The Global KV is fixed across iterations: one copy per layer now."""
    from megaloop.models.layers import JointCoreAttention

    cfg = small_config(variant, iterations=4)
    assert cfg.num_query_groups < cfg.num_attention_heads
    model = build_model(cfg)
    storages = {}
    for module in model.modules():
        if isinstance(module, JointCoreAttention):
            def recording(q, k_glob, v_glob, *rest, kernel=module.kernel, module=module):
                storages.setdefault(module, set()).update(
                    t.untyped_storage().data_ptr() for t in (k_glob, v_glob))
                return kernel(q, k_glob, v_glob, *rest)
            module.kernel = recording
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    model(x, labels=x).sum().backward()
    assert [len(s) for s in storages.values()] == [2] * cfg.num_decoder_layers


def _repeating_per_call(attention, keys, values):
    """What the K calls did before: the core attention repeats the projections' heads."""
    return lambda: (keys, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("variant", ["asymloop", "asymloop_masked"])
def test_repeating_the_global_heads_once_changes_no_loss_or_gradient_bit(seeded, variant,
                                                                        recompute, dtype,
                                                                        monkeypatch):
    """JointSelfAttention.loop_global_kv against repeating the Global heads in every call: each
    call's gradient is still summed over its group's heads before the K calls' add up."""
    from megaloop.models.layers import JointSelfAttention

    _assert_bitwise_unchanged(small_config(variant), recompute, dtype, lambda: (
        monkeypatch.setattr(JointSelfAttention, "loop_global_kv", _repeating_per_call)))
