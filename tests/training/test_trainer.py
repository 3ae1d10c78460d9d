"""Training behaviour users rely on: learning, exact resume, faults, and the data/config guards."""

import functools
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from megaloop.config import ConfigError
from megaloop.data import DataError
from megaloop.training import checkpoint as ckpt
from megaloop.training.trainer import Trainer, TrainingAborted
from tests.training.conftest import resume_from, tiny_run, train_losses


@pytest.mark.parametrize("arch, iterations, layers", [("dense", 1, 4), ("fullloop", 2, 2),
                                                      ("asymloop", 3, 4)])
def test_loss_falls_for_every_architecture(mcore, pattern_data, tmp_path, arch, iterations, layers):
    cfg = tiny_run(pattern_data, tmp_path, model=dict(arch=arch, iterations=iterations,
                                                      num_layers=layers),
                   train=dict(train_steps=30, lr=1e-2))
    result = Trainer(cfg).train()
    losses = train_losses(tmp_path)
    first, last = (sum(losses[s] for s in steps) / 5 for steps in (range(1, 6), range(26, 31)))
    assert last < 0.75 * first
    assert result["val_loss"] < losses[1]
    assert (tmp_path / "checkpoints" / "iter_0000030").is_dir()


def _straight_then_resumed(rank, world_size, data_prefix, out_dir, model, parallel, train,
                           checkpoint=None):
    """Trains 4 steps saving at 2, then resumes a copy of the step-2 checkpoint elsewhere to
    step 4: (step and samples the resume starts from, losses straight, losses resumed)."""
    import torch.distributed as dist

    out = Path(out_dir)
    checkpoint = checkpoint or {}
    run = functools.partial(tiny_run, data_prefix, model=model, parallel=parallel,
                            train={"train_steps": 4, **train})
    with Trainer(run(out / "straight", checkpoint={"save_interval": 2, **checkpoint})) as straight:
        straight.train()
    if rank == 0:
        resume_from(out / "straight", out / "resumed", 2)
    dist.barrier()
    with Trainer(run(out / "resumed", checkpoint=checkpoint)) as resumed:
        start = (resumed.step, resumed.consumed_samples)
        resumed.train()  # saves at the end
    dist.barrier()  # every rank's metrics written
    return start, train_losses(out / "straight"), train_losses(out / "resumed")


FULL_LOOP = {"arch": "fullloop", "iterations": 2, "num_layers": 4}
INTERLEAVED = {"pipeline": 2, "virtual_pipeline": 2}


# Without the distributed optimizer, megatron-core paired the per-matrix param groups by their
# shared (wd_mult, lr_mult) on load: the Adam state was scrambled and the next save failed.
# PP=2 x VP=2: a pipeline rank holds two tied copies of a decoder layer (Full Loop: layers 1-2 in
# chunks 0 and 2); megatron-core refused their two requests for one piece as overlapping shards.
@pytest.mark.parametrize("model, parallel, train", [
    (None, None, {"distributed_optimizer": True}),
    (None, None, {"distributed_optimizer": False}),
    (FULL_LOOP, INTERLEAVED, {"distributed_optimizer": True}),
    (FULL_LOOP, INTERLEAVED, {"distributed_optimizer": False}),
    ({"iterations": 3}, INTERLEAVED, {"distributed_optimizer": True}),  # AsymLoop E2, K3 x D2
], ids=["distopt", "plain_adam", "fullloop_pp2vp2", "fullloop_pp2vp2_plain_adam",
        "asymloop_pp2vp2"])
def test_resume_reproduces_the_uninterrupted_losses_bit_for_bit(mcore, pattern_data, tmp_path,
                                                                model, parallel, train):
    kwargs = dict(data_prefix=pattern_data, out_dir=str(tmp_path), model=model,
                  parallel=parallel, train=train)
    if parallel:
        from tests.distributed import run_distributed

        outcomes = run_distributed(_straight_then_resumed, world_size=2, **kwargs)
    else:
        outcomes = [_straight_then_resumed(0, 1, **kwargs)]
    for start, a, b in outcomes:
        assert start == (2, 8) and sorted(b) == [3, 4]
        assert [a[s] for s in b] == [b[s] for s in b]


