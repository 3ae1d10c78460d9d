"""Layout strings, world-size checks, the rank layout against megatron-core's real process groups,
stage contents, and megaloop-train --dry-run."""

import pytest

from megaloop.config import ConfigError, ModelConfig, ParallelConfig
from megaloop.scale.layout import (Layout, check_world_size, layout_of, parse_layout,
                                   rank_groups, stage_layout)
from tests.distributed import run_distributed


@pytest.mark.parametrize("text, layout", [
    ("single", Layout()),
    ("", Layout()),
    ("dp2", Layout(data=2)),
    ("sp,tp2", Layout(tensor=2, sequence_parallel=True)),
    ("tp2,pp2,dp2,recompute", Layout(tensor=2, pipeline=2, data=2, recompute="full")),
    ("dp2,selrecompute", Layout(data=2, recompute="selective")),
    ("pp2,vp2", Layout(pipeline=2, virtual=2)),
    ("ep2", Layout(data=2, expert=2)),  # expert ranks come out of the data-parallel ones
    ("tp2,ep2,dp4", Layout(tensor=2, data=4, expert=2)),
])
def test_parse_layout(text, layout):
    assert parse_layout(text) == layout
    assert parse_layout(layout.name) == layout


@pytest.mark.parametrize("text, message", [
    ("tp2,xp2", "layout 'tp2,xp2': unknown part 'xp2' (known: tpN, ppN, vpN, dpN, epN, sp, "
                "recompute, selrecompute"),
    ("recompute,selrecompute", "layout 'recompute,selrecompute': recompute and selrecompute "
                               "together (one recomputation"),
    ("tp0", "layout 'tp0': unknown part 'tp0'"),
    # Before: the last size won without a word (a comparison run at tp4 for "tp2,tp4").
    ("tp2,pp2,tp4", "layout 'tp2,pp2,tp4': 'tp' given twice (one size per dimension)"),
    ("sp,tp2,sp", "layout 'sp,tp2,sp': 'sp' given twice"),
    ("ep2,dp3", "layout 'ep2,dp3': ep2 needs a data-parallel size that is a multiple of 2 "
                "(got dp3; e.g. dp4)"),
])
def test_bad_layout_strings_are_one_line(text, message):
    with pytest.raises(ConfigError) as err:
        parse_layout(text)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("parallel, world, message", [
    (ParallelConfig(tensor=4, pipeline=2), 12,
     "parallel.tensor=4 x parallel.pipeline=2 = 8 does not divide the world size 12: launch a "
     "multiple of 8 processes (e.g. 8 or 16) or choose tensor x pipeline among the divisors of "
     "12 (1, 2, 3, 4, 6, 12)"),
    (ParallelConfig(tensor=4), 2, "launch a multiple of 4 processes (e.g. 4)"),
    (ParallelConfig(tensor=2, expert=4), 12,
     "parallel.expert=4 does not divide the data-parallel size 6 (world size 12 / tensor 2 / "
     "pipeline 1): expert parallelism splits the data-parallel ranks; use expert in (1, 2, 3, 6)"),
])
def test_a_layout_that_does_not_fit_the_world_says_what_would(parallel, world, message):
    with pytest.raises(ConfigError) as err:
        check_world_size(parallel, world)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert layout_of(ParallelConfig(tensor=2), 8) == Layout(tensor=2, data=4)


def test_a_selective_layout_keeps_the_configs_recompute_modules():
    from megaloop.config import RunConfig

    cfg = RunConfig(parallel=ParallelConfig(recompute="selective", recompute_modules=["mlp"]))
    assert layout_of(cfg.parallel, 2) == Layout(data=2, recompute="selective")
    assert parse_layout("selrecompute").apply(cfg).parallel.recompute_modules == ["mlp"]
    assert parse_layout("recompute").apply(cfg).parallel.recompute_modules == []


def test_a_layout_keeps_the_configs_other_parallel_settings():
    """Before: a layout's parallel section was a fresh one, so the data-parallel overlap, its
    bucket size and the collective timeout of the config were dropped without a word (the run
    under the layout, loss_compare's and the dry run's layout search, was another run)."""
    from megaloop.config import RunConfig

    cfg = RunConfig(parallel=ParallelConfig(overlap_grad_reduce=True, ddp_bucket_size=10**6,
                                            distributed_timeout_minutes=90, tensor=2))
    parallel = parse_layout("dp2,recompute").apply(cfg).parallel
    assert (parallel.overlap_grad_reduce, parallel.ddp_bucket_size,
            parallel.distributed_timeout_minutes) == (True, 10**6, 90)
    assert (parallel.tensor, parallel.recompute) == (1, "full")


