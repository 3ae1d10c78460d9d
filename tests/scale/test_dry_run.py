"""The dry run refuses what the run would refuse at start-up, before anything heavy runs."""

import dataclasses

import pytest

from megaloop.config import ConfigError, DataConfig, RunConfig
from megaloop.presets import preset
from megaloop.scale.dry_run import report
from tests.data.conftest import SP_MODEL


def _run(**data):
    return RunConfig(model=preset("tiny"), data=DataConfig(**{"path": ["x"], **data}))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    cfg = _run(tokenizer_model=str(SP_MODEL))
    with pytest.raises(ConfigError, match=r"^model.vocab_size=4096: smaller than the tokenizer's "
                                          r"32000 tokens"):
        report(cfg, world_size=1)
    cfg.model = dataclasses.replace(cfg.model, vocab_size=32000)
    assert "fits" in report(cfg, world_size=1)


def test_an_eod_id_past_the_vocabulary_is_refused():
    with pytest.raises(ConfigError, match=r"^data.eod_id=4096: must be a token id, from 0 to "
                                          r"model.vocab_size - 1 = 4095$"):
        report(_run(eod_id=4096), world_size=1)
    assert "fits" in report(_run(eod_id=4095), world_size=1)


def test_an_unloadable_tokenizer_is_refused_and_an_absent_one_noted(tmp_path):
    broken = tmp_path / "broken.model"
    broken.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ConfigError, match=rf"^data.tokenizer_model='{broken}': "):
        report(_run(tokenizer_model=str(broken)), world_size=1)
    # A cluster recipe sized on a laptop: the tokenizer lives on the cluster's filesystem.
    text = report(_run(tokenizer_model="/cluster/tok.model"), world_size=1)
    assert ("# note: data.tokenizer_model /cluster/tok.model is not on this machine; "
            "model.vocab_size is checked against it at start-up") in text.splitlines()


@pytest.mark.parametrize("train, parallel, world, message", [
    # Before: "0 micro-batches of 4 per step" and "fits"; the launch is refused at start-up.
    (dict(global_batch_size=8, micro_batch_size=4), {}, 4,
     "train.global_batch_size=8: must be a multiple of micro_batch_size x data-parallel size = "
     "4 x 4 = 16"),
    (dict(global_batch_size=12, micro_batch_size=4), {}, 2,
     "train.global_batch_size=12: must be a multiple of micro_batch_size x data-parallel size = "
     "4 x 2 = 8"),
    (dict(global_batch_size=12, micro_batch_size=4), dict(pipeline=2, virtual_pipeline=2), 2,
     "train.global_batch_size=12: the interleaved schedule (parallel.virtual_pipeline=2) runs "
     "micro-batches in groups of parallel.pipeline=2, but a step has 3 per data-parallel rank; "
     "use a multiple of 8"),
])
def test_a_global_batch_that_does_not_split_is_refused(train, parallel, world, message):
    from megaloop.config import ParallelConfig, TrainConfig

    cfg = dataclasses.replace(_run(eod_id=0), train=TrainConfig(**train),
                              parallel=ParallelConfig(**parallel))
    with pytest.raises(ConfigError) as error:
        report(cfg, world_size=world)
    assert str(error.value) == message
    fine = dataclasses.replace(cfg, train=TrainConfig(global_batch_size=16 * world,
                                                      micro_batch_size=4))
    assert "fits" in report(fine, world_size=world)


def test_data_files_absent_here_are_noted(tmp_path):
    # Before: a tokenizer absent here was noted, a data.path absent here passed without a word.
    for suffix in (".bin", ".idx"):
        (tmp_path / f"here{suffix}").touch()
    (tmp_path / "half.bin").touch()
    blend = ["0.3", str(tmp_path / "here"), "0.5", "/cluster/b", "0.2", str(tmp_path / "half")]
    lines = report(_run(eod_id=0, path=blend), world_size=1).splitlines()
    assert [line for line in lines if line.startswith("# note:")] == [
        f"# note: data.path /cluster/b.bin, /cluster/b.idx, {tmp_path}/half.idx are not on this "
        "machine; the data are checked at start-up"]
    assert "# note:" not in report(_run(eod_id=0, path=[str(tmp_path / "here")]), world_size=1)
    sft = _run(format="sft", path=["/cluster/gsm8k.jsonl"], tokenizer_model="/cluster/tok.model")
    assert ("# note: data.path /cluster/gsm8k.jsonl is not on this machine; the data are checked "
            "at start-up") in report(sft, world_size=1).splitlines()


