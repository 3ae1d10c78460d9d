"""Per-block learning rates are exact: a few training steps of megaloop's fused megatron-core model,
with a different LR multiplier on every block (Q, K, V, Global K, Global V, gate, up, O, down,
embedding, head), equal the same steps of the unfused plain-PyTorch model whose AdamW parameter
groups carry those multipliers (weight decay and gradient clipping active), to fp32 tolerance: in
one process, under TP=2, and under the distributed optimizer over DP=2, whose shards start and end
inside blocks."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.alrs.unfused import reference_model, reference_name
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run

STEPS, CLIP, WEIGHT_DECAY, GLOBAL_BATCH, MICRO_BATCH = 3, 0.3, 0.1, 4, 2
# 6 layers of width 40: with DP=2 the shard boundary falls inside the last row of a Q block of
# decoder.layers.0's linear_qkv (checked by the test; most sizes put it on a parameter boundary).
# Its head dim of 10 is below the CUDA flash kernel's multiple of 8, hence the masked kernel.
MODEL = {"num_layers": 6, "hidden_size": 40, "joint_attention": "masked"}


def _batches(tokens, dp_rank, dp_size):
    """This data-parallel rank's micro-batches of one global batch, as the trainer reads them."""
    mine = [tokens[(m * dp_size + dp_rank) * MICRO_BATCH:][:MICRO_BATCH]
            for m in range(GLOBAL_BATCH // (MICRO_BATCH * dp_size))]
    return iter([{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(t[:, 1:].shape),
                  "position_ids": torch.arange(t.shape[1] - 1).expand(t.shape[0], -1)}
                 for t in mine])


def _shards_cut_blocks(trainer) -> bool:
    """Whether a distributed-optimizer shard of a fused weight starts or ends inside a block and
    inside a row (so every path of the update scaling runs: partial row, whole rows)."""
    for target in trainer.lr_multipliers.scaling.targets:
        numel = target.row_block.numel() * target.cols
        for boundary in (target.start, target.start + target.main.numel()):
            if 0 < boundary < numel and boundary % target.cols and \
                    target.row_block[(boundary - 1) // target.cols] == \
                    target.row_block[boundary // target.cols]:
                return True
    return False


def _parity(rank, world_size, data_prefix, out_dir, parallel=None, distributed_optimizer=False):
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(data_prefix, Path(out_dir), model=MODEL, parallel=parallel,
                   train={"train_steps": 10, "lr": 1e-2, "warmup_fraction": 0.0, "clip_grad": CLIP,
                          "weight_decay": WEIGHT_DECAY, "global_batch_size": GLOBAL_BATCH,
                          "micro_batch_size": MICRO_BATCH,
                          "distributed_optimizer": distributed_optimizer})
    trainer = Trainer(cfg)
    names = trainer.lr_multipliers.names
    multipliers = {name: 0.5 + (0.37 * i) % 2.5 for i, name in enumerate(names)}
    trainer.lr_multipliers.set(multipliers)

    reference = reference_model(trainer.model)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    by_reference_name = {reference_name(n): m for n, m in multipliers.items()}
    groups = [{"params": [p], "multiplier": by_reference_name.get(n, 1.0),
               "weight_decay": WEIGHT_DECAY if p.ndim == 2 else 0.0}
              for n, p in reference.named_parameters()]
    adamw = torch.optim.AdamW(groups, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2), eps=1e-8)
    tokens = torch.randint(1, 121, (GLOBAL_BATCH, cfg.model.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    differences, grad_norms = [], []
    for step in range(1, STEPS + 1):
        base_lr = trainer.current_lr()
        trainer.step = step
        outcome = trainer.train_step(_batches(tokens, trainer.dp_rank, trainer.dp_size))
        assert not outcome.skipped
        grad_norms.append(outcome.grad_norm)

        logits = reference(tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        for group in adamw.param_groups:
            group["lr"] = base_lr * group["multiplier"]
        adamw.step()
        adamw.zero_grad()

        actual = reference_model(trainer.model).state_dict()
        differences.append(max(_relative_update_error(actual[n] - initial[n], p.detach() - initial[n])
                               for n, p in reference.named_parameters()))
    cut = distributed_optimizer and _shards_cut_blocks(trainer)
    trainer.close()
    return differences, grad_norms, cut


def _relative_update_error(update, expected):
    """|update - expected| / |expected| over one matrix, the update being W_t - W_0.

    Element-wise comparison would not do: Adam divides by sqrt(v), so an element whose gradient
    is near zero turns the two models' 1e-7 gradient rounding differences (other summation
    orders) into an update difference of up to lr, in a few elements per matrix (measured: a
    relative error of at most 2e-4 after 3 steps). A block stepped with another block's
    multiplier is off by more than 5% (neighbouring multipliers differ by at least 0.13 in 3).
    """
    return ((update - expected).norm() / expected.norm()).item()


def _check(differences, grad_norms):
    assert all(norm > CLIP for norm in grad_norms), "clipping must be active in every step"
    assert max(differences) < 1e-3, differences


def test_block_lrs_equal_unfused_param_groups(mcore, pattern_data, tmp_path):
    differences, grad_norms, _ = _parity(0, 1, pattern_data, str(tmp_path))
    _check(differences, grad_norms)


@pytest.mark.parametrize("parallel, distributed_optimizer", [
    ({"tensor": 2}, False),
    ({}, True),  # DP=2, optimizer state and updates sharded over the two ranks
])
def test_block_lrs_equal_unfused_param_groups_in_parallel(mcore, pattern_data, tmp_path, parallel,
                                                          distributed_optimizer):
    results = run_distributed(_parity, world_size=2, data_prefix=pattern_data,
                              out_dir=str(tmp_path), parallel=parallel,
                              distributed_optimizer=distributed_optimizer)
    for differences, grad_norms, _ in results:
        _check(differences, grad_norms)
    if distributed_optimizer:
        assert any(cut for _, _, cut in results), "no shard boundary inside a block: weak test"


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_bf16_main_params_are_paired_with_their_model_params(mcore, pattern_data, tmp_path,
                                                             distributed_optimizer):
    """With bf16 weights the optimizer steps fp32 main copies (megatron-core's Float16Optimizer, or
    the distributed optimizer's fp32 shards): the update scaling must find each fused weight's."""
    from megaloop.training.trainer import Trainer

    trainer = Trainer(tiny_run(pattern_data, tmp_path, model=MODEL, train={
        "precision": "bf16", "distributed_optimizer": distributed_optimizer}))
    trainer.close()
    targets = trainer.lr_multipliers.scaling.targets
    fused = {id(p) for n, p in trainer.model.named_parameters()
             if n.endswith(("linear_qkv.weight", "linear_fc1.weight", "linear_kv_global.weight"))}
    assert len(targets) == len(fused) == 3 * 6 // 2 + 6
    params = {id(p): p for p in trainer.model.parameters()}
    for target in targets:
        assert target.main.dtype == torch.float32
        model_param = next(params[i] for i in fused
                           if params[i].shape[0] == target.row_block.numel()
                           and torch.equal(params[i].float().view(-1)[
                               target.start:target.start + target.main.numel()],
                               target.main.view(-1)))
        assert model_param.dtype == torch.bfloat16


def expected_lr(step: int, total: int, schedule: str, peak=1e-2, floor=1e-3, warmup=2,
                decay=None, shape="linear") -> float:
    """The LR after ``step`` completed steps, written out from docs/training.md's description: linear
    warmup from 0, then cosine or linear decay to the floor at ``total``, or (wsd) the peak until
    the last ``decay`` steps and a ``shape`` decay over them."""
    if step <= warmup:
        return peak * step / warmup
    if schedule == "wsd":
        progress = max(0, step - (total - decay)) / decay
        coefficient = {"linear": 1 - progress, "minus_sqrt": 1 - math.sqrt(progress)}[shape]
    else:
        progress = (step - warmup) / (total - warmup)
        coefficient = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                       "linear": 1 - progress}[schedule]
    return floor + coefficient * (peak - floor)


@pytest.mark.parametrize("settings, decay", [
    ({"lr_schedule": "cosine"}, None),
    ({"lr_schedule": "linear"}, None),
    ({"lr_schedule": "wsd"}, 4),  # the default: the last 20% of 20 steps
    ({"lr_schedule": "wsd", "wsd_decay_fraction": 0.5, "wsd_decay_style": "minus_sqrt"}, 10),
])
def test_the_lr_follows_the_schedule_asked_for(mcore, pattern_data, tmp_path, settings, decay):
    from megaloop.training.trainer import Trainer

    with Trainer(tiny_run(pattern_data, tmp_path, train={
            "train_steps": 20, "warmup_fraction": 0.1, "lr": 1e-2, **settings})) as trainer:
        lrs = []
        for _ in range(21):
            lrs.append(trainer.current_lr())
            trainer.scheduler.step(1)
    expected = [expected_lr(s, 20, settings["lr_schedule"], decay=decay,
                            shape=settings.get("wsd_decay_style", "linear")) for s in range(21)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
