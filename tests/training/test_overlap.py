"""Data-parallel communication overlap (parallel.overlap_grad_reduce / overlap_param_gather,
megaloop.training.ddp): DP=2 with two micro-batches per rank and step trains to the same losses
and weights with overlap as without, with and without the distributed optimizer; the buckets'
reductions start during the backward pass (not in finalize_model_grads, where they start without
overlap); the weight-tied decoder's gradient hook fires once per parameter per backward however
many iterations use it; the refused combinations fail in one line."""

from pathlib import Path

import pytest
import torch

from megaloop.config.errors import ConfigError
from tests.distributed import run_distributed
from tests.training.conftest import one_line, tiny_run, train_losses, write_pattern_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("odata") / "pattern")


def _train(rank, world_size, data_prefix, out_dir, parallel, train, model=None,
           checkpoint=None):
    """Trains 3 steps, recording when each bucket group's reduction starts relative to
    finalize_model_grads; returns losses, weights, those events and the hooks' per-parameter
    counts (megatron-core's, from the first step's last backward)."""
    from megaloop.training.trainer import Trainer

    trainer = Trainer(tiny_run(data_prefix, Path(out_dir), parallel=parallel, model=model,
                               checkpoint=checkpoint, train={"train_steps": 3, "global_batch_size": 8,
                                      "log_interval": 1, **train}))
    events = []
    groups = [g for ddp in trainer.ddps for g in ddp.bucket_groups]
    for group in groups:
        start = group.start_grad_sync
        group.start_grad_sync = (lambda *a, start=start, **k:
                                 (events.append("reduce"), start(*a, **k))[1])
    config = trainer.model.config
    finalize = config.finalize_model_grads_func
    config.finalize_model_grads_func = (lambda *a, **k: (events.append("finalize"),
                                                         finalize(*a, **k))[1])
    trainer.train()
    counts = sorted({c for g in groups for c in g.golden_per_param_grad_ready_counts.values()})
    weights = {f"{chunk}.{n}": p.detach().clone() for chunk, m in enumerate(trainer.models)
               for n, p in m.named_parameters()}
    tied = ({f"{layer}.{name}": [p.detach().clone() for p in params]
             for (layer, name), params in trainer.tied.copies.items()}
            if trainer.tied is not None else {})
    return {"losses": train_losses(Path(out_dir)) if rank == 0 else None, "weights": weights,
            "events": events, "groups": len(groups), "counts": counts, "tied": tied,
            "all_reduced": sum(type(g).__name__ == "_AllReducedBucketGroup" for g in groups)}


def _run(data, out, parallel, distributed_optimizer, steps=3, checkpoint=None):
    return run_distributed(_train, world_size=2, data_prefix=data, out_dir=str(out),
                           parallel=parallel, train={"distributed_optimizer": distributed_optimizer,
                                                     "train_steps": steps},
                           checkpoint=checkpoint)


@pytest.mark.parametrize("distributed_optimizer, recompute", [
    (False, "none"), (True, "none"), (True, "full")], ids=["ddp", "distopt", "distopt_recompute"])