def test_fully_reshardable_state_of_tied_copies_in_two_chunks_resumes_bit_for_bit(
        mcore, pattern_data, tmp_path):
    """DP=2 x PP=2 x VP=2: each rank holds two tied copies of a decoder layer (Full Loop), whose
    fully_reshardable optimizer state is gathered over the data-parallel ranks. Before, torch's
    Adam (no Transformer Engine or Apex) could not load it (megatron-core: KeyError 'step')."""
    from tests.distributed import run_distributed

    outcomes = run_distributed(_straight_then_resumed, world_size=4, data_prefix=pattern_data,
                               out_dir=str(tmp_path), model=FULL_LOOP, parallel=INTERLEAVED,
                               train={"distributed_optimizer": True, "global_batch_size": 8},
                               checkpoint={"optimizer_format": "fully_reshardable"})
    for start, a, b in outcomes:
        assert start == (2, 16) and sorted(b) == [3, 4]
        assert [a[s] for s in b] == [b[s] for s in b]


def test_a_skipped_step_is_said_whatever_the_log_interval(mcore, pattern_data, tmp_path, caplog):
    """A NaN/Inf loss between log_interval's lines was in metrics.jsonl alone: a run that lost
    updates finished, exit 0, without a word of it."""
    trainer = Trainer(tiny_run(pattern_data, tmp_path, train=dict(train_steps=4,
                                                                  log_interval=100)))
    forward = trainer._forward_step

    def nan_at_step_2(data_iterator, model, num_iterations=None):
        output, loss_func = forward(data_iterator, model, num_iterations)
        return (output * float("nan") if trainer.step == 2 else output), loss_func

    trainer._forward_step = nan_at_step_2
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        assert trainer.train()["step"] == 4
    said = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert said == ["step 2: loss nan, update skipped (1 in a row; train.max_nonfinite_steps=5 "
                    "in a row abort the run)"], said


def test_nonfinite_losses_are_skipped_then_abort_keeps_last_good_checkpoint(mcore, pattern_data,
                                                                          tmp_path):
    cfg = tiny_run(pattern_data, tmp_path, train=dict(train_steps=12, max_nonfinite_steps=3),
                   checkpoint=dict(save_interval=2))
    trainer = Trainer(cfg)
    forward = trainer._forward_step
    poisoned = {3, 6, 7, 8}  # one isolated NaN step, then three in a row

    def maybe_nan(data_iterator, model, num_iterations=None):
        output, loss_func = forward(data_iterator, model, num_iterations)
        return (output * float("nan") if trainer.step in poisoned else output), loss_func

    trainer._forward_step = maybe_nan
    weights_before_3 = {}

    def snapshot_at(step):
        if trainer.step == step:
            weights_before_3.update({n: p.detach().clone() for n, p in
                                     trainer.model.named_parameters()})

    original_step = trainer.train_step

    def train_step(data):
        snapshot_at(3)
        result = original_step(data)
        if trainer.step == 3:
            for n, p in trainer.model.named_parameters():
                assert torch.equal(p, weights_before_3[n]), f"{n} changed on a skipped step"
        return result

    trainer.train_step = train_step
    with pytest.raises(TrainingAborted, match=r"3 consecutive steps \(last at step 8\).*"
                                              r"iter_0000004"):
        trainer.train()
    assert trainer.skipped_steps == 4
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000004"
    losses = train_losses(tmp_path)
    assert losses[3] is None and losses[4] is not None and math.isfinite(losses[4])


def test_a_run_that_ends_untrained_or_with_nan_weights_aborts_without_saving(mcore, pattern_data,
                                                                            tmp_path):
    """Before: both exited 0, having saved a checkpoint at train_steps: of the initial weights
    (every step of a run shorter than train.max_nonfinite_steps NaN/Inf), or of NaN weights (an
    update with a NaN gradient under a finite loss, lr=1e30, then fewer NaN steps than the
    limit); and a periodic save kept NaN weights as the last good checkpoint."""
    cfg = tiny_run(pattern_data, tmp_path / "nan", train=dict(train_steps=2))
    trainer = Trainer(cfg)
    forward = trainer._forward_step

    def nan(data_iterator, model, num_iterations=None):
        output, loss_func = forward(data_iterator, model, num_iterations)
        return output * float("nan"), loss_func

    trainer._forward_step = nan
    with pytest.raises(TrainingAborted, match=r"^loss was NaN/Inf for 2 consecutive steps \(last "
                                              r"at step 2\).*last good checkpoint: none$"):
        trainer.train()
    cfg = tiny_run(pattern_data, tmp_path / "lr", train=dict(train_steps=3, lr=1e30))
    with pytest.raises(TrainingAborted, match=r"^the weights are NaN/Inf after step 3; nothing "
                                              "was saved; last good checkpoint: none$"):
        Trainer(cfg).train()
    for run in ("nan", "lr"):
        assert not list((tmp_path / run / "checkpoints").glob("iter_*"))
    # Nor at a periodic save (the NaN gradient is step 2's): later NaN/Inf losses would abort
    # naming it as the last good checkpoint.
    cfg = tiny_run(pattern_data, tmp_path / "saves", train=dict(train_steps=6, lr=1e30),
                   checkpoint=dict(save_interval=1))
    with pytest.raises(TrainingAborted, match=r"^the weights are NaN/Inf after step 2; nothing "
                                              "was saved; last good checkpoint: .*iter_0000001$"):
        Trainer(cfg).train()


