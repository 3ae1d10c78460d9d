"""MoE models in the training system: expert parallelism changes nothing (EP=2 trains to the EP=1
losses, also with data parallelism and the distributed optimizer), checkpoints reshard between EP
layouts, resume is exact, and routing metrics are logged per iteration without ever entering the
reported losses."""

import shutil
from pathlib import Path

import pytest
import torch

from megaloop.training.monitor import read_metrics
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run, train_losses, write_pattern_dataset

MOE = {"num_experts": 4, "moe_top_k": 2}
STEPS = 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("moedata") / "pattern")


@pytest.fixture(scope="module")
def single_process(mcore, data, tmp_path_factory):
    """A seed checkpoint and the losses one process trains from it (EP=1, DP=1)."""
    from megaloop.training.trainer import Trainer

    root = tmp_path_factory.mktemp("moe_single")
    Trainer(tiny_run(data, root / "seed", model=MOE)).save()
    seed_checkpoint = str(root / "seed" / "checkpoints")
    _train(0, 1, data, root / "run", seed_checkpoint)
    return seed_checkpoint, train_losses(root / "run")


def _train(rank, world_size, data_prefix, out_dir, seed_checkpoint, parallel=None, steps=STEPS):
    from megaloop.training.trainer import Trainer

    out = Path(out_dir)
    cfg = tiny_run(data_prefix, out, model=MOE, parallel=parallel,
                   train={"train_steps": steps, "global_batch_size": 8},
                   checkpoint={"load": seed_checkpoint, "load_optimizer": False})
    Trainer(cfg).train()
    return train_losses(out) if rank == 0 else None


@pytest.mark.parametrize("parallel", [{"expert": 2}, {"expert": 1}], ids=["ep2_dp2", "ep1_dp2"])
def test_expert_parallel_layouts_train_to_the_single_process_losses(data, single_process,
                                                                   tmp_path, parallel):
    """EP=2 on two ranks (each holds half the experts; the dense weights are data-parallel with
    the distributed optimizer) and EP=1 with DP=2 give the one-process losses."""
    seed_checkpoint, expected = single_process
    losses = run_distributed(_train, world_size=2, data_prefix=data, out_dir=str(tmp_path),
                             seed_checkpoint=seed_checkpoint, parallel=parallel)[0]
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=2e-5, abs=2e-5), step


def _ep2_then_ep1_logits(rank, world_size, data_prefix, out_dir):
    from megaloop.training.trainer import Trainer

    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    out = Path(out_dir)
    ep2 = Trainer(tiny_run(data_prefix, out, model=MOE, parallel={"expert": 2},
                           train={"train_steps": 3}))
    ep2.train()
    local = ep2.model.decoder.layers[0].mlp.experts.local_experts
    assert len(local) == 2, "each EP rank holds half of the experts"
    ep2.model.eval()
    with torch.no_grad():
        logits_ep2 = ep2.model(tokens)
    ep1 = Trainer(tiny_run(data_prefix, out / "ep1", model=MOE, train={"train_steps": 3},
                           checkpoint={"load": str(out / "checkpoints"), "load_optimizer": False}))
    ep1.model.eval()
    with torch.no_grad():
        logits_ep1 = ep1.model(tokens)
    return (logits_ep1 - logits_ep2).abs().max().item()


def test_ep2_checkpoint_loads_into_ep1_with_the_same_logits(mcore, data, tmp_path):
    diffs = run_distributed(_ep2_then_ep1_logits, world_size=2, data_prefix=data,
                            out_dir=str(tmp_path))
    assert max(diffs) < 1e-5


def test_moe_resume_reproduces_the_uninterrupted_losses_bit_for_bit(mcore, data, tmp_path):
    from megaloop.training.trainer import Trainer

    straight = tmp_path / "straight"
    Trainer(tiny_run(data, straight, model=MOE, checkpoint={"save_interval": 4})).train()
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "iter_0000004",
                    resumed / "checkpoints" / "iter_0000004")
    (resumed / "checkpoints" / "latest").write_text("iter_0000004\n")
    Trainer(tiny_run(data, resumed, model=MOE)).train()
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
    Trainer(tiny_run(data, seed, model=MOE)).save()
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
