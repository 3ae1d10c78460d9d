"""Parallel layouts change nothing: DP=2, TP=2, PP=2 (Dense, and AsymLoop split at its encoder) and
EP=2 (MoE; dense weights data-parallel with the distributed optimizer) train to the same losses as
one process, and TP=2 / EP=2 checkpoints load into one process with the same logits."""

from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.conftest import tiny_run, train_losses, write_pattern_dataset

STEPS = 10
MOE = {"num_experts": 4, "moe_top_k": 2}


def _train(rank, world_size, data_prefix, out_dir, seed_checkpoint, model=None, parallel=None):
    from megaloop.training.trainer import Trainer

    out = Path(out_dir)
    cfg = tiny_run(data_prefix, out, model=model, parallel=parallel,
                   train={"train_steps": STEPS, "global_batch_size": 8},
                   checkpoint={"load": seed_checkpoint, "load_optimizer": False})
    Trainer(cfg).train()
    return train_losses(out) if rank == 0 else None


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("pdata") / "pattern")


@pytest.mark.parametrize("name, model, parallel", [
    ("dp2_asymloop", {}, {}),
    ("pp2_dense", {"arch": "dense", "iterations": 1}, {"pipeline": 2}),
    ("pp2_asymloop", {}, {"pipeline": 2}),  # encoder | Global KV + decoder loop + head
    ("tp2_asymloop", {}, {"tensor": 2}),
    ("ep2_moe_asymloop", MOE, {"expert": 2}),  # each rank holds half the experts
    ("dp2_moe_asymloop", MOE, {}),
    ("ep2_latentloop", {"arch": "latentloop", "iterations": 2, **MOE}, {"expert": 2}),
])
def test_parallel_layout_matches_single_process(mcore, data, tmp_path, name, model, parallel):
    from megaloop.training.trainer import Trainer

    # A seed checkpoint (torchtitan's practice): initialisation draws differ between layouts
    # (each pipeline stage seeds its own layers), so every run starts from the same saved weights.
    seed = tmp_path / "seed"
    Trainer(tiny_run(data, seed, model=model)).save()
    seed_checkpoint = str(seed / "checkpoints")
    _train(0, 1, data, tmp_path / "single", seed_checkpoint, model=model)
    expected = train_losses(tmp_path / "single")
    losses = run_distributed(_train, world_size=2, data_prefix=data, out_dir=str(tmp_path / name),
                             seed_checkpoint=seed_checkpoint, model=model, parallel=parallel)[0]
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=2e-5, abs=2e-5), step


def _parallel_then_single_logits(rank, world_size, data_prefix, out_dir, model, parallel):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megaloop.training.trainer import Trainer

    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    out = Path(out_dir)
    split = Trainer(tiny_run(data_prefix, out, model=model, parallel=parallel,
                             train={"train_steps": 3}))
    split.train()
    split.model.eval()
    with torch.no_grad():
        logits_split = gather_from_tensor_model_parallel_region(split.model(tokens))
    single = Trainer(tiny_run(data_prefix, out / "single", model=model, train={"train_steps": 3},
                              checkpoint={"load": str(out / "checkpoints"),
                                          "load_optimizer": False}))
    single.model.eval()
    with torch.no_grad():
        logits_single = single.model(tokens)
    return (logits_single - logits_split).abs().max().item()


@pytest.mark.parametrize("model, parallel", [({}, {"tensor": 2}), (MOE, {"expert": 2})],
                         ids=["tp2", "ep2_moe"])
def test_split_checkpoint_loads_into_one_process_with_the_same_logits(mcore, data, tmp_path,
                                                                      model, parallel):
    diffs = run_distributed(_parallel_then_single_logits, world_size=2, data_prefix=data,
                            out_dir=str(tmp_path), model=model, parallel=parallel)
    assert max(diffs) < 1e-5
