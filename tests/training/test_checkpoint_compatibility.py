"""What a checkpoint may be resumed into: the model fields that refuse a change (the architecture)
and those that may change, and the optimizer state's layouts and kinds."""

import pytest

from megaloop.config import ModelConfig, RunConfig, save_yaml
from megaloop.training import checkpoint as ckpt
from tests.training.conftest import one_line


# ----------------------------------------------------------------------- architecture (13.6)

# Each architecture-defining field with a value different from the saved run's, as a user would
# set it; every other ModelConfig field may change on resume.
ARCHITECTURE_CHANGES = {
    "arch": "fullloop", "num_layers": 6, "hidden_size": 64, "ffn_hidden_size": 96,
    "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 256, "encoder_layers": 1,
    "block": "olmo", "qk_norm": False, "injection": "additive", "local_kv": False,
    "global_kv_norm": False, "decoder_ffn_hidden_size": 96, "tie_embeddings": True,
    "head_dim": 16, "num_experts": 4, "moe_layers": "decoder", "moe_ffn_hidden_size": 32,
    "moe_shared_expert_size": 16, "prelude_layers": 1, "coda_layers": 1, "latent_visits": [2],
    "latent_stride": 4, "latent_writeback_lag": 1, "latent_reduction": "top_k",
    "residual_scale": "fixed", "untie_attention": True, "untie_moe": True,
}
RESUMABLE_CHANGES = {"iterations": 5, "joint_attention": "masked", "seq_length": 64,
                     "rotary_base": 500000.0, "norm_eps": 1e-6, "init_std": 0.01,
                     "residual_scale_init": [0.5, 1.0], "moe_top_k": 3, "moe_aux_loss_coeff": 0.1,
                     "moe_z_loss_coeff": 0.0}


def test_every_model_field_is_either_architecture_or_resumable():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(ARCHITECTURE_CHANGES) | set(RESUMABLE_CHANGES) == fields
    assert set(ckpt.ARCHITECTURE_FIELDS) == set(ARCHITECTURE_CHANGES)
    assert set(ckpt.RESUMABLE_MODEL_FIELDS) == set(RESUMABLE_CHANGES)


@pytest.fixture
def saved_config(tmp_path):
    """A checkpoint directory's config.yaml (all check_compatible reads)."""
    path = tmp_path / "iter_0000001"
    path.mkdir()
    model = ModelConfig(arch="asymloop", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                        num_attention_heads=4, num_query_groups=2, vocab_size=128)
    save_yaml(RunConfig(model=model.resolve()), path / "config.yaml")  # saved resolved, as runs do
    return path


@pytest.mark.parametrize("field, value", sorted(ARCHITECTURE_CHANGES.items()))
def test_each_architecture_field_changed_alone_is_refused(saved_config, field, value):
    import dataclasses

    cfg = RunConfig(model=dataclasses.replace(ckpt_model(saved_config), **{field: value}))
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_compatible(saved_config, cfg)
    assert f"model.{field}=" in one_line(error)


@pytest.mark.parametrize("field, value", sorted(RESUMABLE_CHANGES.items()))
def test_resumable_model_fields_may_change(saved_config, field, value):
    import dataclasses

    cfg = RunConfig(model=dataclasses.replace(ckpt_model(saved_config), **{field: value}))
    ckpt.check_compatible(saved_config, cfg)



def test_a_resumable_change_that_moves_a_derived_width_names_the_field_changed(tmp_path):
    """Before: moe_top_k 2 -> 4 with moe_ffn_hidden_size unset was refused naming only
    moe_ffn_hidden_size, a field the user never set."""
    import dataclasses

    path = tmp_path / "iter_0000001"
    path.mkdir()
    moe = ModelConfig(arch="asymloop", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                      num_attention_heads=4, vocab_size=128, num_experts=4)
    save_yaml(RunConfig(model=dataclasses.replace(moe).resolve()), path / "config.yaml")
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_compatible(path, RunConfig(model=dataclasses.replace(moe, moe_top_k=4)))
    assert one_line(error) == (
        f"{path} was saved by a different architecture: model.moe_top_k=4 (2 in the checkpoint) "
        "changes model.moe_ffn_hidden_size from 32 to 16 (when unset it is ffn_hidden_size // "
        "moe_top_k; set it to 32 to keep the checkpoint's)")
    ckpt.check_compatible(path, RunConfig(model=dataclasses.replace(moe, moe_top_k=4,
                                                                    moe_ffn_hidden_size=32)))


