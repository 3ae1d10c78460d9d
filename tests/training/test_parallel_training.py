"""Parallel layouts change nothing: DP=2, TP=2, PP=2 (Dense, and AsymLoop split at its encoder)
and EP=2 (MoE; dense weights data-parallel with the distributed optimizer) train to the same losses
as one process (megaloop.scale.loss_compare's rules), and TP=2 / EP=2 checkpoints load into one
process with the same logits."""

from pathlib import Path

import pytest
import torch

from megaloop.scale.loss_compare import compare_curves
from tests.distributed import run_distributed
from tests.scale.layouts import layout_curves
from tests.training.conftest import tiny_run, write_pattern_dataset

STEPS = 10
MOE = {"num_experts": 4, "moe_top_k": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("pdata") / "pattern")


@pytest.mark.parametrize("model, layouts", [
    ({}, ["dp2", "pp2", "tp2"]),  # AsymLoop; pp2: encoder | Global KV + decoder loop + head
    ({"arch": "dense", "iterations": 1}, ["pp2"]),
    # MoE: each EP rank holds half the experts; dense weights data-parallel with the distributed
    # optimizer.
    (MOE, ["ep2", "dp2"]),
    ({"arch": "latentloop", "iterations": 2, **MOE}, ["ep2"]),
    # each EP rank's half of the experts, narrowed to half their hidden units in visit 1
    ({"arch": "latentloop", "iterations": 2, **MOE, "latent_reduction": "expert_ffn"}, ["ep2"]),
])
def test_parallel_layouts_match_single_process(mcore, data, tmp_path, model, layouts):
    # Every layout starts from one seed checkpoint (torchtitan's practice): initialisation draws
    # differ between layouts, since each pipeline stage and TP rank seeds its own part.
    cfg = tiny_run(data, tmp_path / "unused", model=model,
                   train={"train_steps": STEPS, "global_batch_size": 8})
    assert compare_curves(layout_curves(cfg, ["single", *layouts], tmp_path, STEPS)) == []


def test_moe_with_tensor_and_sequence_parallelism_matches_single_process(mcore, data, tmp_path):
    # megatron-core's MoE layer needs sequence parallelism with tensor parallelism. Both auxiliary
    # losses are on: under SP each rank routes half the tokens, and their gradients' scale is what
    # this catches (megaloop.models.moe.LoopedRouter).
    cfg = tiny_run(data, tmp_path / "unused", model=MOE,
                   train={"train_steps": STEPS, "global_batch_size": 8})
    assert compare_curves(layout_curves(cfg, ["single", "tp2,sp"], tmp_path, STEPS)) == []


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
