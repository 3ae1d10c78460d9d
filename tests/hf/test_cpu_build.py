"""A conversion is a CPU job, on a GPU machine too: its model is built wholly on the CPU. Built by
the GPU rule, megatron-core made its layers on the GPU and megaloop's own modules (norms,
LatentLoop's scales, MoE routers) on the CPU, and ``megaloop-to-hf`` failed on a GPU node unless
CUDA was hidden. Here CUDA is faked present, its device the meta device, which nothing is made
on by a CPU build."""

import pytest
import torch

from megaloop.presets import preset


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))


def _devices(model) -> set[str]:
    return {t.device.type for t in list(model.parameters()) + list(model.buffers())}


@pytest.mark.parametrize("arch", ["asymloop", "latentloop"])
def test_a_conversion_model_is_wholly_on_the_cpu_where_cuda_is_present(mcore, fake_cuda, arch,
                                                                        monkeypatch):
    from megaloop.hf.checkpoint import build_single_process_model

    cfg = preset("tiny", arch=arch, num_experts=4, seq_length=32, vocab_size=256)
    model = build_single_process_model(cfg)
    assert _devices(model) == {"cpu"}
    # It runs (local spec, allgather MoE dispatcher) where CUDA is present; megatron-core's
    # run-time allocations on the current device land on the CPU here, as on a CPU machine.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    assert model(torch.randint(0, 256, (1, 32))).isfinite().all()


def test_flops_measure_builds_on_the_cpu_where_cuda_is_present(mcore, fake_cuda, load_tool,
                                                                monkeypatch):
    from megaloop.models import model as model_module

    built = []
    real = model_module.build_model

    def build_model(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(model_module, "build_model", build_model)
    # The count itself runs the model on CPU tokens: stop before it, once the model is built.
    monkeypatch.setattr(torch.utils.flop_counter, "FlopCounterMode", _stop)
    with pytest.raises(_Stop):
        load_tool("flops").measure(preset("tiny", arch="asymloop", seq_length=32,
                                          vocab_size=256))
    assert built and all(_devices(m) == {"cpu"} for m in built)