def test_overlap_trains_like_no_overlap_and_reduces_during_backward(mcore, data, tmp_path,
                                                                    distributed_optimizer,
                                                                    recompute):
    overlap = {"overlap_grad_reduce": True, "ddp_bucket_size": 2000,
               "overlap_param_gather": distributed_optimizer, "recompute": recompute}
    plain = _run(data, tmp_path / "plain", {"recompute": recompute}, distributed_optimizer)
    lapped = _run(data, tmp_path / "overlap", overlap, distributed_optimizer)
    # Without overlap: one bucket, reduced inside finalize_model_grads.
    assert plain[0]["groups"] == 1
    assert plain[0]["events"] == ["finalize", "reduce"] * 3
    # With it: several buckets; from step 2 on (megatron-core learns the hooks' counts in step 1)
    # every bucket's reduction starts in the last micro-batch's backward, before finalize.
    groups = lapped[0]["groups"]
    assert groups > 1
    assert lapped[0]["events"] == (["finalize"] + ["reduce"] * groups
                                   + (["reduce"] * groups + ["finalize"]) * 2)
    # The tied decoder (2 iterations) is one autograd leaf: its hook fires once per backward;
    # recomputation runs a backward per recomputed block, so the hook fires once per iteration
    # there, and megatron-core waits for the counts it learnt in step 1.
    assert lapped[0]["counts"] == [1] if recompute == "none" else max(lapped[0]["counts"]) > 1
    assert lapped[0]["losses"] == plain[0]["losses"] and len(plain[0]["losses"]) == 3
    for mine, theirs in zip(lapped, plain):
        assert mine["weights"].keys() == theirs["weights"].keys()
        for name, weight in mine["weights"].items():
            assert torch.equal(weight, theirs["weights"][name]), name
    if recompute == "full":
        return
    # A run of 2 steps without overlap resumed with it: step 3 is plain's, unless the distributed
    # optimizer's state is laid out by buckets that overlap cuts anew.
    _run(data, tmp_path / "resumed", {}, distributed_optimizer, steps=2)
    if distributed_optimizer:
        with pytest.raises(AssertionError, match=r"parallel.overlap_grad_reduce=True, parallel."
                           r"ddp_bucket_size=2000: differs from False, 0 in .*config.yaml, and a "
                           r"resume cannot apply it \(.*dp_reshardable, flat per megatron-core "
                           r"DDP bucket, of \[\[\d+\]\] elements on rank 0, where this run cuts "
                           r"\[\[\d+, \d+, "):
            _run(data, tmp_path / "resumed", overlap, distributed_optimizer)
        # With megatron-core's default bucket size the model fits one bucket, as without
        # overlap: accepted (continuing the 2-step checkpoint from another directory), and step
        # 3 is the plain resume's to the bit.
        one_bucket = _run(data, tmp_path / "one_bucket", {"overlap_grad_reduce": True,
                                                          "overlap_param_gather": True}, True,
                          checkpoint={"load": str(tmp_path / "resumed" / "checkpoints"
                                                  / "iter_0000002")})
        reference = _run(data, tmp_path / "resumed", {}, True)
        assert one_bucket[0]["losses"] == {3: reference[0]["losses"][3]}
        for mine, theirs in zip(one_bucket, reference):
            for name, weight in mine["weights"].items():
                assert torch.equal(weight, theirs["weights"][name]), name
        # Saved and resumed with overlap (the deferred gather completed before the save) as
        # without (the 2-step runs' LR schedule differs from the 3-step runs' above).
        _run(data, tmp_path / "overlap2", overlap, True, steps=2)
        resumed = _run(data, tmp_path / "overlap2", overlap, True)
        assert resumed[0]["losses"] == reference[0]["losses"] and 3 in resumed[0]["losses"]
        for mine, theirs in zip(resumed, reference):
            for name, weight in mine["weights"].items():
                assert torch.equal(weight, theirs["weights"][name]), name
        return
    # Plain DDP's optimizer state is per parameter: the change is accepted. (Resuming with
    # train.distributed_optimizer=false fails at its next save on main too, in megatron-core's
    # optimizer.sharded_state_dict, so the resumed run itself is not trained here.)
    from megaloop.training.resume import check_resume

    cfg = tiny_run(data, tmp_path / "resumed", parallel=overlap,
                   train={"distributed_optimizer": False, "global_batch_size": 8})
    assert check_resume(tmp_path / "resumed" / "checkpoints" / "iter_0000002",
                        cfg) == (False, ())


@pytest.mark.parametrize("parallel, train, message", [
    ({"overlap_grad_reduce": True, "overlap_param_gather": True}, {"distributed_optimizer": False},
     "parallel.overlap_param_gather=True: must be false unless train.distributed_optimizer=true"),
    ({"overlap_param_gather": True}, {},
     "parallel.overlap_param_gather=True: must be false unless parallel.overlap_grad_reduce"),
    ({"ddp_bucket_size": 1000}, {}, "parallel.ddp_bucket_size=1000: must be 0 unless"),
])
def test_refused_overlap_settings(tmp_path, parallel, train, message):
    cfg = tiny_run("data", tmp_path, parallel=parallel, train=train)
    with pytest.raises(ConfigError) as error:
        cfg.validate()
    assert message in one_line(error)


def _step_then_weights(rank, world_size, data_prefix, out_dir):
    """One optimizer step with overlap_param_gather: the weights right after it, and after
    ``_weights_finite`` (which completes the deferred all-gather, as a checkpoint save does)."""
    from megaloop.training.data import MicroBatches
    from megaloop.training.trainer import Trainer

    trainer = Trainer(tiny_run(data_prefix, Path(out_dir), train={"global_batch_size": 8},
                               parallel={"overlap_grad_reduce": True,
                                         "overlap_param_gather": True}))
    cfg = trainer.cfg.train
    trainer.step = 1
    trainer.train_step(MicroBatches(trainer.train_data, cfg.micro_batch_size, trainer.dp_rank,
                                    trainer.dp_size, 0, cfg.global_batch_size))

    def weights():
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    before = weights()
    assert trainer._weights_finite()
    after = weights()
    trainer.close()
    return before, after


def test_parameter_gather_is_deferred_and_completed_before_weights_are_read(data, tmp_path):
    (before0, after0), (before1, after1) = run_distributed(
        _step_then_weights, world_size=2, data_prefix=data, out_dir=str(tmp_path))
    # Each rank updated its own shard; the other's arrives with the next forward (or the gather).
    assert not torch.equal(before0, before1)
    assert torch.equal(after0, after1)
    assert not torch.equal(before0, after0) and not torch.equal(before1, after1)