def test_resume_with_a_different_architecture_is_a_clear_error(mcore, pattern_data, tmp_path):
    Trainer(tiny_run(pattern_data, tmp_path, train=dict(train_steps=2))).train()
    with pytest.raises(ckpt.CheckpointError, match=r"different architecture: model.hidden_size=32 "
                                                   r"in the checkpoint, 64 now"):
        Trainer(tiny_run(pattern_data, tmp_path, model=dict(hidden_size=64)))
    # Test-time depth is not architecture: a different K resumes.
    Trainer(tiny_run(pattern_data, tmp_path, model=dict(iterations=4))).close()


def test_missing_or_corrupt_data_fails_before_the_model_is_built(mcore, pattern_data, tmp_path,
                                                                  monkeypatch):
    import megaloop.models.model as model_module

    def no_model(*a, **k):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(model_module, "LoopedLM", no_model)
    with pytest.raises(DataError, match=r"missing\.(bin|idx): not found"):
        Trainer(tiny_run(str(tmp_path / "missing"), tmp_path / "run"))
    broken = tmp_path / "broken"
    shutil.copy(pattern_data + ".bin", f"{broken}.bin")
    shutil.copy(pattern_data + ".idx", f"{broken}.idx")
    with open(f"{broken}.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"broken\.bin"):
        Trainer(tiny_run(str(broken), tmp_path / "run"))


@pytest.mark.parametrize("train, module, message", [
    ({"wandb_project": "foo"}, "wandb", r"train.wandb_project='foo' is set but wandb is not "
                                        r"installed \(pip install wandb, or leave "
                                        r"train.wandb_project unset\)"),
    ({"tensorboard": True}, "torch.utils.tensorboard",
     r"train.tensorboard=True needs the tensorboard package \(pip install tensorboard, or set "
     r"train.tensorboard=false\): "),
])
def test_a_missing_logging_package_is_refused_before_set_up(pattern_data, tmp_path, monkeypatch,
                                                             train, module, message):
    """Before the fix: a multi-line RuntimeError from the Monitor, built after the model and the
    checkpoint load (about 30 s into a tiny run)."""
    import sys

    import megaloop.training.trainer as trainer_module

    def no_set_up(*a, **k):
        raise AssertionError("set-up must not begin")

    monkeypatch.setattr(trainer_module, "build_datasets", no_set_up)
    monkeypatch.setitem(sys.modules, module, None)  # its import raises ImportError
    with pytest.raises(ConfigError, match=f"^{message}") as error:
        Trainer(tiny_run(pattern_data, tmp_path / "run", train=train))
    assert "\n" not in str(error.value)


def test_batch_sizes_must_divide(mcore, pattern_data, tmp_path):
    with pytest.raises(ConfigError, match=r"train.global_batch_size=5: must be a multiple of "
                                          r"micro_batch_size=2"):
        Trainer(tiny_run(pattern_data, tmp_path, train=dict(global_batch_size=5)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weights_only_load_trains_from_the_loaded_weights(mcore, pattern_data, tmp_path, precision):
    """In bf16 the optimizer holds fp32 main copies; a weights-only load must refresh them, or
    the first step writes the new run's random initialisation back."""
    with Trainer(tiny_run(pattern_data, tmp_path / "seed", train={"precision": precision})) as seed:
        seed.save()
        seed_weights = {n: p.detach().float().clone() for n, p in seed.model.named_parameters()}
    cfg = tiny_run(pattern_data, tmp_path / "run",
                   train={"precision": precision, "seed": 99, "train_steps": 1},
                   checkpoint={"load": str(tmp_path / "seed" / "checkpoints"),
                               "load_optimizer": False})
    trainer = Trainer(cfg)
    assert trainer.step == 0
    trainer.train()
    lr = cfg.train.lr
    for name, p in trainer.model.named_parameters():
        # One Adam step moves each weight by about lr at most (bf16 rounding aside).
        assert (p.detach().float() - seed_weights[name]).abs().max() < 3 * lr, name


def test_a_weights_only_checkpoint_starts_a_run_but_is_no_resume(mcore, pattern_data, tmp_path):
    """What the Hugging Face import writes (megaloop.hf): weights and the model config only."""
    from megaloop.config import RunConfig
    from megaloop.hf.checkpoint import build_single_process_model, save_weights_checkpoint, weights

    cfg = tiny_run(pattern_data, tmp_path / "run", checkpoint={"load": str(tmp_path / "weights")})
    torch.manual_seed(7)  # not the run's seed: weights the run would not draw itself
    source = build_single_process_model(cfg.model)
    save_weights_checkpoint(source, RunConfig(model=cfg.model), tmp_path / "weights")
    with pytest.raises(ckpt.CheckpointError, match=r"iter_0000000: holds model weights only .*; "
                                                   r"set checkpoint.load_optimizer=false"):
        Trainer(cfg)
    cfg.checkpoint.load_optimizer = False
    with Trainer(cfg) as trainer:
        loaded = weights(trainer.model)
    for name, tensor in weights(source).items():
        assert torch.equal(loaded[name], tensor), name


def test_save_keeps_the_checkpoint_just_written_and_never_rewrites_latest(mcore, pattern_data,
                                                                          tmp_path):
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 4},
                   checkpoint={"save_interval": 2, "keep_last": 1})
    Trainer(cfg).train()  # periodic save at 4 and the final save at 4 are one save
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir()
                   if not p.name.startswith("."))
    assert names == ["iter_0000004", "latest"]
    with pytest.raises(ckpt.CheckpointError, match="already the latest checkpoint"):
        ckpt.save_checkpoint(tmp_path / "checkpoints", 4, {}, cfg, keep_last=1)


