"""ALRS with MoE: every expert matrix is its own block named by its global expert index, and under
expert parallelism (EP=2: each rank holds half the experts) every rank gets the multipliers one
process computes for the same weights, for all experts."""

from pathlib import Path

import pytest

from megaloop.alrs import experts
from megaloop.alrs.blocks import WeightBlock
from tests.distributed import run_distributed
from tests.training.conftest import tiny_run, write_pattern_dataset

MOE = {"num_experts": 4, "moe_top_k": 2}


def test_every_expert_completes_a_ranks_blocks_in_one_order():
    def block(name):
        return WeightBlock(name, name.split(":")[0], (8, 4), None)

    rank1 = [block("a.weight"), block("l.mlp.experts.local_experts.2.linear_fc1.weight:gate"),
             block("l.mlp.experts.local_experts.2.linear_fc1.weight:up"),
             block("l.mlp.experts.local_experts.3.linear_fc1.weight:gate"),
             block("l.mlp.experts.local_experts.3.linear_fc1.weight:up"),
             block("l.mlp.experts.linear_fc2.weight3"), block("l.mlp.router.weight")]
    names = [b.name for b in experts.every_expert(rank1, 4)]
    assert names == (["a.weight"]
                     + [f"l.mlp.experts.local_experts.{e}.linear_fc1.weight:gate" for e in range(4)]
                     + [f"l.mlp.experts.local_experts.{e}.linear_fc1.weight:up" for e in range(4)]
                     + [f"l.mlp.experts.linear_fc2.weight{e}" for e in range(4)]
                     + ["l.mlp.router.weight"])
    assert [experts.expert_index(n) for n in names[1:5]] == [0, 1, 2, 3]


def _multipliers(rank, world_size, data_prefix, out_dir, seed_checkpoint, parallel):
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(data_prefix, Path(out_dir), model=MOE, parallel=parallel,
                   train={"train_steps": 2, "global_batch_size": 8, "use_alrs": True},
                   checkpoint={"load": seed_checkpoint, "load_optimizer": False})
    trainer = Trainer(cfg)
    trainer.train()
    held = {experts.expert_index(n) for n, _ in experts.named_parameters(trainer.model)} - {None}
    return dict(trainer.lr_multipliers.multipliers), sorted(held)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("alrs_moe") / "pattern")


def test_ep2_ranks_get_the_one_process_multipliers_for_every_expert(mcore, data, tmp_path):
    from megaloop.training.trainer import Trainer

    with Trainer(tiny_run(data, tmp_path / "seed", model=MOE)) as trainer:
        trainer.save()
    seed = str(tmp_path / "seed" / "checkpoints")
    expected, held = _multipliers(0, 1, data, tmp_path / "single", seed, {})
    assert held == [0, 1, 2, 3]
    expert_blocks = [n for n in expected if experts.expert_index(n) is not None]
    # gate, up and down of 4 experts in each of the 4 layers
    assert len(expert_blocks) == 3 * 4 * 4 and len(set(expected.values())) > 4
    results = run_distributed(_multipliers, world_size=2, data_prefix=data,
                              out_dir=str(tmp_path / "ep2"), seed_checkpoint=seed,
                              parallel={"expert": 2})
    assert [held for _, held in results] == [[0, 1], [2, 3]]
    for multipliers, _ in results:
        assert multipliers.keys() == expected.keys()
        for name, value in expected.items():
            assert multipliers[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