def test_stage_layouts_name_what_each_stage_holds():
    asym = ModelConfig(arch="asymloop", num_layers=8, iterations=3)
    assert [s.describe() for s in stage_layout(asym, ParallelConfig())] == [
        "embedding, encoder layers 1-4, Global KV of 4 layers, decoder layers 1-4 "
        "(iterations 1-3), final norm + head"]
    split = ParallelConfig(pipeline=2, pipeline_split=[4, 12])  # where the loop starts
    assert [s.describe() for s in stage_layout(asym, split)] == [
        "embedding, encoder layers 1-4",
        "Global KV of 4 layers, decoder layers 1-4 (iterations 1-3), final norm + head"]
    unrolled = ParallelConfig(pipeline=4, pipeline_split=[5, 4, 4, 3])
    assert [s.describe() for s in stage_layout(asym, unrolled)] == [
        "embedding, encoder layers 1-4, Global KV of 1 layer, decoder layer 1 (iteration 1)",
        "Global KV of 4 layers, decoder layers 2-4 (iteration 1), decoder layer 1 (iteration 2)",
        "Global KV of 4 layers, decoder layers 2-4 (iteration 2), decoder layer 1 (iteration 3)",
        "Global KV of 3 layers, decoder layers 2-4 (iteration 3), final norm + head"]
    # Balanced: a small vocabulary makes the head cheap next to a layer.
    dense = ModelConfig(arch="dense", num_layers=8, iterations=1, vocab_size=256)
    assert [s.describe() for s in stage_layout(dense, ParallelConfig(pipeline=4))] == [
        "embedding, decoder layers 1-2", "decoder layers 3-4", "decoder layers 5-6",
        "decoder layers 7-8, final norm + head"]
    full = ModelConfig(arch="fullloop", num_layers=4, iterations=3)
    assert [s.describe() for s in stage_layout(full, ParallelConfig(
        pipeline=3, pipeline_split=[4, 5, 3]))] == [
        "embedding, decoder layers 1-4 (iteration 1)",
        "decoder layers 1-4 (iteration 2), decoder layer 1 (iteration 3)",
        "decoder layers 2-4 (iteration 3), final norm + head"]


def _real_groups(rank, world_size, layout):
    """This rank's groups as megatron-core's initialize_model_parallel builds them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megaloop.platform.distributed import init_distributed

    parsed = parse_layout(layout)
    init_distributed(parsed.tensor, parsed.pipeline, parsed.expert)
    return {kind: dist.get_process_group_ranks(group()) for kind, group in (
        ("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
        ("dp", ps.get_data_parallel_group), ("ep", ps.get_expert_model_parallel_group))}


@pytest.mark.parametrize("layout", ["tp2,pp2", "tp2,ep2,dp2", "pp2,ep2,dp2"])
def test_rank_layout_matches_megatron_cores_process_groups(layout):
    computed = rank_groups(parse_layout(layout))
    real = run_distributed(_real_groups, world_size=4, layout=layout)
    for rank, groups in enumerate(real):
        for kind, ranks in groups.items():
            [mine] = [g for g in computed[kind] if rank in g]
            assert mine == ranks, (layout, rank, kind)


def _dry_run(capsys, *args):
    from megaloop.train import main

    code = main(["--dry-run", *args, "data.path=[/data/x]", "data.eod_id=0"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_prints_config_rank_layout_and_memory(capsys):
    code, out, _ = _dry_run(capsys, "--world-size", "16", "--preset", "350M",
                            "parallel.tensor=2", "parallel.pipeline=2",
                            "parallel.sequence_parallel=true", "train.global_batch_size=64")
    assert code == 0
    assert "# resolved config" in out and "  hidden_size: 1024" in out
    assert ("16 ranks = tensor 2 x pipeline 2 x data 4 (expert 1 within data); sequence "
            "parallel on, recompute none; 4 micro-batches of 4") in out
    assert ("pipeline split [26, 22] (balanced by the layout chooser): slowest stage 1.04 x ideal, "
            "bubble 23% at 4 micro-batches per step\nstage 0 (pipeline rank 0, 1.04 x ideal): "
            "embedding, encoder layers 1-12, Global KV of 12 layers, decoder layers 1-12 "
            "(iteration 1), decoder layers 1-2 (iteration 2)\n") in out
    # megatron-core's order: tensor ranks adjacent, then data, then pipeline stages.
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows["5"] == ["5", "0", "5", "1/2", "0", "2/4", "0/1"]
    assert rows["9"] == ["9", "1", "1", "1/2", "1", "0/4", "0/1"]
    assert "# memory per GPU (busiest stage 0; GiB)" in out and "-> fits" in out


def test_dry_run_refuses_a_layout_the_world_cannot_hold(capsys):
    code, out, err = _dry_run(capsys, "--world-size", "6", "parallel.tensor=4")
    assert code == 2 and out == ""
    assert err.startswith("error: parallel.tensor=4 x parallel.pipeline=1 = 4 does not divide "
                          "the world size 6") and err.count("\n") == 1
