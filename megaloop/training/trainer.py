"""The training loop: megatron-core DDP, distributed optimizer and pipeline schedules around LoopedLM.

Order of set-up (cheap checks first, so that a mistake costs seconds, not a model build):
config validation and the logging packages it asks for -> stop-signal handlers -> process groups
-> run directories (probe writes, run lock) -> resume source (verified) and the checks of a resume
(megaloop.training.resume: a finished run relaunched ends here) -> datasets (bad files and token
ids beyond the vocabulary fail here) -> model -> DDP -> optimizer -> checkpoint load.

One optimizer step (1-based ``step``): micro-batches run through ``get_forward_backward_func``
(gradient accumulation, pipeline schedule), ``finalize_model_grads`` reduces gradients, a non-finite
loss skips the update, the LR multipliers (ALRS) are applied, the optimizer steps and the scheduler
advances. The loss is summed over the global batch's unmasked tokens and megatron-core divides the
gradients by their total count (``calculate_per_token_loss``), so the gradient is that of the
token-weighted mean loss whatever the micro-batch split and however many tokens the loss mask
drops from each micro-batch. SIGTERM / SIGUSR1 (SLURM preemption) make the loop save a checkpoint
and return at the end of the current step, and set-up stop at its next phase boundary (nothing to
save yet); a set-up that does not complete leaves the run directories as it found them. With
``checkpoint.async_save`` a periodic save's write runs in the background (CheckpointSaver): each
step finalizes it once complete on every rank, and every other save, the end and ``close`` wait
for it.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from megaloop.cli import ALIKE_ON_EVERY_RANK
from megaloop.config import RunConfig, flat_settings, micro_batches_per_step, save_yaml, to_dict
from megaloop.training import checkpoint as ckpt
from megaloop.training.checkpoint_state import load_training_state, sharded_state
from megaloop.training.collective import any_rank, collective_device, is_rank0, max_over_ranks
from megaloop.training.data import MicroBatches, build_datasets, data_fingerprint
from megaloop.training.monitor import check_logging_packages
from megaloop.training.profiling import StepProfiler
from megaloop.training.resume import check_bucket_layout, check_resume, resumed_progress
from megaloop.training.run_dir import RunDirs
from megaloop.training.signals import StopSignals

log = logging.getLogger("megaloop.train")


class TrainingAborted(RuntimeError):
    """Training cannot go on; the message says why and which checkpoint is the last good one."""


class StepOutcome(NamedTuple):
    """One optimizer step: the token-weighted mean ``loss``, the base ``lr`` (multiplier 1), the
    ``grad_norm`` (None when ``skipped`` for a non-finite loss) and ``loss_tokens``, the tokens of
    the global batch the loss counts (below the batch's positions where the loss mask drops
    prompts or padding, as in fine-tuning)."""
    loss: float
    lr: float
    grad_norm: float | None
    skipped: bool
    loss_tokens: int


class _StoppedDuringSetUp(Exception):
    """A stop signal was agreed at a set-up phase boundary; the message names the phase done."""


def _precision(cfg: RunConfig) -> str:
    if cfg.train.precision == "fp8":
        from megaloop.platform.fp8 import check_fp8_shapes, check_fp8_support

        check_fp8_support(cfg.train.resolved_fp8_recipe)
        check_fp8_shapes(cfg)
    if cfg.train.precision != "auto":
        return cfg.train.precision
    return "bf16" if torch.cuda.is_available() else "fp32"


class Trainer:
    """``Trainer(cfg).train()`` runs a whole training; ``close()`` (which ``train`` calls) releases
    the run lock, the signal handlers and the monitor of a Trainer used without ``train``, as
    ``with Trainer(cfg) as trainer:`` does (a seed checkpoint: ``trainer.save()``).

    ``stop_signals``: handlers the caller installed earlier (``megaloop-train`` does so before
    importing torch); by default the Trainer installs its own and restores the previous ones when
    it closes. A stop signal during set-up ends it early: the Trainer is then closed,
    ``stopped_during_set_up`` is True and ``train()`` only returns the stop. Finding the run
    finished (its own latest checkpoint at ``train.train_steps``) ends set-up early too:
    ``complete`` is then True, no dataset nor model is built, and ``train()`` (or ``close()``)
    evaluates, saves and logs nothing. Unless metrics.jsonl lacks a final evaluation record (a
    job killed during it, after the last step's periodic save): then ``final_evaluation_due``
    names those missing ("eval", "downstream"), set-up goes on as for a resume, and ``train()``
    makes just those, logs them and returns, saving nothing.
    """

    def __init__(self, cfg: RunConfig, stop_signals: StopSignals | None = None):
        self.cfg = cfg.validate()
        check_logging_packages(cfg.train)
        self.precision = _precision(cfg)
        # Installed before anything slow so that a preemption signal during set-up is remembered,
        # not fatal.
        self._own_signals = stop_signals is None
        self.stop_signals = StopSignals() if stop_signals is None else stop_signals
        self._run_dirs = self.saver = self.monitor = self.alrs = self.downstream = None
        self.profiler = None
        self.step, self.stopped_during_set_up, self.complete, self._closed = 0, False, False, False
        self.final_evaluation_due: tuple[str, ...] = ()
        try:
            self._set_up()
        except BaseException as e:
            if self._run_dirs is not None:
                self._run_dirs.undo()
            self.close()
            if not isinstance(e, _StoppedDuringSetUp):
                raise
            log.warning("stopped by signal %d during set-up, after %s; nothing to save",
                        self.stop_signals.received, e, extra=ALIKE_ON_EVERY_RANK)
            self.stopped_during_set_up = True

    def _set_up(self) -> None:
        from megatron.core import parallel_state as ps

        from megaloop.platform.distributed import init_distributed
        from megaloop.training.optimizer import build_optimizer

        cfg = self.cfg
        self._consecutive_nonfinite = 0
        self._last_saved_step: int | None = None
        par = cfg.parallel
        # A rank launched with another config (a node given another file or override) would
        # train a replica of its own without a word: every setting is compared with rank 0's.
        init_distributed(par.tensor, par.pipeline, par.expert, seed=cfg.train.seed,
                         virtual_pipeline=par.virtual_pipeline, same_settings=flat_settings(cfg),
                         timeout_minutes=par.distributed_timeout_minutes)
        self._stop_point("joining the process group")
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.num_microbatches = micro_batches_per_step(cfg.train, par, self.dp_size)
        self.out_dir = Path(cfg.train.out_dir)
        self.checkpoint_dir = Path(cfg.checkpoint.dir or self.out_dir / "checkpoints")
        self._run_dirs = RunDirs(self.out_dir, self.checkpoint_dir, cfg.data.cache_dir)
        self._run_dirs.prepare()
        self.saver = ckpt.CheckpointSaver(self.checkpoint_dir, cfg, note=self._note_exit)
        self.resume_path = ckpt.resume_source(cfg, self.checkpoint_dir)
        progress = (0, 0)
        if self.resume_path is not None:
            self.complete, missing = check_resume(self.resume_path, cfg)
            self._stop_point(f"verifying {self.resume_path}")
            if self.complete:
                self.step = ckpt.step_of(self.resume_path)
                self.final_evaluation_due = missing
                # Done before the datasets, whose indexes may take minutes to build.
                if not self.final_evaluation_due:
                    return
            progress = resumed_progress(self.resume_path, cfg)
        # Before the datasets: a profile rank the run lacks is refused in seconds, not minutes.
        self.profiler = StepProfiler(cfg, resumed_step=progress[0])
        self.train_data, self.valid_data = build_datasets(cfg, *progress)
        self.data_fingerprint = data_fingerprint(cfg, self.train_data)  # saved with the progress
        self._stop_point("building the datasets")
        if cfg.train.downstream_eval.tasks and (not self.complete
                                                or "downstream" in self.final_evaluation_due):
            from megaloop.training.downstream import DownstreamEval

            self.downstream = DownstreamEval(cfg)
            self._stop_point("setting up the downstream evaluation")

        self._build_model()
        self._stop_point("building the model")
        self.optimizer, self.scheduler, self.lr_multipliers = build_optimizer(
            self.ddps, self.models, cfg)
        self.alrs = self._build_alrs()
        self._stop_point("building the optimizer")
        self.consumed_samples = 0
        self.skipped_steps = 0
        if self.resume_path is not None:
            check_bucket_layout(self.resume_path, cfg, self.optimizer)
            own = load_training_state(self, self.resume_path,
                                      final_evaluation_only=self.complete)
            if own:  # no need to write it again
                self._last_saved_step = self.saver.latest_step = self.step
            self._stop_point(f"loading {self.resume_path}")
        self.monitor = self._build_monitor()
        self.saver.noted()
        # What the next run in out_dir compares its checkpoint.dir with; a finished run keeps the
        # config it trained with.
        if is_rank0() and not self.complete:
            save_yaml(cfg, self.out_dir / "config.yaml")

    def close(self) -> None:
        """Releases what the Trainer holds, once (later calls do nothing): it waits for a
        checkpoint write in flight and finalizes it, puts back the signal handlers it installed
        (after that wait, which a second stop signal may so still cut short), closes the ALRS
        log, the downstream evaluation's tokenizer, the profiler (writing what it traced) and
        the monitor's files, and releases the run lock. Every part is closed whatever another
        raises; the first error is raised then, the others are logged."""
        errors = self._close_parts()
        for error in errors[1:]:
            log.warning("closing the trainer: %s failed too", error)
        if errors:
            raise errors[0]

    def _close_parts(self, failed: bool = False) -> list[BaseException]:
        """``close``'s work; the errors the parts raised. ``failed``: after a failure, maybe of
        this rank alone, so a checkpoint write in flight is abandoned, not finalized."""
        if self._closed:
            return []
        self._closed = True
        closers = [part.abandon if failed else part.close for part in (self.saver,)
                   if part is not None]
        closers += [self.stop_signals.restore] if self._own_signals else []
        closers += [part.close for part in (self.alrs, self.downstream, self.profiler,
                                            self.monitor) if part is not None]
        closers += [self._run_dirs.release] if self._run_dirs is not None else []
        errors = []
        for close in closers:
            try:
                close()
            except BaseException as e:  # noqa: BLE001 - the other parts are closed first
                errors.append(e)
        return errors

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
            return
        # The body failed, maybe on this rank alone: no collective finalize of a write in flight
        # (the other ranks would never join it), and the body's error is the one raised.
        for error in self._close_parts(failed=True):
            log.warning("closing the trainer: %s failed too", error)

    # ------------------------------------------------------------------ set-up
    def _build_model(self) -> None:
        """The model chunks of this rank (one per virtual pipeline stage; one without the
        interleaved schedule), their tied decoder copies made equal, each chunk in megatron-core
        DDP (``ddp.wrap_for_training``)."""
        from megatron.core import parallel_state as ps

        from megaloop.models.model import model_class
        from megaloop.models.pipeline import describe_split, stage_counts
        from megaloop.training.ddp import configure_sync, wrap_for_training
        from megaloop.training.tied import TiedCopies

        cfg, par = self.cfg, self.cfg.parallel
        dtype = torch.float32 if self.precision == "fp32" else torch.bfloat16
        rank = ps.get_pipeline_model_parallel_rank()
        self.models = [model_class(cfg.model)(cfg.model, par, params_dtype=dtype,
                                              fp8=cfg.train.resolved_fp8_recipe,
                                              stage=chunk * par.pipeline + rank)
                       for chunk in range(par.virtual_pipeline)]
        # On the device before anything reads their tensors, as Megatron-LM's get_model moves
        # them: megatron-core's MoE routers and megaloop's local-spec norms are made on the CPU,
        # and the tied copies' first sync below is a collective, which NCCL runs on CUDA only.
        for model in self.models:
            model.to(collective_device())
        self.model = self.models[0]
        if par.pipeline > 1 and dist.get_rank() == 0:
            counts = stage_counts(cfg.model, par)
            for line in describe_split(cfg.model, counts, par.pipeline, self.num_microbatches,
                                       not par.pipeline_split, par.recompute, par.selective_modules):
                log.info("%s", line)
        self.tied = None
        if par.pipeline > 1 or par.virtual_pipeline > 1:
            self.tied = TiedCopies(self.models, par.pipeline,
                                   ps.get_pipeline_model_parallel_group())
            self.tied.sync_weights()
        tied = self.tied.params if self.tied is not None else set()
        self.ddps = [wrap_for_training(model, dtype, cfg.train.distributed_optimizer, par, chunk,
                                       tied) for chunk, model in enumerate(self.models)]
        self.ddp = self.ddps[0]
        configure_sync(self.model.config, self.ddps, self.tied)

    def _build_alrs(self):
        if not self.cfg.train.use_alrs:
            return None
        from megatron.core import parallel_state as ps

        from megaloop.alrs import ALRS
        from megaloop.alrs.log import RUN_LOG

        log_path = self.out_dir / RUN_LOG
        if is_rank0() and not log_path.exists():  # new: a set-up refused later removes it
            self._run_dirs.created(log_path)
        return ALRS(self.models, total_steps=self.cfg.train.train_steps, config=self.cfg.alrs,
                    tp_group=ps.get_tensor_model_parallel_group(),
                    pipeline_group=(ps.get_pipeline_model_parallel_group()
                                    if self.cfg.parallel.pipeline > 1 else None),
                    log_path=log_path)

    def _build_monitor(self):
        from megaloop.models.flops import model_flops_per_token
        from megaloop.training.monitor import Monitor

        train = self.cfg.train
        return Monitor(
            out_dir=self.out_dir, total_steps=train.train_steps,
            tokens_per_step=train.global_batch_size * self.cfg.model.seq_length,
            model_flops_per_token=model_flops_per_token(self.cfg.model),
            world_size=dist.get_world_size(), peak_tflops_per_device=train.peak_tflops,
            precision=self.precision, tensorboard=train.tensorboard,
            wandb_project=train.wandb_project, run_config=to_dict(self.cfg),
            progress=True, log_interval=train.log_interval, is_writer=dist.get_rank() == 0,
            # The first step this process logs: earlier lines of a crashed or previous run at and
            # after it are dropped (a fresh run starts the file over).
            resume_step=self.step + 1,
        )

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator, model, num_iterations: int | None = None):
        batch = next(data_iterator)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
        loss_mask = batch["loss_mask"].to(device).float()
        output = model(tokens, batch["position_ids"].to(device), None, labels=labels,
                       num_iterations=num_iterations, padding_mask=batch.get("padding_mask"))

        def loss_func(per_token_loss):
            total = (per_token_loss.float() * loss_mask).sum()
            count = loss_mask.sum().to(torch.int)
            return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

        return output, loss_func

    def _run_microbatches(self, data: MicroBatches, forward_only: bool,
                          num_iterations: int | None = None) -> tuple[float, int]:
        """The token-weighted mean loss over the global batch and the number of tokens it counts
        (identical on every rank)."""
        from functools import partial

        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megaloop.models.moe import weigh_auxiliary_losses

        if not forward_only and self.model.routing_stats is not None:  # MoE: weigh aux losses
            batches = list(itertools.islice(data, self.num_microbatches))
            weigh_auxiliary_losses(self.models, batches)
            data = iter(batches)
        outputs = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, num_iterations=num_iterations),
            data_iterator=list(itertools.tee(data, len(self.ddps))) if len(self.ddps) > 1
            else data,
            model=self.ddps, num_microbatches=self.num_microbatches,
            micro_batch_size=self.cfg.train.micro_batch_size, forward_only=forward_only,
            **self.schedule_shapes(),
        )
        # Loss sums exist on the last pipeline stage only: reduce them so that every rank (all
        # stages, all data-parallel replicas) agrees on the loss and on whether it is finite.
        totals = torch.zeros(2, device=collective_device())
        for out in outputs:
            totals += out["lm loss"].float().to(totals.device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(totals, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())

    def schedule_shapes(self) -> dict:
        from megaloop.models.pipeline import schedule_shapes

        return schedule_shapes(self.model, self.cfg.model.seq_length, self.cfg.parallel.pipeline,
                               len(self.models))

    def train_step(self, data: MicroBatches) -> StepOutcome:
        """Optimizer step ``self.step`` (1-based, already incremented)."""
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss, loss_tokens = self._run_microbatches(data, forward_only=False)
        base_lr = self.current_lr()
        # ALRS runs on a skipped step too: its analyses and allocations are tied to step numbers,
        # and a skipped step 1 (its only allocation in a short run) would leave every LR uniform.
        if self.alrs is not None:
            self.lr_multipliers.set(self.alrs.step(self.step, base_lr))
        if not math.isfinite(loss):
            self.skipped_steps += 1
            self._consecutive_nonfinite += 1
            return StepOutcome(loss, base_lr, None, True, loss_tokens)
        self._consecutive_nonfinite = 0
        self.lr_multipliers.apply()  # the group LRs of this step, multipliers included
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return StepOutcome(loss, base_lr, grad_norm, False, loss_tokens)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        """Runs to ``train.train_steps`` (or a stop signal); returns the final metrics."""
        if self.stopped_during_set_up:
            return {"step": self.step, "stopped_by_signal": self.stop_signals.received}
        if self.complete and not self.final_evaluation_due:  # relaunched at its last step
            self.close()
            return {"step": self.step, "complete": True}
        cfg = self.cfg.train
        data = MicroBatches(self.train_data, cfg.micro_batch_size, self.dp_rank, self.dp_size,
                            self.consumed_samples, cfg.global_batch_size)
        try:
            if self.stop_requested():  # after the last set-up boundary: nothing new to save
                log.warning("stopped by signal %d before the first step; nothing to save",
                            self.stop_signals.received, extra=ALIKE_ON_EVERY_RANK)
                return {"step": self.step, "stopped_by_signal": self.stop_signals.received}
            first = self.step + 1
            while self.step < cfg.train_steps:
                self.step += 1
                self.profiler.step_begins(self.step)
                start = time.perf_counter()
                outcome = self.train_step(data)
                self.consumed_samples += cfg.global_batch_size
                self.monitor.log_step(self.step, loss=outcome.loss, lr=outcome.lr,
                                      grad_norm=outcome.grad_norm,
                                      step_time_s=time.perf_counter() - start,
                                      skipped=outcome.skipped, loss_tokens=outcome.loss_tokens,
                                      extra=self._routing_metrics())
                if outcome.skipped:  # said whatever train.log_interval: the update is lost
                    log.warning("step %d: loss %s, update skipped (%d in a row; "
                                "train.max_nonfinite_steps=%d in a row abort the run)", self.step,
                                outcome.loss, self._consecutive_nonfinite,
                                cfg.max_nonfinite_steps, extra=ALIKE_ON_EVERY_RANK)
                self.profiler.step_ends(self.step)
                self.saver.poll()  # a background write complete on every rank is finalized
                # Also a run shorter than the limit whose every step was NaN/Inf: it would save
                # untrained weights as trained to train_steps, and exit 0.
                if self._consecutive_nonfinite >= min(cfg.max_nonfinite_steps,
                                                      cfg.train_steps - first + 1):
                    raise TrainingAborted(
                        f"loss was NaN/Inf for {self._consecutive_nonfinite} consecutive steps "
                        f"(last at step {self.step}); updates were skipped and nothing was saved; "
                        f"last good checkpoint: {self._last_good()}")
                # The last step's evaluation is the final one below (with the eval depths).
                if (cfg.eval_interval and self.step % cfg.eval_interval == 0
                        and self.step < cfg.train_steps and self.valid_data is not None):
                    self.monitor.log_eval(self.step, self.evaluate())
                interval = self.cfg.checkpoint.save_interval
                if self.stop_requested():
                    self.profiler.close()  # the steps traced, without the save after them
                    self.save()
                    if self.step < cfg.train_steps:
                        log.warning("stopped by signal %d after step %d; checkpoint saved",
                                    self.stop_signals.received, self.step,
                                    extra=ALIKE_ON_EVERY_RANK)
                        return {"step": self.step,
                                "stopped_by_signal": self.stop_signals.received}
                    # The final evaluation is made now, after the save, rather than left to a
                    # relaunch (which would find it missing), and the run ends as finished.
                    log.warning("signal %d in the last step, %d: checkpoint saved; the final "
                                "evaluation follows (a second signal exits at once)",
                                self.stop_signals.received, self.step, extra=ALIKE_ON_EVERY_RANK)
                # No periodic save inside a NaN/Inf streak: the checkpoint before it stays latest.
                if interval and self.step % interval == 0 and not self._consecutive_nonfinite:
                    # Evaluates the weights of this step now: the save may be in flight, but the
                    # evaluation reads the model, not the checkpoint.
                    if self.save(wait=False) is not None and self.downstream is not None:
                        self.downstream.after_save(self.model, self.step, self.monitor)
            final = {}
            # A finished run relaunched makes only what its metrics.jsonl lacks.
            if not self.complete or "eval" in self.final_evaluation_due:
                final = self.evaluate()
                for depth in cfg.eval_depths:
                    final.update({f"val_loss_k{depth}": v for k, v in
                                  self.evaluate(num_iterations=depth).items() if k == "val_loss"})
            if final:  # empty when the split leaves no validation data
                self.monitor.log_eval(self.step, final)
            self.save()
            if self.downstream is not None:
                self.downstream.after_save(self.model, self.step, self.monitor, final=True)
            return {"step": self.step, **final}
        except BaseException:
            for error in self._close_parts(failed=True):  # the failure is raised
                log.warning("closing the trainer after a failure: %s", error)
            raise
        finally:
            self.close()

    def _routing_metrics(self) -> dict | None:
        """MoE load balance, z-loss and tokens per expert of this step, per application group
        (encoder, iteration 1..K); a collective. None for a dense model."""
        stats = self.model.routing_stats
        return stats.report() if stats is not None else None

    def _weights_finite(self) -> bool:
        """Whether every weight of every rank is finite (a collective)."""
        for ddp in self.ddps:  # all-gathers deferred to the next forward (so before any save)
            ddp.gather_params()
        finite = all(bool(torch.isfinite(p).all()) for m in self.models for p in m.parameters())
        return not any_rank(not finite)

    def current_lr(self) -> float:
        """The base LR (multiplier 1) the next optimizer step will use."""
        return self.scheduler.get_lr(self.optimizer.param_groups[0])

    def evaluate(self, num_iterations: int | None = None) -> dict:
        """Validation cross-entropy and perplexity on the fixed held-out batches."""
        if self.valid_data is None:
            return {}
        for ddp in self.ddps:
            ddp.eval()
        cfg = self.cfg.train
        data = MicroBatches(self.valid_data, cfg.micro_batch_size, self.dp_rank, self.dp_size, 0,
                            cfg.global_batch_size)
        total = 0.0
        with torch.no_grad():
            for _ in range(cfg.eval_iters):
                total += self._run_microbatches(data, forward_only=True,
                                                num_iterations=num_iterations)[0]
        for ddp in self.ddps:
            ddp.train()
        loss = total / cfg.eval_iters
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    # ------------------------------------------------------------------ signals
    def stop_requested(self) -> bool:
        """Agreed by all ranks, since each may have seen the signal at a different moment. A rank
        that has not takes a signal one that has received (the stop is said by rank 0 alone)."""
        signals = self.stop_signals
        received = max_over_ranks(signals.received or 0)
        if received and signals.received is None:
            signals.received = received
        return bool(received)

    def _stop_point(self, done: str) -> None:
        """A set-up phase boundary (collective): a stop signal any rank has received ends set-up
        here on every rank."""
        if self.stop_requested():
            raise _StoppedDuringSetUp(done)

    def _note_exit(self, text: str) -> None:
        """What an exit on a second stop signal leaves (megaloop.training.signals)."""
        self.stop_signals.left_behind = text

    # ------------------------------------------------------------------ checkpoints
    def save(self, wait: bool = True) -> Path | None:
        """Saves a checkpoint of the current step (collective) unless this step is saved already,
        and returns its path (None when already saved). At step 0 it is a seed checkpoint: the
        initial weights, from which runs with other parallel layouts can start identically. With
        checkpoint.async_save and ``wait=False`` (the loop's periodic saves) it returns once the
        write has begun in the background; otherwise once the checkpoint is complete."""
        from megaloop.training.optimizer import materialise_optimizer_state

        path = None
        if self._last_saved_step != self.step:
            if not self._weights_finite():  # an update with a NaN/Inf gradient, finite loss
                raise TrainingAborted(f"the weights are NaN/Inf after step {self.step}; nothing "
                                      f"was saved; last good checkpoint: {self._last_good()}")
            materialise_optimizer_state(self.optimizer)
            path = self.saver.save(self.step, sharded_state(self), wait=False)
            self._last_saved_step = self.step
        if wait:
            self.saver.wait()
        return path

    def _last_good(self) -> Path | str:
        """The checkpoint ``latest`` names once a write in flight is finalized, or "none"."""
        self.saver.wait()
        return ckpt.latest_checkpoint(self.checkpoint_dir) or "none"
