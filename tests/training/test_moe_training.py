"""MoE models in the training system: resume is exact (each expert-parallel rank continuing its own
RNG streams), routing metrics are logged per iteration
(LatentLoop: per visit) without ever entering the reported losses, and LatentLoop learns.
(Expert-parallel layouts and EP checkpoint resharding are tested with the other layouts in
test_parallel_training.py.)"""

import contextlib
import itertools
from pathlib import Path

import pytest

from megaloop.training.monitor import read_metrics
from tests.training.conftest import resume_from, tiny_run, train_losses, write_pattern_dataset

MOE = {"num_experts": 4, "moe_top_k": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("moedata") / "pattern")


@pytest.mark.parametrize("model", [
    MOE,
    # per-visit blocks that borrow the shared weights: their checkpoint holds each weight once
    {"arch": "latentloop", "iterations": 2, "num_experts": 8, "moe_top_k": 4,
     "latent_reduction": "top_k", "untie_attention": True},
    # a visit narrowed to d/2: parts of the shared weights cut per call, through the trainer's
    # data-parallel gradient buffers, and its projections
    {"arch": "latentloop", "iterations": 2, **MOE, "latent_reduction": "width"},
], ids=["asymloop", "latentloop_topk_untied_attention", "latentloop_width"])
def test_moe_resume_reproduces_the_uninterrupted_losses_bit_for_bit(mcore, data, tmp_path, model):
    from megaloop.training.trainer import Trainer

    straight = tmp_path / "straight"
    Trainer(tiny_run(data, straight, model=model, checkpoint={"save_interval": 4})).train()
    resumed = tmp_path / "resumed"
    resume_from(straight, resumed, 4)
    Trainer(tiny_run(data, resumed, model=model)).train()
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert [a[s] for s in b] == [b[s] for s in b]


def test_routing_metrics_are_logged_per_iteration_and_never_enter_reported_losses(
        mcore, data, tmp_path):
    """Step 1 starts from the same weights with tiny and huge auxiliary coefficients: the logged
    training loss (cross-entropy only) and the validation CE are the same; the logged routing
    metrics cover the encoder and every decoder iteration."""
    from megaloop.training.trainer import Trainer

    seed = tmp_path / "seed"
    with Trainer(tiny_run(data, seed, model=MOE)) as trainer:
        trainer.save()
    results = {}
    for coeff in (0.01, 100.0):
        out = tmp_path / f"aux{coeff}"
        trainer = Trainer(tiny_run(
            data, out, model={**MOE, "moe_aux_loss_coeff": coeff, "moe_z_loss_coeff": coeff},
            train={"train_steps": 1},
            checkpoint={"load": str(seed / "checkpoints"), "load_optimizer": False}))
        results[coeff] = (trainer.evaluate()["val_loss"], trainer.train())
        records, _ = read_metrics(out / "metrics.jsonl")
    (val_a, _), (val_b, _) = results.values()
    assert val_a == val_b
    assert train_losses(tmp_path / "aux0.01")[1] == train_losses(tmp_path / "aux100.0")[1]
    train = [r for r in records if r["kind"] == "train"][0]
    for group in ("encoder", "iter1", "iter2"):
        assert train[f"moe_lb_loss_{group}"] >= 1.0  # E * sum f_i P_i is 1 when balanced
        # per application: micro-batch x sequence x top-k assignments
        assert sum(train[f"moe_tokens_{group}_e{i}"] for i in range(4)) == 2 * 32 * 2


def test_latentloop_learns_and_logs_routing_per_visit(mcore, data, tmp_path):
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(data, tmp_path, model={"arch": "latentloop", "iterations": 2, **MOE},
                   train={"train_steps": 30, "lr": 1e-2})
    result = Trainer(cfg).train()
    losses = train_losses(tmp_path)
    first, last = (sum(losses[s] for s in steps) / 5 for steps in (range(1, 6), range(26, 31)))
    assert last < 0.75 * first and result["val_loss"] < losses[1]
    record = [r for r in read_metrics(tmp_path / "metrics.jsonl")[0] if r["kind"] == "train"][-1]
    for group, tokens in (("prelude", 32), ("visit1", 16), ("visit2", 32), ("coda", 32)):
        # per application: micro-batch 2 x positions (visit 1 runs on 16 latents) x top-2
        assert sum(record[f"moe_tokens_{group}_e{i}"] for i in range(4)) == 2 * tokens * 2


