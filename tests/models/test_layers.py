"""megaloop's layer modules: no per-call host data in the loop."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

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
