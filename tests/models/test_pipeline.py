"""Pipeline stages (megaloop.models.pipeline): the plan of each stage, the balanced split against an
exhaustive search, and the stages of a model chained in one process against the whole model
(same logits; the tied copies' gradients sum to the whole model's)."""

import dataclasses
import itertools

import pytest
import torch

from megaloop.alrs import experts
from megaloop.config import ModelConfig, ParallelConfig
from megaloop.models.model import build_model
from megaloop.models.pipeline import (balance, balanced_split, chain_length, plan_stages,
                                      stage_costs, stage_counts)
from tests.models.variants import small_config


def test_a_stage_holds_each_layer_it_runs_once_and_knows_what_travels():
    model = ModelConfig(arch="asymloop", num_layers=4, iterations=3)  # E 2, D 2: 8 applications
    first, middle, last = plan_stages(model, [1, 4, 3])
    assert first.held("encoder") == (1,) and first.held("decoder") == ()
    assert (first.embedding, first.sends_encoding, first.global_kv) == (True, False, False)
    # Encoder layer 2, then iteration 1 and the first layer of iteration 2.
    assert middle.held("encoder") == (2,) and middle.held("decoder") == (1, 2)
    assert [(r.block, r.first, r.count, r.step) for r in middle.runs] == [
        ("encoder", 2, 1, 0), ("decoder", 1, 2, 1), ("decoder", 1, 1, 2)]
    assert not middle.receives_encoding and middle.sends_encoding and middle.global_kv
    assert last.receives_encoding and last.head and last.held("decoder") == (1, 2)
    # Without Global KV or additive injection the decoder never reads H_E again.
    plain = dataclasses.replace(model, injection="none")
    assert not any(s.sends_encoding for s in plan_stages(plain, [1, 4, 3]))


def test_a_latentloop_stage_names_its_prelude_visits_and_coda():
    """Before: "embedding, encoder layer 1, decoder layers 1-2 (iterations 1-2), final norm +
    head" in the dry run, AsymLoop's names and no coda."""
    model = ModelConfig(arch="latentloop", num_layers=5, iterations=2, coda_layers=2)
    (stage,) = plan_stages(model, [chain_length(model)])
    assert stage.describe() == ("embedding, prelude layer 1, middle layers 1-2 (visits 1-2), "
                                "coda layers 1-2, final norm + head")
    assert plan_stages(dataclasses.replace(model, arch="fullloop", coda_layers=None),
                       [10])[0].coda == 0


def _bottleneck(model, counts):
    return max(stage_costs(model).of(s) for s in plan_stages(model, counts))


@pytest.mark.parametrize("model, stages", [
    (ModelConfig(arch="asymloop", num_layers=4, iterations=3, vocab_size=4096), 3),
    (ModelConfig(arch="asymloop", num_layers=6, iterations=2, seq_length=1024), 4),
    (ModelConfig(arch="fullloop", num_layers=3, iterations=3), 2),
    (ModelConfig(arch="dense", num_layers=7, iterations=1, vocab_size=512), 3),
])
def test_the_balanced_split_has_the_smallest_slowest_stage(model, stages):
    total = chain_length(model)
    every = [[b - a for a, b in zip((0, *cuts), (*cuts, total))]
             for cuts in itertools.combinations(range(1, total), stages - 1)]
    best = min(_bottleneck(model, counts) for counts in every)
    chosen = balanced_split(model, stages)
    assert sum(chosen) == total and len(chosen) == stages
    assert _bottleneck(model, chosen) == best


def test_balance_reports_each_stage_against_the_ideal_and_the_bubble():
    dense = ModelConfig(arch="dense", num_layers=8, iterations=1, vocab_size=256)
    found = balance(dense, [2, 2, 2, 2], pipeline=4, micro_batches=4)
    assert found.relative[1] == found.relative[2] < found.relative[3]  # the head costs extra
    assert sum(found.relative) == pytest.approx(4)
    # 1F1B: (M + P - 1) slots of the slowest stage for M stages' worth of work.
    assert found.bubble == pytest.approx(1 - 4 / (7 * found.slowest))
    # The old AsymLoop split (encoder | loop) leaves the first stage mostly idle.
    asym = ModelConfig(arch="asymloop", num_layers=8, iterations=3, vocab_size=256)
    old, new = (balance(asym, split, 2, 8) for split in ([4, 12], balanced_split(asym, 2)))
    assert old.slowest > 1.4 and new.slowest < 1.1


def _chain(cfg, counts, tokens, recompute="none"):
    """The stages of ``counts`` built in this process with the whole model's weights (set by
    layout-independent names), run in order: logits and {name: summed gradient}."""
    whole = build_model(cfg, ParallelConfig(recompute=recompute))
    values = dict(experts.named_parameters(whole))
    parallel = ParallelConfig(pipeline=len(counts), pipeline_split=list(counts),
                              recompute=recompute)
    stages = [build_model(cfg, parallel, stage=s) for s in range(len(counts))]
    for stage in stages:
        with torch.no_grad():
            for name, param in experts.named_parameters(stage):
                param.copy_(values[name])
    message = None
    for stage in stages:
        if message is not None:
            stage.set_input_tensor(message)
        message = stage(tokens)
    message.float().square().mean().backward()
    grads = {}
    for stage in stages:
        for name, param in experts.named_parameters(stage):
            grads[name] = grads.get(name, 0) + param.grad
    return message, grads, whole