def test_overlap_in_the_interleaved_schedule(data, tmp_path):
    # A Dense model (no tied copies) at PP=2 x VP=2: the schedule starts each chunk's reduction
    # after its last backward (grad_sync_func); nothing changes a bit.
    layout = {"pipeline": 2, "virtual_pipeline": 2}
    plain, lapped = (run_distributed(_train, world_size=2, data_prefix=data,
                                     out_dir=str(tmp_path / name), parallel={**layout, **extra},
                                     train={}, model={"arch": "dense", "iterations": 1})
                     for name, extra in [("plain", {}), ("overlap", {"overlap_grad_reduce": True,
                                                                     "ddp_bucket_size": 2000})])
    assert lapped[0]["groups"] > plain[0]["groups"]  # the first chunk in several buckets
    assert lapped[0]["events"][0] == "reduce"  # step 1's first reduction before finalize
    assert lapped[0]["losses"] == plain[0]["losses"]
    for mine, theirs in zip(lapped, plain):
        for name, weight in mine["weights"].items():
            assert torch.equal(weight, theirs["weights"][name]), name


@pytest.mark.parametrize("layout, distributed_optimizer", [
    ({"pipeline": 2}, False), ({"pipeline": 2}, True),
    ({"pipeline": 2, "virtual_pipeline": 2}, True)], ids=["pp2_ddp", "pp2_distopt", "vp2_distopt"])
def test_overlap_with_tied_copies_on_several_stages(data, tmp_path, layout, distributed_optimizer):
    # DP=2 x PP=2: decoder layer 1 is a tied copy on both stages; with VP=2 and 3 iterations
    # layers 1 and 2 have copies on 3 of the 4 stages, two of them on pipeline rank 1. Without
    # overlap their gradients are summed before the data-parallel reduction (a reduce-scatter with
    # the distributed optimizer, at no extra traffic); with it, after the reduction, over buckets
    # the distributed optimizer all-reduces: the same sums in another order.
    model = {"iterations": 3} if "virtual_pipeline" in layout else {}
    runs = [run_distributed(_train, world_size=4, data_prefix=data, out_dir=str(tmp_path / name),
                            parallel={**layout, **extra}, model=model,
                            train={"distributed_optimizer": distributed_optimizer})
            for name, extra in [("plain", {}), ("overlap", {
                "overlap_grad_reduce": True, "ddp_bucket_size": 2000,
                "overlap_param_gather": distributed_optimizer})]]
    plain, lapped = runs
    assert plain[0]["events"][-1] == "reduce"  # reduced in finalize_model_grads
    events = lapped[0]["events"]  # reductions start in the backward pass, before finalize (the
    # interleaved schedule's from step 1 on; otherwise once megatron-core learnt the hooks' counts)
    assert events[0] == "reduce" if model else events[-2:] == ["reduce", "finalize"]
    assert all(rank["all_reduced"] == 0 for rank in plain)  # no traffic beyond a reduce-scatter
    assert all(bool(rank["all_reduced"]) == distributed_optimizer for rank in lapped)
    assert len(plain[0]["losses"]) == 3
    assert lapped[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-6)
    # Rounding apart: Adam scales a gradient rounded differently near 0 by up to lr (3e-3) x 1e-4.
    for mine, theirs in zip(lapped, plain):
        for name, weight in mine["weights"].items():
            torch.testing.assert_close(weight, theirs["weights"][name], rtol=1e-5, atol=1e-6,
                                       msg=name)
    for run in runs:  # every copy of a layer, on every rank, holds the same weights
        copies = {}
        for rank in run:
            for key, tensors in rank["tied"].items():
                copies.setdefault(key, []).extend(tensors)
        assert copies and all(len(c) > 1 for c in copies.values())
        assert max(len(c) for c in copies.values()) == (6 if model else 4)
        for key, tensors in copies.items():
            assert all(torch.equal(t, tensors[0]) for t in tensors), key


def test_the_forced_all_reduce_line_is_dropped_and_the_loggers_other_lines_kept(mcore, caplog):
    """megatron-core logs "Performing reduction using all_reduce because force_all_reduce=True"
    at INFO at every reduction of a bucket holding tied copies (distributed optimizer with
    overlap_grad_reduce): a line per step where its logger is at INFO (api.py, notebooks)."""
    import logging
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from megaloop.training import ddp as ddp_module

    class Tied(MegatronModule):
        def __init__(self):
            super().__init__(TransformerConfig(num_layers=1, hidden_size=8,
                                               num_attention_heads=1))
            self.copy = torch.nn.Linear(8, 8)

    model = Tied()
    parallel = SimpleNamespace(overlap_grad_reduce=True, overlap_param_gather=False,
                               ddp_bucket_size=None)
    wrapped = ddp_module.wrap_for_training(model, torch.float32, True, parallel, chunk=0,
                                           all_reduced=set(model.parameters()))
    name = "megatron.core.distributed.param_and_grad_buffer"
    caplog.set_level(logging.INFO, logger=name)

    def reduced() -> list[str]:
        caplog.clear()
        wrapped.start_grad_sync()
        wrapped.finish_grad_sync()
        logging.getLogger(name).info("another line")
        return [record.getMessage() for record in caplog.records if record.name == name]

    assert reduced() == ["another line"]
    logging.getLogger(name).removeFilter(ddp_module._not_forced_all_reduce)
    try:  # what megatron-core logs without the filter: the test sees the forced reduction
        assert reduced() == [ddp_module._FORCED_ALL_REDUCE, "another line"]
    finally:
        logging.getLogger(name).addFilter(ddp_module._not_forced_all_reduce)
