"""The gradient the optimizer receives is the gradient of the reported loss: the token-weighted mean
over the global batch's unmasked tokens, whatever the micro-batch split, and masked positions
contribute exactly nothing to it."""

import pytest
import torch

from megaloop.training.data import MicroBatches
from megaloop.training.trainer import Trainer
from tests.training.conftest import tiny_run

GLOBAL_BATCH = 4


def _trainer(data, out, micro_batch_size):
    # EOD positions masked: micro-batches then hold different numbers of counted tokens, so a
    # mean of per-micro-batch means would differ from the token-weighted mean.
    cfg = tiny_run(data, out, train={"micro_batch_size": micro_batch_size,
                                     "global_batch_size": GLOBAL_BATCH, "train_steps": 1})
    cfg.data.eod_mask_loss = True
    return Trainer(cfg)


def _uneven_step(dataset) -> int:
    """A step whose two halves (the micro-batches of size 2) count different numbers of unmasked
    tokens: there a mean of micro-batch means is not the token-weighted mean."""
    for step in range(50):
        counts = [sum(int(dataset[i]["loss_mask"].sum()) for i in range(start, start + 2))
                  for start in (step * GLOBAL_BATCH, step * GLOBAL_BATCH + 2)]
        if counts[0] != counts[1]:
            return step
    raise AssertionError("no step with uneven micro-batches in the test data")


def _grads_at_the_optimizer(trainer, step):
    """(loss, main grads and the norm the optimizer clips by) of an optimizer step on the samples
    of ``step`` (0-based)."""
    seen = {}
    optimizer_step = trainer.optimizer.step

    def recording_step():
        seen["grads"] = {n: p.main_grad.detach().clone() for n, p in
                         trainer.model.named_parameters()}
        result = optimizer_step()
        seen["norm"] = result[1]
        return result

    trainer.optimizer.step = recording_step
    trainer.step = 1
    outcome = trainer.train_step(MicroBatches(
        trainer.train_data, trainer.cfg.train.micro_batch_size, 0, 1, step * GLOBAL_BATCH,
        GLOBAL_BATCH))
    assert not outcome.skipped and outcome.grad_norm == seen["norm"]
    return outcome.loss, seen["grads"], outcome.grad_norm


def _reference_grads(trainer, step):
    """Plain autograd of the masked token mean over the same 4 samples, in one forward pass
    outside megatron-core's schedule (DDP's hooks only accumulate into main_grad)."""
    samples = [trainer.train_data[i] for i in range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)]
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
             for k in ("tokens", "labels", "loss_mask", "position_ids")}
    trainer.ddp.zero_grad_buffer()
    losses = trainer.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    assert 0 < mask.sum() < mask.numel(), "the test needs masked positions"
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.main_grad.detach().clone() for n, p in
                         trainer.model.named_parameters()}


def test_accumulated_gradients_equal_one_batch_of_the_same_samples(mcore, pattern_data,
                                                                   tmp_path):
    accumulated = _trainer(pattern_data, tmp_path / "two", micro_batch_size=2)
    whole = _trainer(pattern_data, tmp_path / "one", micro_batch_size=4)
    assert (accumulated.num_microbatches, whole.num_microbatches) == (2, 1)
    for (name, a), b in zip(accumulated.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(a, b), f"{name}: the two runs must start from the same weights"

    step = _uneven_step(whole.train_data)
    loss_ref, grads_ref = _reference_grads(whole, step)  # before any weight moves
    loss_two, grads_two, norm_two = _grads_at_the_optimizer(accumulated, step)
    loss_one, grads_one, norm_one = _grads_at_the_optimizer(whole, step)
    assert loss_two == pytest.approx(loss_ref, rel=1e-6)
    assert loss_one == pytest.approx(loss_ref, rel=1e-6)
    for name, ref in grads_ref.items():
        scale = ref.abs().max().item() + 1e-12
        for grads in (grads_two, grads_one):
            assert (grads[name] - ref).abs().max().item() <= 1e-5 * scale, name
    true_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads_ref.values())).item()
    # Clipping (clip_grad=1.0) is decided on this norm: it must be the true one.
    assert norm_two == pytest.approx(true_norm, rel=1e-5)
    assert norm_one == pytest.approx(true_norm, rel=1e-5)
    accumulated.close()
    whole.close()


def _loss_and_grads(trainer, batches):
    trainer.ddp.zero_grad_buffer()
    loss, _ = trainer._run_microbatches(iter(batches), forward_only=False)
    return loss, {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()}


def test_masked_positions_contribute_exactly_nothing(mcore, pattern_data, tmp_path):
    trainer = _trainer(pattern_data, tmp_path, micro_batch_size=2)
    data = MicroBatches(trainer.train_data, 2, 0, 1, 0, GLOBAL_BATCH)
    batches = [next(data) for _ in range(trainer.num_microbatches)]
    for batch in batches:  # mask a block of ordinary positions too, not only EODs
        batch["loss_mask"][:, 5:12] = 0
    loss, grads = _loss_and_grads(trainer, batches)

    generator = torch.Generator().manual_seed(0)
    relabelled = []
    for batch in batches:  # different targets wherever the mask is 0
        other = dict(batch)
        masked = batch["loss_mask"] == 0
        noise = torch.randint(1, 120, batch["labels"].shape, generator=generator)
        other["labels"] = torch.where(masked, (batch["labels"] + noise) % 128, batch["labels"])
        assert not torch.equal(other["labels"], batch["labels"])
        relabelled.append(other)
    loss_relabelled, grads_relabelled = _loss_and_grads(trainer, relabelled)
    assert loss_relabelled == loss
    for name, g in grads.items():
        assert torch.equal(g, grads_relabelled[name]), name
    trainer.close()
