"""Parallel layouts change nothing: DP=2, TP=2, PP=2 and PP=4 (Dense, Full Loop and AsymLoop, the
loop unrolled over the stages; Dense also interleaved) and EP=2 (MoE; dense weights data-parallel
with the distributed optimizer) train to the same losses as one process (megaloop.scale.
loss_compare's rules); TP=2 / EP=2 checkpoints load into one process with the same logits, and a
DP=2 x PP=2 checkpoint into one process and into PP=4, its tied decoder copies equal after
training."""

from pathlib import Path

import pytest
import torch

from megaloop.scale.loss_compare import compare_curves
from megaloop.training.monitor import read_metrics
from tests.distributed import run_distributed
from tests.scale.layouts import layout_curves
from tests.training.conftest import tiny_run, write_pattern_dataset

STEPS = 10
MOE = {"num_experts": 4, "moe_top_k": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pattern_dataset(tmp_path_factory.mktemp("pdata") / "pattern")


DENSE = {"arch": "dense", "iterations": 1}


@pytest.mark.parametrize("model, layouts", [
    # AsymLoop (E 2, K 2 x D 2): pp2 [3, 3] and pp4 [2, 1, 2, 1] cut iterations, tied copies.
    ({}, ["dp2", "pp2", "tp2", "pp4"]),
    # pp2,vp2: each rank holds two tied copies of two decoder layers (chunks 0 and 2, 1 and 3)
    ({"arch": "fullloop", "iterations": 2}, ["pp2", "pp4", "pp2,vp2"]),
    (DENSE, ["pp2", "pp4", "pp2,vp2"]),
    # MoE: each EP rank holds half the experts; dense weights data-parallel with the distributed
    # optimizer.
    (MOE, ["ep2", "dp2", "pp2"]),
    ({"arch": "latentloop", "iterations": 2, **MOE}, ["ep2"]),
    # each EP rank's half of the experts, narrowed to half their hidden units in visit 1
    ({"arch": "latentloop", "iterations": 2, **MOE, "latent_reduction": "expert_ffn"}, ["ep2"]),
])
def test_parallel_layouts_match_single_process(mcore, data, tmp_path, model, layouts):
    # Every layout starts from one seed checkpoint (torchtitan's practice): initialisation draws
    # differ between layouts, since each pipeline stage and TP rank seeds its own part.
    cfg = tiny_run(data, tmp_path / "unused", model=model,
                   train={"train_steps": STEPS, "global_batch_size": 8})
    curves = layout_curves(cfg, ["single", *layouts], tmp_path, STEPS)
    assert compare_curves(curves) == []
    if model is DENSE:  # no tied copies: pipelines change no bit
        assert all(curves[layout] == curves["single"] for layout in layouts)


def test_moe_with_tensor_and_sequence_parallelism_matches_single_process(mcore, data, tmp_path):
    # megatron-core's MoE layer needs sequence parallelism with tensor parallelism. Both auxiliary
    # losses are on: under SP each rank routes half the tokens, and their gradients' scale is what
    # this catches (megaloop.models.moe.LoopedRouter). The routing metrics logged are those of
    # one process too (step 1: the same weights route alike), not each rank's half of them.
    cfg = tiny_run(data, tmp_path / "unused", model=MOE,
                   train={"train_steps": STEPS, "global_batch_size": 8})
    assert compare_curves(layout_curves(cfg, ["single", "tp2,sp"], tmp_path, STEPS)) == []
    single, split = ({k: v for r in read_metrics(tmp_path / run / "metrics.jsonl")[0]
                      if r["kind"] == "train" and r["step"] == 1
                      for k, v in r.items() if k.startswith("moe_")} for run in ("single", "tp2_sp"))
    assert single and split == pytest.approx(single, rel=1e-5)


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
    # Closed: left open, its stop-signal handlers stayed in this worker for every later test's call.
    with Trainer(tiny_run(data_prefix, out / "single", model=model, train={"train_steps": 3},
                          checkpoint={"load": str(out / "checkpoints"),
                                      "load_optimizer": False})) as single, torch.no_grad():
        single.model.eval()
        logits_single = single.model(tokens)
    return (logits_single - logits_split).abs().max().item()


@pytest.mark.parametrize("model, parallel", [({}, {"tensor": 2}), (MOE, {"expert": 2})],
                         ids=["tp2", "ep2_moe"])
def test_split_checkpoint_loads_into_one_process_with_the_same_logits(mcore, data, tmp_path,
                                                                      model, parallel):
    diffs = run_distributed(_parallel_then_single_logits, world_size=2, data_prefix=data,
                            out_dir=str(tmp_path), model=model, parallel=parallel)
    assert max(diffs) < 1e-5


def _pipeline_logits(trainer, tokens):
    """Logits of ``tokens`` through the pipeline (forward only): on the last stage, else None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data_iterator, model):
        return model(next(data_iterator)), None  # no loss function: the schedule keeps outputs

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([tokens]), model=trainer.ddps,
            num_microbatches=1, micro_batch_size=tokens.shape[0], forward_only=True,
            **trainer.schedule_shapes())
    return outputs[0] if outputs else None


def _train_then_copies(rank, world_size, data_prefix, out_dir, parallel):
    """Trains 3 steps; returns this rank's parameters by layout-independent name."""
    from megaloop.alrs import experts
    from megaloop.training.trainer import Trainer

    trainer = Trainer(tiny_run(data_prefix, Path(out_dir), parallel=parallel,
                               train={"train_steps": 3, "global_batch_size": 8}))
    trainer.train()
    return {name: param.detach().clone() for model in trainer.models
            for name, param in experts.named_parameters(model)}


def _load_then_logits(rank, world_size, data_prefix, out_dir, parallel, checkpoint, tokens):
    from megaloop.training.trainer import Trainer

    trainer = Trainer(tiny_run(data_prefix, Path(out_dir), parallel=parallel,
                               checkpoint={"load": checkpoint, "load_optimizer": False}))
    logits = _pipeline_logits(trainer, tokens)
    trainer.close()
    return logits


def test_pipeline_checkpoints_reshard_and_tied_copies_stay_equal(mcore, data, tmp_path):
    # DP=2 x PP=2 with the distributed optimizer: decoder layer 1 runs on both stages.
    copies = run_distributed(_train_then_copies, world_size=4, data_prefix=data,
                             out_dir=str(tmp_path / "dp2pp2"), parallel={"pipeline": 2})
    held = [name for name in copies[0] if name in copies[1]]
    assert any(".layers.0." in name for name in held)  # a tied decoder layer, on both stages
    for name in held:
        assert all(torch.equal(c[name], copies[0][name]) for c in copies if name in c), name
    saved = str(tmp_path / "dp2pp2" / "checkpoints")
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    single = _load_then_logits(0, 1, data, str(tmp_path / "single"), {}, saved, tokens)
    pp4 = run_distributed(_load_then_logits, world_size=4, data_prefix=data,
                          out_dir=str(tmp_path / "pp4"), parallel={"pipeline": 4},
                          checkpoint=saved, tokens=tokens)
    assert torch.equal(pp4[-1], single) and all(logits is None for logits in pp4[:-1])


def _build(rank, world_size, data_prefix, out_dir, parallel, train):
    from megaloop.config import ConfigError
    from megaloop.training.trainer import Trainer

    try:
        Trainer(tiny_run(data_prefix, Path(out_dir), parallel=parallel, train=train)).close()
    except ConfigError as e:
        return str(e)
    return None


def test_the_interleaved_schedule_needs_whole_groups_of_micro_batches(data, tmp_path):
    # 2 pipeline ranks: a multiple of 2 micro-batches per step; 6 sequences of 2 make 3.
    errors = run_distributed(_build, world_size=2, data_prefix=data, out_dir=str(tmp_path),
                             parallel={"pipeline": 2, "virtual_pipeline": 2},
                             train={"global_batch_size": 6})
    assert errors == [
        "train.global_batch_size=6: the interleaved schedule (parallel.virtual_pipeline=2) runs "
        "micro-batches in groups of parallel.pipeline=2, but a step has 3 per data-parallel rank; "
        "use a multiple of 4"] * 2
