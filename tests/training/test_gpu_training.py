"""GPU checks of the trainer (marker ``gpu``; skipped without CUDA): one-GPU training over NCCL with
Float16Module, the fused joint attention on CUDA and, with Transformer Engine, each FP8 recipe the
GPU runs; a save and resume reproduces the uninterrupted losses; a background checkpoint write
holds the values saved while the trainer goes on pinning host memory."""


import pytest

from megaloop.training.trainer import Trainer
from tests.models.test_gpu import record
from tests.training.conftest import resume_from, tiny_run, train_losses

pytestmark = pytest.mark.gpu

PRECISIONS = {"bf16": dict(precision="bf16"),
              "fp8_current": dict(precision="fp8", fp8_recipe="current"),
              "fp8_delayed": dict(precision="fp8", fp8_recipe="delayed"),
              "fp8_mxfp8": dict(precision="fp8", fp8_recipe="mxfp8")}


def _run(pattern_data, out_dir, train, **checkpoint):
    # hidden 128 / seq 64: shapes Transformer Engine's FP8 GEMMs take (multiples of 16).
    return tiny_run(pattern_data, out_dir, model={"hidden_size": 128, "ffn_hidden_size": 256,
                                                  "seq_length": 64},
                    train=train, checkpoint=checkpoint)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_training_resumes_exactly_on_gpu(mcore, pattern_data, tmp_path, precision):
    train = PRECISIONS[precision]
    if train["precision"] == "fp8":
        from megaloop.config import ConfigError
        from megaloop.platform.fp8 import check_fp8_support

        try:
            check_fp8_support(train["fp8_recipe"])
        except ConfigError as e:
            pytest.skip(str(e))
    straight, repeat, resumed = (tmp_path / name for name in ("straight", "repeat", "resumed"))
    Trainer(_run(pattern_data, straight, train, save_interval=4)).train()
    Trainer(_run(pattern_data, repeat, train)).train()
    resume_from(straight, resumed, 4)
    trainer = Trainer(_run(pattern_data, resumed, train))
    assert trainer.step == 4  # loaded model, optimizer (and FP8 scaling state) on the GPU
    trainer.train()
    a, again, b = (train_losses(p) for p in (straight, repeat, resumed))
    assert sorted(b) == [5, 6, 7, 8]
    assert a[8] < a[1], f"the model must learn: {a}"
    run_to_run = max(abs(a[s] - again[s]) for s in b)
    resume = max(abs(a[s] - b[s]) for s in b)
    record("resume_on_gpu", precision=precision, losses=a, resumed=b,
           run_to_run_max_diff=run_to_run, resume_max_diff=resume)
    if run_to_run == 0:  # the kernels are deterministic here: the resume must be bit-exact
        assert resume == 0, (a, b)
    else:  # otherwise no further from the uninterrupted run than a repeat of it is
        assert resume <= 2 * run_to_run, (a, again, b)


def test_profiled_steps_hold_cuda_kernels_and_the_memory_history(mcore, pattern_data, tmp_path):
    """train.profile on a GPU: the trace holds CUDA kernels of the steps asked for, the operator
    table is by CUDA time, and memory=true writes the allocator's history."""
    import gzip
    import json
    import pickle

    from megaloop.config import ProfileConfig

    cfg = _run(pattern_data, tmp_path / "run", dict(precision="bf16", train_steps=4))
    cfg.train.profile = ProfileConfig(steps=[2, 3], memory=True)
    Trainer(cfg).train()
    stem = tmp_path / "run" / "profile" / "rank0_steps2-3"
    events = json.loads(gzip.decompress(stem.with_name(stem.name + ".trace.json.gz")
                                        .read_bytes()))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    assert "Self CUDA" in stem.with_name(stem.name + ".ops.txt").read_text()
    with open(stem.with_name(stem.name + ".memory.pickle"), "rb") as f:
        snapshot = pickle.load(f)  # written by this test's own run
    assert snapshot["device_traces"] and any(snapshot["device_traces"])
    record("profile_on_gpu", kernels=len(kernels),
           allocation_events=sum(len(t) for t in snapshot["device_traces"]))


def test_a_background_write_reads_the_values_saved_while_the_trainer_pins_memory(
        mcore, tmp_path, monkeypatch):
    """megatron-core stages a write's CUDA tensors in pinned host memory, then forks the writer;
    pinned memory is shared with the fork, not copied on write. While the (slowed) write runs,
    the trainer makes pinned copies of the same sizes, as non-blocking copies to the host do: the
    checkpoint must still hold the values saved (megaloop holds the staged copies meanwhile)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megaloop.config import CheckpointConfig, RunConfig
    from megaloop.training import checkpoint as ckpt
    from tests.training.test_checkpoint_async import _slow_background_writes

    def sharded(tensors):
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}

    _slow_background_writes(monkeypatch, 1.0)
    saved = {f"t{i}": torch.full((1 << 16,), float(i), device="cuda") for i in range(4)}
    saver = ckpt.CheckpointSaver(tmp_path, RunConfig(checkpoint=CheckpointConfig(
        async_save=True)))
    saver.save(1, sharded(saved), wait=False)
    scribbles = [torch.full_like(v, -1.0).to("cpu", non_blocking=True) for v in saved.values()]
    torch.cuda.synchronize()
    assert saver.pending_step == 1 and all(s.is_pinned() for s in scribbles)
    saver.wait()
    loaded = ckpt.load_checkpoint(tmp_path / "iter_0000001",
                                  sharded({k: torch.empty_like(v) for k, v in saved.items()}))
    assert [k for k, v in saved.items() if not torch.equal(loaded[k], v)] == []