@pytest.mark.parametrize("saved_visits, visits", [([1, 2], [2, 1]), ([2, 1], [1, 2])])
def test_the_reduced_visits_in_another_order_are_the_same_architecture(tmp_path, saved_visits,
                                                                       visits):
    """latent_visits is a set of visit numbers. Before: [2, 1] against a checkpoint saved with
    [1, 2] was refused as "a different architecture"; a checkpoint saved unsorted (before
    resolve() sorted them) resumes with the sorted spelling too, and no "changed" line."""
    from megaloop.training.resume import _differences

    path = tmp_path / "iter_0000001"
    path.mkdir()
    latent = dict(arch="latentloop", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                  num_attention_heads=4, vocab_size=128, iterations=2)
    saved = RunConfig(model=ModelConfig(**latent).resolve())
    saved.model.latent_visits = saved_visits  # as written, unsorted by an older version
    save_yaml(saved, path / "config.yaml")
    run = RunConfig(model=ModelConfig(**latent, latent_visits=visits).resolve())
    ckpt.check_compatible(path, run)
    assert "model.latent_visits" not in _differences(path, run, ("model",))[1]
    with pytest.raises(ckpt.CheckpointError, match=r"model.latent_visits=\[1, 2\] in the "
                                                   r"checkpoint, \[2\] now"):
        ckpt.check_compatible(path, RunConfig(model=ModelConfig(**latent, latent_visits=[2])))


def ckpt_model(path) -> ModelConfig:
    from megaloop.config import from_dict

    return from_dict(ModelConfig, ckpt.saved_config(path)["model"])


def test_dp_reshardable_optimizer_state_resumes_only_into_its_own_layout(tmp_path):
    import dataclasses

    from megaloop.config import ParallelConfig

    path = tmp_path / "iter_0000001"
    path.mkdir()
    model = ModelConfig(arch="asymloop", num_layers=4, iterations=2, vocab_size=128).resolve()
    saved = RunConfig(model=model, parallel=ParallelConfig(pipeline=2))
    save_yaml(saved, path / "config.yaml")
    ckpt.check_optimizer_state(path, saved)  # the same layout; more data-parallel ranks are fine
    other = dataclasses.replace(saved, parallel=ParallelConfig(pipeline=2, virtual_pipeline=2))
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_optimizer_state(path, other)
    assert one_line(error).endswith(
        "holds distributed-optimizer state in checkpoint.optimizer_format=dp_reshardable, which "
        "reloads only into its own tensor/pipeline layout (parallel.tensor=1, pipeline=2, "
        "virtual_pipeline=1, pipeline_split=[]); resume with that layout, or set "
        "checkpoint.load_optimizer=false to start from its weights")
    # Another split of the same pipeline size moves weights between ranks too.
    resplit = dataclasses.replace(saved, parallel=ParallelConfig(pipeline=2, pipeline_split=[2, 4]))
    with pytest.raises(ckpt.CheckpointError):
        ckpt.check_optimizer_state(path, resplit)
    weights_only = dataclasses.replace(other, checkpoint=dataclasses.replace(
        other.checkpoint, load_optimizer=False))
    ckpt.check_optimizer_state(path, weights_only)
    # The run's own checkpoints always load their optimizer state, whatever load_optimizer says
    # (before the fix this passed, and megatron-core failed on a shape mismatch or not at all).
    own = dataclasses.replace(weights_only, checkpoint=dataclasses.replace(
        weights_only.checkpoint, dir=str(tmp_path)))
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_optimizer_state(path, own)
    assert one_line(error).endswith(
        "resume with that layout, or start a new run from its weights (checkpoint.load="
        f"{str(path)!r}, checkpoint.load_optimizer=false, another checkpoint.dir)")


def _saved_moe(tmp_path, **train) -> RunConfig:
    from megaloop.config import ParallelConfig, TrainConfig

    path = tmp_path / "iter_0000001"
    path.mkdir()
    model = ModelConfig(arch="asymloop", num_layers=4, vocab_size=128, num_experts=4,
                        moe_ffn_hidden_size=32).resolve()
    saved = RunConfig(model=model, parallel=ParallelConfig(expert=2), train=TrainConfig(**train))
    save_yaml(saved, path / "config.yaml")
    return saved