def _router_grads(trainer, batches):
    trainer.ddp.zero_grad_buffer()
    trainer._run_microbatches(iter(batches), forward_only=False)
    return {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()
            if "router" in n}


def test_auxiliary_losses_weigh_alike_however_many_positions_the_loss_masks(mcore, data,
                                                                             tmp_path):
    """Every position is routed; the loss counts the unmasked ones. The router z-loss's part of
    the gradient (coefficient 1 minus coefficient 0, from the same weights) is the same whether
    the loss masks half the positions or none. Before, masked, it was 2x: the auxiliary losses
    were weighed positions / loss tokens times their coefficients (fine-tuning: prompt and
    padding)."""
    import torch

    from megaloop.training.data import MicroBatches
    from megaloop.training.trainer import Trainer

    with contextlib.ExitStack() as stack:
        trainers = {coeff: stack.enter_context(Trainer(tiny_run(data, tmp_path / str(coeff), model={
            **MOE, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": coeff})))
            for coeff in (0.0, 1.0)}
        batches = list(itertools.islice(MicroBatches(trainers[0.0].train_data, 2, 0, 1, 0, 4), 2))
        masked = [{**b, "loss_mask": b["loss_mask"] * (torch.arange(32) % 2)} for b in batches]
        parts = []
        for step in (batches, masked):
            with_z, without = (_router_grads(trainers[c], step) for c in (1.0, 0.0))
            parts.append({n: with_z[n] - without[n] for n in with_z})
    for name, full in parts[0].items():
        assert full.abs().max() > 0
        torch.testing.assert_close(parts[1][name], full, rtol=1e-4, atol=1e-7, msg=name)


def _rng_saved_and_resumed(rank, world_size, data_prefix, out_dir, per_expert_rank):
    """megatron-core's RNG tracker streams of this rank when its run saved its last checkpoint,
    and after a run resuming from it was set up; ``per_expert_rank=False`` saves the RNG entry
    as megaloop did before it held one per expert-parallel rank."""
    import functools

    from megaloop.training import checkpoint_state, trainer
    from megaloop.training.rng import rng_state

    def run(steps):
        return tiny_run(data_prefix, Path(out_dir), model=MOE, parallel={"expert": 2},
                        train={"train_steps": steps})

    trainer.sharded_state = functools.partial(checkpoint_state.sharded_state,
                                              rng_by_expert_rank=per_expert_rank)
    try:
        trainer.Trainer(run(2)).train()
    finally:
        trainer.sharded_state = checkpoint_state.sharded_state
    saved = rng_state()["tracker"]
    with trainer.Trainer(run(3)):
        return saved, rng_state()["tracker"]


@pytest.mark.parametrize("per_expert_rank", [True, False], ids=["saved_now", "saved_before"])
def test_resume_restores_each_expert_parallel_ranks_own_rng_streams(data, tmp_path,
                                                                    per_expert_rank):
    """Each expert-parallel rank draws its experts' randomness from its own stream (megatron-
    core's expert-parallel RNG, seeded per rank); a resumed rank continues its own. The
    checkpoint held one RNG state per tensor/pipeline rank, saved by data-parallel rank 0, which
    the other expert-parallel ranks are: every rank resumed with EP rank 0's expert stream. A
    checkpoint saved so still resumes, as it did."""
    import torch

    from tests.distributed import run_distributed

    (saved0, resumed0), (saved1, resumed1) = run_distributed(
        _rng_saved_and_resumed, world_size=2, data_prefix=data, out_dir=str(tmp_path),
        per_expert_rank=per_expert_rank)
    assert not torch.equal(saved0["expert-parallel-rng"], saved1["expert-parallel-rng"])
    for saved, resumed in ((saved0, resumed0), (saved1, resumed1)):
        assert saved.keys() == resumed.keys()
        for stream, state in saved.items():
            expected = state if per_expert_rank else saved0[stream]
            assert torch.equal(resumed[stream], expected), stream