@pytest.mark.parametrize("evaluations, message", [
    ({"eval_interval": 1}, "train.eval_interval=1 asks for evaluations"),
    ({"eval_depths": [1]}, r"train.eval_depths=\[1\] asks for evaluations")])
def test_a_split_without_validation_data_is_refused_when_evaluations_are_asked_for(
        mcore, pattern_data, tmp_path, evaluations, message):
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 2, **evaluations})
    cfg.data.split = "100,0,0"
    with pytest.raises(ConfigError, match=r"^data.split='100,0,0': gives the validation split no "
                                          rf"data, but {message}; "):
        Trainer(cfg)


def test_a_split_without_validation_data_trains_when_no_evaluation_is_asked_for(
        mcore, pattern_data, tmp_path):
    cfg = tiny_run(pattern_data, tmp_path, train={"train_steps": 2, "eval_interval": 0})
    cfg.data.split = "100,0,0"
    result = Trainer(cfg).train()
    assert result == {"step": 2}
    assert sorted(train_losses(tmp_path)) == [1, 2]


def test_a_failed_set_up_puts_the_signal_handlers_back(mcore, tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(DataError):
        Trainer(tiny_run(str(tmp_path / "missing"), tmp_path / "run"))
    assert signal.getsignal(signal.SIGTERM) is before



def _built_with(rank, world_size, data_prefix, out_dir, lr):
    from pathlib import Path

    try:
        Trainer(tiny_run(data_prefix, Path(out_dir), train={"lr": lr[rank]})).close()
    except ConfigError as e:
        return str(e)
    return None


def test_a_rank_launched_with_another_setting_is_refused_on_every_rank(pattern_data, tmp_path):
    from tests.distributed import run_distributed

    # Before: the two ranks trained at their own learning rates, each replica its own way, and
    # the run exited 0.
    messages = run_distributed(_built_with, world_size=2, data_prefix=pattern_data,
                               out_dir=str(tmp_path), lr=[1e-3, 3e-3])
    assert messages == ["train.lr=0.003 on rank 1 but 0.001 on rank 0: every rank must be "
                        "launched with the same settings"] * 2