@pytest.mark.parametrize("optimizer_format", ["dp_reshardable", "fully_reshardable"])
def test_optimizer_state_resumes_only_into_its_own_expert_parallel_size(tmp_path,
                                                                         optimizer_format):
    import dataclasses

    saved = _saved_moe(tmp_path)
    saved.checkpoint.optimizer_format = optimizer_format
    path = tmp_path / "iter_0000001"
    save_yaml(saved, path / "config.yaml")
    ckpt.check_optimizer_state(path, saved)
    other = dataclasses.replace(saved, parallel=dataclasses.replace(saved.parallel, expert=4))
    # Before the fix: megatron-core's 10 kB key list (dp_reshardable) or KeyError 'step'.
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_optimizer_state(path, other)
    assert one_line(error) == (
        f"{path} holds the optimizer state of parallel.expert=2, which megatron-core does not "
        "reload into parallel.expert=4; resume with 2, or set checkpoint.load_optimizer=false to "
        "start from its weights")
    ckpt.check_optimizer_state(path, dataclasses.replace(other, checkpoint=dataclasses.replace(
        other.checkpoint, load_optimizer=False)))


@pytest.mark.parametrize("distributed", [True, False])
def test_optimizer_state_of_the_other_optimizer_kind_is_refused(tmp_path, distributed):
    import dataclasses

    saved = _saved_moe(tmp_path, distributed_optimizer=distributed)
    path = tmp_path / "iter_0000001"
    now = dataclasses.replace(saved, train=dataclasses.replace(
        saved.train, distributed_optimizer=not distributed))
    # Before the fix: megatron-core's KeyError 'pre_wd_mult' traceback, or a 10 kB key list.
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_optimizer_state(path, now)
    assert one_line(error) == (
        f"{path} holds the optimizer state of train.distributed_optimizer={distributed}, which "
        f"does not load into train.distributed_optimizer={not distributed}; resume with "
        f"{distributed}, or set checkpoint.load_optimizer=false to start from its weights")
    ckpt.check_optimizer_state(path, dataclasses.replace(now, checkpoint=dataclasses.replace(
        now.checkpoint, load_optimizer=False)))


def test_a_precision_that_recasts_dp_reshardable_buckets_is_refused_naming_it(mcore, tmp_path,
                                                                            pattern_data):
    """megatron-core keys dp_reshardable state by its buckets' dtypes as well as their sizes.
    Before: "of [[N]] elements ..., where this run cuts [[N]]" (the same sizes), blaming the
    data-parallel size or the versions for what train.precision changed."""
    from megaloop.config import ConfigError
    from megaloop.training.trainer import Trainer
    from tests.training.conftest import tiny_run

    Trainer(tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 1})).train()
    with pytest.raises(ConfigError) as error:
        Trainer(tiny_run(pattern_data, tmp_path / "run",
                         train={"train_steps": 2, "precision": "bf16"}))
    line = one_line(error)
    assert line.startswith("train.precision='bf16': differs from 'auto' in "), line
    assert line.endswith("(its buckets hold float32 weights with float32 gradients, this run's "
                         "bfloat16 weights with float32 gradients)); set it back, or start a new "
                         "run"), line


def test_a_precision_spelt_otherwise_is_not_named_for_buckets_cut_anew(mcore, tmp_path,
                                                                      pattern_data):
    """train.precision=fp32 for 'auto' on CPU holds the buckets in the same dtypes: the refusal
    names what cut them anew, not it. Before: train.precision was named beside them."""
    from megaloop.config import ConfigError
    from megaloop.training.trainer import Trainer
    from tests.training.conftest import tiny_run

    Trainer(tiny_run(pattern_data, tmp_path / "run", train={"train_steps": 1})).train()
    with pytest.raises(ConfigError) as error:
        Trainer(tiny_run(pattern_data, tmp_path / "run",
                         train={"train_steps": 2, "precision": "fp32"},
                         parallel={"overlap_grad_reduce": True, "ddp_bucket_size": 2000}))
    line = one_line(error)
    assert line.startswith("parallel.overlap_grad_reduce=True, parallel.ddp_bucket_size=2000: "
                           "differs from False, 0 in "), line