def test_the_rank_table_places_ranks_on_nodes_of_the_launchers_size(monkeypatch):
    """Before: 8 GPUs per node always, so on nodes of 4 a TP=8 group spanning two nodes was
    shown inside one (ranks 0-7 on node 0)."""
    cfg = dataclasses.replace(_run(eod_id=0), train=dataclasses.replace(
        RunConfig().train, global_batch_size=8, micro_batch_size=1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    lines = report(cfg, world_size=8).splitlines()
    assert lines[lines.index("rank  node  gpu  tp    stage  dp      ep") + 5].startswith(
        "4     1     0 ")
    assert "; 4 GPUs per node" in next(line for line in lines if line.startswith("# rank layout"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match=r"^LOCAL_WORLD_SIZE='four': must be the processes per "):
        report(cfg, world_size=8)


def test_the_dry_run_says_which_modules_selective_recomputation_replays():
    from megaloop.config import ParallelConfig

    cfg = _run(eod_id=0)
    cfg.model = dataclasses.replace(cfg.model, arch="asymloop", iterations=3)
    cfg.parallel = ParallelConfig(recompute="selective")
    assert "recompute selective (core_attn of every layer);" in report(cfg, world_size=1)
    cfg.parallel.recompute_modules = ["core_attn", "mlp"]
    assert "recompute selective (core_attn, mlp of every layer);" in report(cfg, world_size=1)


def test_the_dry_runs_pipeline_split_counts_selective_recomputation():
    from megaloop.config import ParallelConfig
    from megaloop.models.pipeline import balance, balanced_split

    cfg = _run(eod_id=0)  # a model whose balanced split moves once core attention replays
    cfg.model = dataclasses.replace(cfg.model, arch="asymloop", num_layers=6, iterations=2,
                                    seq_length=1024, vocab_size=256, hidden_size=256,
                                    num_attention_heads=4, ffn_hidden_size=1024,
                                    encoder_layers=3, decoder_ffn_hidden_size=1024)
    split = balanced_split(cfg.model, 3, "selective")
    assert split != balanced_split(cfg.model, 3, "none")
    # Its balance as the run has it, not as if the replay were free.
    slowest, free = (f"{balance(cfg.model, split, 3, 1, mode).slowest:.2f}"
                     for mode in ("selective", "none"))
    assert slowest != free
    cfg.parallel = ParallelConfig(pipeline=3, recompute="selective")
    assert (f"pipeline split {split} (balanced by the layout chooser): slowest stage {slowest} x "
            "ideal") in report(cfg, world_size=3)


def test_a_fitting_layout_of_sizes_outside_the_search_is_listed_among_those_that_fit():
    """Before: the search tried tensor/pipeline sizes 1, 2, 4, 8 only, so three pipeline stages
    on 3 GPUs (the batch splitting over no other layout) fitted and, one line later, "no layout
    of 3 GPUs fits"."""
    from megaloop.config import ParallelConfig

    cfg = _run(eod_id=0)
    cfg.model = dataclasses.replace(cfg.model, arch="asymloop", num_layers=6, iterations=2,
                                    encoder_layers=3)
    cfg.parallel = ParallelConfig(pipeline=3)
    cfg.train = dataclasses.replace(cfg.train, global_batch_size=8, micro_batch_size=4)
    lines = report(cfg, world_size=3).splitlines()
    assert lines[-2].endswith("-> fits")
    assert lines[-1].startswith("cheapest layouts that fit 3 GPUs of 80 GiB: pp3 ("), lines[-1]


@pytest.mark.parametrize("settings, refused", [
    # Test-time depths, which one stage alone runs.
    ({"train.eval_depths": [1, 3]}, {"parallel.pipeline": 2}),
    # Delayed FP8 scaling, which full recomputation of a looped model would replay wrongly.
    ({"train.precision": "fp8", "train.fp8_recipe": "delayed"}, {"parallel.recompute": "full"}),
])
def test_the_layouts_said_to_fit_are_ones_the_run_accepts(settings, refused):
    """Before: the search checked each layout's parallel section alone, so the cheapest layouts
    it named included ones that the run (and the dry run of that layout) refuses for this
    config."""
    from megaloop.cli import with_settings
    from megaloop.scale.memory import GIB, fitting_layouts

    cfg = _run(eod_id=0)
    # FFN widths FP8's GEMMs take whole and split over 2 (the tiny preset's 344 is none).
    cfg.model = dataclasses.replace(cfg.model, arch="asymloop", iterations=3,
                                    ffn_hidden_size=384, decoder_ffn_hidden_size=384)
    cfg = with_settings(cfg, settings).validate()
    found = [layout.apply(cfg).parallel for layout, _ in fitting_layouts(cfg, 2, 80 * GIB)]
    (field, value), = refused.items()
    name = field.removeprefix("parallel.")
    assert found and not [p for p in found if getattr(p, name) == value], found
    with pytest.raises(ConfigError):
        with_settings(cfg, refused).validate()


def test_the_layouts_said_to_fit_keep_the_overlap_that_pipelines_accept():
    """Overlapped reduction with the loop's tied decoder copies on both pipeline stages is a run
    the trainer accepts (tied copies summed after the data-parallel reduction): pp2 is offered,
    with the config's overlap."""
    from megaloop.cli import with_settings
    from megaloop.scale.memory import GIB, fitting_layouts

    cfg = _run(eod_id=0)
    cfg.model = dataclasses.replace(cfg.model, arch="asymloop", iterations=3)
    cfg = with_settings(cfg, {"parallel.overlap_grad_reduce": True}).validate()
    found = {layout.name: layout.apply(cfg).parallel for layout, _ in fitting_layouts(cfg, 2,
                                                                                      80 * GIB)}
    assert "pp2" in found and all(p.overlap_grad_reduce for p in found.values()), found


def test_fp8_sizes_the_gpu_run_refuses_are_refused_by_the_dry_run():
    """The 60M preset's FFN (1512) is no FP8 GEMM width: the GPU run refuses it at set-up, and
    the dry run, which plans that run on any machine, said nothing."""
    cfg = _run(eod_id=0)
    cfg.model = preset("60M")
    cfg.train = dataclasses.replace(cfg.train, precision="fp8")
    with pytest.raises(ConfigError, match=r"model ffn_hidden_size = 1512 is a GEMM inner"):
        report(cfg, world_size=1)
    cfg.train = dataclasses.replace(cfg.train, precision="bf16")
    assert report(cfg, world_size=1)