def _splits(total):
    return [[total // 2 + 1, total - total // 2 - 1], [1, total // 2, total - total // 2 - 1]]


def _assert_the_chain_is_the_whole_model(cfg, recompute="none"):
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(0))
    for counts in _splits(chain_length(cfg)):
        logits, grads, whole = _chain(cfg, counts, tokens, recompute)
        expected = whole(tokens)
        expected.float().square().mean().backward()
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        for name, param in experts.named_parameters(whole):
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{counts} {name}: {m}")


@pytest.mark.parametrize("variant", ["dense", "fullloop", "asymloop", "asymloop_additive",
                                     "asymloop_no_global_kv", "asymloop_no_local_kv",
                                     "asymloop_olmo", "asymloop_moe"])
def test_stages_chained_in_one_process_are_the_whole_model(seeded, variant):
    _assert_the_chain_is_the_whole_model(small_config(variant))


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv"])
def test_stages_recomputing_fully_are_the_whole_model(seeded, variant):
    """Each stage stacks the Global KV of the decoder layers it holds for full recomputation's
    replays (LoopedLM._global_kv_context), which index it by the layer's place in the stage."""
    _assert_the_chain_is_the_whole_model(small_config(variant), recompute="full")


def test_a_pipeline_runs_exactly_the_iterations_it_unrolls(seeded):
    cfg = small_config("asymloop")
    stage = build_model(cfg, ParallelConfig(pipeline=2, pipeline_split=[4, 4]), stage=0)
    with pytest.raises(ValueError, match="num_iterations=2: a pipeline runs exactly the "
                                         "iterations=3 its stages unroll"):
        stage(torch.zeros(1, cfg.seq_length, dtype=torch.long), num_iterations=2)


def test_the_cost_model_replays_what_each_recompute_mode_replays():
    """Each mode adds to a whole-model stage what megaloop.models.flops counts it re-executing;
    selective recomputation (core attention) is neither free nor full, and moves the split."""
    from megaloop.models.flops import executed_backward_flops

    model = ModelConfig(arch="asymloop", num_layers=6, iterations=2, seq_length=1024,
                        vocab_size=256, hidden_size=256, num_attention_heads=4,
                        ffn_hidden_size=1024)
    whole = plan_stages(model, [chain_length(model)])[0]
    base = stage_costs(model, "none").of(whole)
    for mode, modules in (("selective", ["core_attn"]), ("selective", ["mlp"]),
                          ("selective", ["core_attn", "mlp"]), ("full", [])):
        extra = (executed_backward_flops(model, mode, modules)
                 - executed_backward_flops(model, "none"))
        assert stage_costs(model, mode, modules).of(whole) - base == extra > 0, modules
    splits = [balanced_split(model, 3), balanced_split(model, 3, "selective")]
    assert splits[0] != splits[1]  # [3, 3, 3] leaves the last stage slowest once attention replays
    chosen = {mode: stage_counts(model, ParallelConfig(pipeline=3, recompute=mode))
              for mode in ("none", "selective")}
    assert chosen == {"none": splits[0], "selective": splits[1]}


def test_the_balancer_weighs_the_replay_of_recomputed_ffns():
    """Selective recomputation of mlp replays every layer's FFN: each stage costs 6 d f FLOPs per
    token more per application it runs (the head and Global KV nothing more), and the heavier
    layers move the balanced split off the head's stage."""
    model = ModelConfig(arch="asymloop", num_layers=6, iterations=2, seq_length=1024,
                        vocab_size=8192, hidden_size=256, num_attention_heads=4,
                        ffn_hidden_size=512)
    plain, replayed = stage_costs(model, "none"), stage_costs(model, "selective", ["mlp"])
    for stage in plan_stages(model, [4, 5]):
        assert replayed.of(stage) - plain.of(stage) == stage.applications * 6 * 256 * 512
    parallel = ParallelConfig(pipeline=2, recompute="selective", recompute_modules=["mlp"])
    assert (balanced_split(model, 2), stage_counts(model, parallel)) == ([6, 3], [5, 4])
    # MoE: router 2 d E and top-k experts 6 d f_e per token; the shared expert 6 d f_s, again
    # within the MoE layer's replay.
    moe = dataclasses.replace(model, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128,
                              moe_shared_expert_size=384)
    routed, shared = 2 * 256 * 8 + 2 * 6 * 256 * 128, 6 * 256 * 384
    whole = plan_stages(moe, [chain_length(moe)])[0]
    for modules, per_application in ((["moe"], routed + shared), (["shared_experts"], shared),
                                     (["moe", "shared_experts"], routed + 2 * shared)):
        extra = stage_costs(moe, "selective", modules).of(whole) - stage_costs(moe).of(whole)
        assert extra == whole.applications * per_application, modules
