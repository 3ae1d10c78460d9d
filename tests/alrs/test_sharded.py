import logging
import math

import pytest
import torch
from torch import nn

from megaloop.alrs import ALRS, ALRSConfig, balance_by_cost, spectral_stats, weight_blocks
from megaloop.alrs import sharded
from tests.distributed import collective_timeout, run_distributed, workers_discarded_on_failure

SHAPES = {
    "embedding.word_embeddings.weight": (200, 24),
    "encoder.layers.0.self_attention.linear_qkv.weight": (72, 24),
    "encoder.layers.0.mlp.linear_fc1.weight": (96, 24),
    "decoder.layers.0.self_attention.linear_proj.weight": (24, 24),
    "decoder.layers.0.mlp.linear_fc2.weight": (24, 48),
    "decoder.layers.0.self_attention.linear_kv_global.weight": (48, 24),
    "output_layer.weight": (200, 24),
}


def _params(seed: int = 0) -> dict[str, nn.Parameter]:
    """Gaussian entries times Pareto scales of different exponents, so α spreads out."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        scale = torch.rand(shape, generator=g) ** (-1.0 / (1.0 + i))
        out[name] = nn.Parameter(torch.randn(shape, generator=g) * scale)
    return out


def test_weight_blocks_count_shared_and_tied_weights_once():
    emb = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied
    layer = nn.Linear(16, 16)
    model = nn.ModuleDict({"embedding": emb, "decoder": nn.ModuleList([layer, layer, layer]),
                           "output_layer": head, "router": nn.Linear(16, 4), "norm": nn.LayerNorm(16)})
    names = [m.name for m in weight_blocks(model.named_parameters(), exclude=("router",))]
    assert names == ["embedding.weight", "decoder.0.weight"]
    duplicated = model.named_parameters(remove_duplicate=False)
    names = [m.name for m in weight_blocks(duplicated)]
    assert names == ["embedding.weight", "decoder.0.weight", "router.weight"]


def test_balance_by_cost_is_longest_processing_time_first():
    assert balance_by_cost([10, 8, 7, 3, 2], 2) == [0, 1, 1, 0, 0]
    assert balance_by_cost([5, 5, 5], 1) == [0, 0, 0]
    assert balance_by_cost([], 3) == []


def test_hook_failures_never_reach_training(monkeypatch, caplog):
    params = _params()
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("parameters went away")
        return params.items()

    alrs = ALRS(flaky, 100, ALRSConfig(interval=10))
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        assert set(alrs.step(1).values()) == {1.0}
    assert "analysis at step 1 failed" in caplog.text and "parameters went away" in caplog.text

    def broken(weight, name, method):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(sharded, "spectral_stats", broken)
    caplog.clear()
    # (with embedding_head="pin_s2" embedding and head would get s2 whatever the α)
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10, embedding_head="exclude"))
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        assert set(alrs.step(1).values()) == {1.0}
    assert "did not converge" in caplog.text
    assert all(math.isnan(s.alpha) for s in alrs.last_stats.values())


def test_a_failed_spectra_log_write_is_named_as_such(monkeypatch, caplog, tmp_path):
    """Before: "analysis at step 1 failed; multipliers unchanged", though they had changed."""
    params = _params()
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10), log_path=tmp_path / "a.zarr")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(alrs.log, "append_spectra", full_disk)
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        multipliers = alrs.step(1)
    assert len(set(multipliers.values())) > 2
    assert "writing the spectra log failed at step 1 (the multipliers are allocated)" in caplog.text
    assert "analysis at step 1 failed" not in caplog.text


def test_dead_matrix_keeps_its_previous_multiplier(caplog):
    params = _params()
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10, transition=0, fraction=1.0))
    before = alrs.step(1)
    assert len(set(before.values())) > 2
    dead = "encoder.layers.0.mlp.linear_fc1.weight"
    with torch.no_grad():
        params[dead].fill_(math.nan)
        params["decoder.layers.0.mlp.linear_fc2.weight"].mul_(torch.rand(24, 48) ** -2)
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        after = alrs.step(10)
    assert dead in caplog.text and math.isnan(alrs.last_stats[dead].alpha)
    assert after[dead] == before[dead]
    assert after != before  # the others were re-allocated


def _spread_body(rank, world_size):
    computed = []

    def counting(weight, name, method):
        computed.append(name)
        return spectral_stats(weight, name, method)

    original, sharded.spectral_stats = sharded.spectral_stats, counting
    try:
        params = _params()
        alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10))
        multipliers = alrs.step(1)
        multipliers = alrs.step(51)  # the end of the first ramp: the targets themselves
    finally:
        sharded.spectral_stats = original
    alphas = {n: s.alpha for n, s in alrs.last_stats.items()}
    return multipliers, alphas, computed


def test_two_ranks_share_the_work_and_apply_identical_multipliers():
    results = run_distributed(_spread_body, world_size=2)
    (mult0, alpha0, done0), (mult1, alpha1, done1) = results
    assert mult0 == mult1 and alpha0 == alpha1  # bit-identical floats
    assert done0 and done1 and not set(done0) & set(done1)
    assert sorted(done0 + done1) == sorted(SHAPES)
    single = ALRS(lambda: _params().items(), 100, ALRSConfig(interval=10))
    single.step(1)
    expected = single.step(51)
    assert mult0 == pytest.approx(expected, rel=1e-12)
    assert len(set(mult0.values())) > 2


def _full_matrices():
    g = torch.Generator().manual_seed(7)
    col = torch.randn(48, 24, generator=g) * torch.rand(48, 24, generator=g) ** -0.7
    row = torch.randn(24, 48, generator=g) * torch.rand(24, 48, generator=g) ** -0.4
    plain = torch.randn(24, 24, generator=g)
    return {"decoder.layers.0.mlp.linear_fc1.weight": (col, 0),
            "decoder.layers.0.mlp.linear_fc2.weight": (row, 1),
            "decoder.layers.0.router.weight": (plain, None)}


def _tp_sharded_params(rank, world_size) -> dict[str, nn.Parameter]:
    """``_full_matrices`` as this TP rank holds them, marked as megatron-core marks its shards."""
    params = {}
    for name, (full, dim) in _full_matrices().items():
        part = full if dim is None else full.chunk(world_size, dim=dim)[rank]
        params[name] = nn.Parameter(part.clone())
        if dim is not None:
            params[name].tensor_model_parallel, params[name].partition_dim = True, dim
    return params


def _tp_body(rank, world_size):
    import torch.distributed as dist

    tp_group = dist.new_group(list(range(world_size)))
    params = _tp_sharded_params(rank, world_size)
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10), tp_group=tp_group)
    alrs.step(1)
    return ({m.name: m.full_shape for m in alrs.matrices},
            {n: s.alpha for n, s in alrs.last_stats.items()})


def test_tp_sharded_alpha_is_that_of_the_full_matrix():
    (shapes0, alpha0), (shapes1, alpha1) = run_distributed(_tp_body, world_size=2)
    assert alpha0 == alpha1 and shapes0 == shapes1
    for name, (full, dim) in _full_matrices().items():
        assert shapes0[name] == tuple(full.shape)
        expected = spectral_stats(full, name)[0].alpha
        assert alpha0[name] == pytest.approx(expected, rel=1e-10)
        if dim is not None:  # a shard's α differs, so using one would fail the line above
            shard_alpha = spectral_stats(full.chunk(2, dim=dim)[0], name)[0].alpha
            assert abs(shard_alpha - expected) > 1e-2


def _pipeline_multipliers(rank, world_size, data_prefix, out_dir, seed_checkpoint, parallel):
    """ALRS over 2 steps of the tiny AsymLoop run: the multipliers, the matrices every rank lists,
    and those this rank holds and analyses."""
    from pathlib import Path

    from tests.training.conftest import tiny_run
    from megaloop.training.trainer import Trainer

    cfg = tiny_run(data_prefix, Path(out_dir), parallel=parallel,
                   train={"train_steps": 2, "global_batch_size": 8, "use_alrs": True},
                   checkpoint={"load": seed_checkpoint, "load_optimizer": False})
    trainer = Trainer(cfg)
    trainer.train()
    alrs = trainer.alrs
    held = {name for model in trainer.models for name, _ in
            sharded.experts.named_parameters(model)}
    analysed = [n for n, owner in zip(alrs.names, alrs.owner) if owner == alrs.rank]
    return dict(trainer.lr_multipliers.multipliers), alrs.names, held, analysed


def test_pipeline_stages_analyse_what_they_hold_and_apply_the_one_process_multipliers(
        mcore, tmp_path):
    from tests.training.conftest import tiny_run, write_pattern_dataset
    from megaloop.training.trainer import Trainer

    data = write_pattern_dataset(tmp_path / "pattern")
    with Trainer(tiny_run(data, tmp_path / "seed")) as trainer:
        trainer.save()
    seed = str(tmp_path / "seed" / "checkpoints")
    expected, names, _, _ = _pipeline_multipliers(0, 1, data, tmp_path / "single", seed, {})
    assert len(set(expected.values())) > 4
    # pp2 [3, 3] holds decoder layer 1 on both stages; pp2,vp2 [2, 1, 2, 1] on 3 chunks of 2 ranks.
    for chunks in (1, 2):
        parallel = {"pipeline": 2, "virtual_pipeline": chunks}
        ranks = run_distributed(_pipeline_multipliers, world_size=2, data_prefix=data,
                                out_dir=str(tmp_path / f"vp{chunks}"), seed_checkpoint=seed,
                                parallel=parallel)
        tied = {n for n in names if all(n.split(":")[0] in held for _, _, held, _ in ranks)}
        assert any(n.startswith("decoder.layers.0.") for n in tied), parallel
        analysed = [n for _, _, _, mine in ranks for n in mine]
        assert sorted(analysed) == sorted(names)  # every matrix once, a tied one too
        for multipliers, listed, held, mine in ranks:
            assert listed == names and all(n.split(":")[0] in held for n in mine)
            for name, value in expected.items():
                assert multipliers[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_a_run_starting_over_in_a_directory_rewrites_its_log_from_its_first_step(tmp_path):
    from megaloop.alrs import read_log

    params = _params()
    for steps in (4, 2):  # a run, then a fresh one (its checkpoints were removed) in its place
        alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=2, fraction=1.0),
                    log_path=tmp_path / "alrs.zarr")
        for t in range(1, steps + 1):
            alrs.step(t, base_lr=1e-3)
        alrs.close()
    log = read_log(tmp_path / "alrs.zarr")
    # Before the fix the second run appended: spectra [1, 2, 4, 1, 2], LRs [1, 2, 3, 4, 1, 2].
    assert log.spectra_step.tolist() == [1, 2] and log.lr_step.tolist() == [1, 2]


def _another_runs_log_body(rank, world_size, path):
    from megaloop.config import ConfigError

    params = _params()
    try:
        ALRS(lambda: params.items(), 100, ALRSConfig(interval=10), log_path=path)
    except ConfigError as e:
        return str(e)
    return None


def test_a_log_refused_on_the_writing_rank_fails_every_rank(tmp_path):
    from megaloop.alrs import ALRSLog

    path = str(tmp_path / "alrs.zarr")
    ALRSLog(path, ["other.weight"], [(4, 4)], ["other.weight", "base"])  # another run's log
    # Before the fix only rank 0 raised; the others went on to wait in their next collective.
    messages = run_distributed(_another_runs_log_body, world_size=2, path=path)
    assert messages[0] == messages[1] and messages[0].startswith(f"ALRS log {path} belongs to "
                                                                 "a run with other matrices")


def test_a_checkpoint_commits_the_lr_rows_up_to_its_step(tmp_path):
    from megaloop.alrs import read_log

    params = _params()
    first = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10),
                 log_path=tmp_path / "alrs.zarr")
    for t in range(1, 31):
        first.step(t, base_lr=1e-3)
    state = first.state_dict()  # a checkpoint at step 30; then the run is killed (no close)
    first.step(31, base_lr=1e-3)
    resumed = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10),
                   log_path=tmp_path / "alrs.zarr")
    resumed.load_state_dict(state)
    for t in range(31, 41):
        resumed.step(t, base_lr=1e-3)
    resumed.close()
    # Before the fix rows were flushed every 100 steps: steps 1-30 were lost with the process.
    assert read_log(tmp_path / "alrs.zarr").lr_step.tolist() == list(range(1, 41))


def test_an_exclude_pattern_matching_no_parameter_is_refused():
    from megaloop.config import ConfigError

    params = _params()
    kept = ALRS(lambda: params.items(), 100, ALRSConfig(exclude=("linear_fc1",))).names
    assert kept and not any("linear_fc1" in name for name in kept)
    # Before the fix a typo excluded nothing, silently.
    with pytest.raises(ConfigError, match=r"^alrs.exclude=\['linear_fc1', 'routr'\]: 'routr' is "
                                          r"in no weight matrix's name \(ALRS analyses and scales "
                                          r"2-D weights only; e.g. 'embedding."):
        ALRS(lambda: params.items(), 100, ALRSConfig(exclude=("linear_fc1", "routr")))
    # Before: a pattern naming only 1-D parameters (norms, biases), which ALRS never scales, was
    # taken and excluded nothing.
    params["decoder.layers.0.input_layernorm.weight"] = nn.Parameter(torch.ones(24))
    with pytest.raises(ConfigError, match=r"^alrs.exclude=\['layernorm'\]: 'layernorm' is in no "
                                          r"weight matrix's name"):
        ALRS(lambda: params.items(), 100, ALRSConfig(exclude=("layernorm",)))


def test_options_the_mode_does_not_read_are_named_once_at_start(caplog):
    """One config serves both arms of a comparison, so they are accepted; before, silently."""
    params = _params()
    uniform = ALRSConfig(mode="uniform", s2=3.0, transition=10, decoder_boost=4.0)
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        ALRS(lambda: params.items(), 100, uniform)
    [record] = caplog.records
    assert record.getMessage() == ("ALRS: alrs.mode='uniform' does not read alrs.s2=3.0, "
                                   "alrs.transition=10, alrs.decoder_boost=4.0 (no effect on this "
                                   "run)")
    caplog.clear()
    # Before: "alrs.mode='alrs' does not read ... (set for another mode ...)", though that mode
    # reads the prefixes; embedding_head='include' is what leaves them unread.
    include = ALRSConfig(embedding_head="include", embedding_head_prefixes=["embedding."])
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        ALRS(lambda: params.items(), 100, include)
    [record] = caplog.records
    assert record.getMessage() == ("ALRS: alrs.mode='alrs' with alrs.embedding_head='include' does "
                                   "not read alrs.embedding_head_prefixes=('embedding.',) (no "
                                   "effect on this run)")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        ALRS(lambda: params.items(), 1000, ALRSConfig(s2=3.0, transition=10))  # all read
        ALRS(lambda: params.items(), 100, ALRSConfig(mode="decoder_boost", decoder_boost=4.0))
    assert caplog.records == []


def test_embedding_and_head_prefixes_that_start_no_weight_name_are_named(caplog):
    """The hook on a model of other names: pin_s2 pins nothing. Before, without a word."""
    renamed = {n.replace("embedding.", "tok_embeddings.").replace("output_layer.", "lm_head."): p
               for n, p in _params().items()}
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        multipliers = ALRS(lambda: renamed.items(), 100, ALRSConfig()).step(1)
    [record] = caplog.records
    assert record.getMessage() == (
        "ALRS: no weight name starts with alrs.embedding_head_prefixes=['embedding.', "
        "'output_layer.'], so alrs.embedding_head='pin_s2' treats no matrix as embedding or head "
        "(set them to this model's; its names are e.g. 'tok_embeddings.word_embeddings.weight')")
    assert multipliers["tok_embeddings.word_embeddings.weight"] < 5.0  # in the α range
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):  # excluded: nothing to pin
        ALRS(lambda: _params().items(), 100, ALRSConfig(exclude=("embedding.", "output_layer.")))
        ALRS(lambda: renamed.items(), 100, ALRSConfig(embedding_head_prefixes=["tok_", "lm_"]))
    assert caplog.records == []


def test_a_transition_without_a_later_allocation_is_named(caplog):
    """Only step 1 allocates when alrs.interval > alrs.fraction x T; its multipliers hold at
    once, so no ramp ever runs. Before, a transition set for such a run went without a word."""
    params = _params()
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        ALRS(lambda: params.items(), 400, ALRSConfig(transition=10))
    [record] = caplog.records
    assert record.getMessage() == ("ALRS allocates only at step 1 (alrs.interval=100 > "
                                   "alrs.fraction x total steps = 80), whose multipliers hold at "
                                   "once: alrs.transition=10 has no effect")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        ALRS(lambda: params.items(), 500, ALRSConfig(transition=10))  # allocates at 100 too
        ALRS(lambda: params.items(), 400, ALRSConfig())  # the default, not set for this run
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):  # longer than the window
        ALRS(lambda: params.items(), 500, ALRSConfig(transition=150))
    assert [r.getMessage() for r in caplog.records] == [ALRSConfig(transition=150).transition_note(500)]


def test_a_decoder_boost_of_every_layer_is_named(caplog):
    """Dense and Full Loop name every layer decoder: the boost is a higher LR of all layers.
    Before, without a word."""
    params = {n: p for n, p in _params().items() if not n.startswith("encoder.")}
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        multipliers = ALRS(lambda: params.items(), 100, ALRSConfig(mode="decoder_boost")).step(1)
    [record] = caplog.records
    assert record.getMessage() == (
        "ALRS: alrs.decoder_prefix='decoder.' starts the name of every matrix but the embedding "
        "and head's (a model without encoder layers, e.g. model.arch=dense or fullloop): "
        "alrs.mode='decoder_boost' multiplies the LR of all layers alike, by "
        "alrs.decoder_boost=2")
    assert {n for n, m in multipliers.items() if m != 1.0} == {n for n in params
                                                              if n.startswith("decoder.")}


@pytest.mark.parametrize("fields, message", [
    (dict(mode="decoder_boost", decoder_prefix="decoders."), "alrs.decoder_prefix: 'decoders.'"),
    (dict(embedding_head_prefixes=["embedding.", "head."]), "alrs.embedding_head_prefixes: "
                                                            "'head.'"),
])
def test_a_prefix_the_mode_reads_that_names_no_matrix_is_refused(fields, message):
    # Before: decoder_boost boosted nothing, and "head." pinned nothing, without a word.
    params = _params()
    with pytest.raises(ValueError, match=rf"^{message} starts no matrix name \(e.g. 'embedding."
                                         r"word_embeddings.weight'\), so alrs.mode="):
        ALRS(lambda: params.items(), 100, ALRSConfig(**fields))
    boosted = ALRS(lambda: params.items(), 100, ALRSConfig(mode="decoder_boost")).step(1)
    assert {n for n, m in boosted.items() if m == 2.0} == {n for n in SHAPES
                                                         if n.startswith("decoder.")}
    # The default embedding/head prefixes need not all match: a tied model has no output_layer.
    tied = {n: p for n, p in params.items() if not n.startswith("output_layer.")}
    ALRS(lambda: tied.items(), 100, ALRSConfig())


@pytest.mark.parametrize("mode", ["alrs", "uniform", "decoder_boost"])
@pytest.mark.parametrize("embedding_head", ["pin_s2", "exclude", "include"])
@pytest.mark.parametrize("field, value", [("decoder_prefix", "nowhere."),
                                          ("embedding_head_prefixes", ("nothing.",))])
def test_a_prefix_matching_nothing_is_refused_or_named_unread_never_both_nor_neither(
        mode, embedding_head, field, value, caplog):
    """The start-up warning and the prefix check follow one rule (ALRSConfig.read_options)."""
    params = _params()
    config = ALRSConfig(mode=mode, embedding_head=embedding_head, **{field: value})
    refused = False
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        try:
            ALRS(lambda: params.items(), 100, config)
        except ValueError as e:
            refused = str(e).startswith(f"alrs.{field}: ")
    warned = any(f"alrs.{field}=" in r.getMessage() for r in caplog.records)
    assert refused != warned
    assert refused == (mode == "decoder_boost" if field == "decoder_prefix"
                       else mode == "alrs" and embedding_head != "include")


def _out_of_memory_on_rank_1(rank, world_size):
    """``_tp_body``'s matrices; rank 1's buffers for the blocks it gathers cannot be allocated.
    Then the next collective of training (an all-reduce) under a short process-group timeout."""
    import datetime

    import torch.distributed as dist

    # A rank left waiting fails after 30 s, not after the process-group timeout (30 minutes).
    tp_group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=30))
    params = _tp_sharded_params(rank, world_size)
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10), tp_group=tp_group)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage() + str(record.exc_info[1]))
    sharded.logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch, collective_timeout(30):
            if rank == 1:
                def refused(*args, **kwargs):
                    raise torch.OutOfMemoryError("cannot allocate 4.5 KiB")

                monkeypatch.setattr(torch, "empty_like", refused)
            multipliers = alrs.step(1)
            total = torch.ones(1)
            dist.all_reduce(total)
    finally:
        sharded.logger.removeHandler(handler)
    owned = [m.name for m, owner in zip(alrs.matrices, alrs.owner) if owner == 1
             and m.partition_dim is not None]
    return multipliers, warnings, total.item(), owned


def test_a_failure_on_one_rank_before_the_tp_gathers_skips_the_analysis_on_every_rank():
    # Before, rank 1 logged its failure and went on to the all-reduce while rank 0 waited in
    # the gather of rank 1's block: both until the process-group timeout.
    with workers_discarded_on_failure():
        (multipliers0, warnings0, total0, owned), (multipliers1, warnings1, total1, _) = \
            run_distributed(_out_of_memory_on_rank_1, world_size=2)
        assert total0 == total1 == 2.0
    assert owned, "rank 1 owns a tensor-parallel block, which it gathers"
    assert multipliers0 == multipliers1 and set(multipliers0.values()) == {1.0}
    for warnings in (warnings0, warnings1):
        assert warnings == ["ALRS: analysis at step 1 failed; multipliers unchanged"
                            "gathering the blocks to analyse failed: rank 1: "
                            "OutOfMemoryError: cannot allocate 4.5 KiB"], warnings


def test_a_failure_to_cut_a_block_in_one_process_names_it(monkeypatch, caplog):
    """Before: without a process group, naming the rank raised ValueError ("Default process
    group has not been initialized") in place of the failure, which the warning then ended with."""
    from megaloop.alrs.blocks import WeightBlock

    def refused(self, weight):
        raise torch.OutOfMemoryError("cannot allocate 4.5 KiB")

    monkeypatch.setattr(WeightBlock, "local", refused)
    params = _params()
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10))
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        assert set(alrs.step(1).values()) == {1.0}
    [failure] = [r for r in caplog.records if "analysis at step 1 failed" in r.getMessage()]
    assert str(failure.exc_info[1]) == ("gathering the blocks to analyse failed: "
                                        "OutOfMemoryError: cannot allocate 4.5 KiB")


def _copies_alive_at_each_gather(rank, world_size):
    """``_tp_body``'s matrices; at each TP gather, how many fp32 copies sent by earlier gathers
    are still alive on this rank."""
    import weakref

    import torch.distributed as dist

    tp_group = dist.new_group(list(range(world_size)))
    params = _tp_sharded_params(rank, world_size)
    alrs = ALRS(lambda: params.items(), 100, ALRSConfig(interval=10), tp_group=tp_group)
    sent, alive = [], []
    gather = dist.gather

    def counted(tensor, *args, **kwargs):
        alive.append(sum(ref() is not None for ref in sent))
        sent.append(weakref.ref(tensor))
        return gather(tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(dist, "gather", counted)
        alrs.step(1)
    return alive


def test_tp_blocks_are_gathered_one_at_a_time():
    """Each block's fp32 copy is freed before the next gather: holding every copy until the
    gathers end (as a version of this code did) costs 4 bytes per local TP-sharded parameter at
    each analysis, on the GPU."""
    for alive in run_distributed(_copies_alive_at_each_gather, world_size=2):
        assert len(alive) > 1 and set(alive) == {0}, alive
