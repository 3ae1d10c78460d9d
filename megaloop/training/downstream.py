"""Downstream accuracy of a run's checkpoints while it trains (AsymLoop paper, Appendix F).

``train.downstream_eval`` (config.DownstreamEvalConfig) names lm-eval tasks of examples/eval and
their data directory. After every ``every``-th periodic checkpoint save, and after the final one,
rank 0 copies the model it trains into megaloop's reference (Hugging Face) model in fp32 on the same
device (megaloop.models.export.to_reference), runs the harness on it (megaloop.hf.evaluate) and
appends one ``kind: downstream`` row per task to metrics.jsonl and TensorBoard; the other ranks
wait at a barrier. The copy is discarded afterwards and every random number generator is put back
as it was, so training continues exactly as it would have without the evaluation (the tests check
that the losses are bit-identical). Saves made on a stop signal are not evaluated: a preempted job
has to exit.

Rank 0 needs the whole model, so this runs with tensor, pipeline and expert parallel size 1 (the
config refuses other layouts; tools/evaluate.py evaluates any checkpoint afterwards). Set-up (the
imports, the run's tokenizer converted to Hugging Face files, the tasks and their data files) is
checked before the model is built; an evaluation that fails later is logged and training goes on.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from megaloop.config import ConfigError, RunConfig
from megaloop.training.collective import is_rank0, rank0_decides
from megaloop.training.rng import preserved_rng

log = logging.getLogger("megaloop.train")


class DownstreamEval:
    """Built by every rank (a collective); ``after_save`` is one too."""

    def __init__(self, cfg: RunConfig):
        self.section, self.save_interval = cfg.train.downstream_eval, cfg.checkpoint.save_interval
        self.evaluated_step = None
        self.tokenizer = None
        self._workdir = None
        rank0_decides(lambda: self._set_up(cfg), (ConfigError,))

    def _set_up(self, cfg: RunConfig) -> None:
        section = self.section
        try:
            from transformers import AutoTokenizer

            from megaloop.hf import evaluate as ev
            from megaloop.hf.common import ConversionError
            from megaloop.hf.tokenizer import write_tokenizer
        except ImportError as e:
            raise ConfigError(f"train.downstream_eval: needs the hf and eval extras ({e})") from None
        try:
            # Everything an evaluation could refuse, refused now rather than logged at every save
            # while training goes on: task names and files, few-shot records, max_gen_toks
            # without a generation task, and new tokens that leave no room for a prompt.
            _, _, generation = ev.prepare_tasks(section.tasks, section.data_dir,
                                                section.task_dir or ev.TASK_DIR,
                                                (section.num_fewshot,), section.max_gen_toks)
            for task, settings in generation.items():
                ev.new_tokens(settings, task, cfg.model.seq_length,
                              setting="train.downstream_eval.max_gen_toks")
            self._workdir = tempfile.TemporaryDirectory(prefix="megaloop-downstream-")
            write_tokenizer(cfg.data.tokenizer_model, Path(self._workdir.name),
                            cfg.model.vocab_size, cfg.data.tokenizer_type,
                            cfg.data.legacy_tokenizer)
            self.tokenizer = AutoTokenizer.from_pretrained(self._workdir.name,
                                                           trust_remote_code=False)
        except (ev.EvaluationError, ConversionError) as e:
            self.close()
            raise ConfigError(f"train.downstream_eval: {e}") from None

    def after_save(self, model, step: int, monitor, final: bool = False) -> None:
        """Evaluates ``model`` (the megatron-core LoopedLM being trained) if this save is due:
        every ``every``-th periodic one, and the final checkpoint unless its step was evaluated.
        Periodic saves are counted by step, so that a resumed run evaluates at those an
        uninterrupted one would."""
        if final:
            due = self.evaluated_step != step
        else:
            due = (step // self.save_interval) % self.section.every == 0
        if not due:
            return
        self.evaluated_step = step
        if is_rank0():
            try:
                rows = self._evaluate(model)
            except Exception:  # noqa: BLE001 - the run matters more than one evaluation
                log.warning("downstream evaluation at step %d failed; training goes on", step,
                            exc_info=True)
                rows = []
            for row in rows:
                metrics = {k: v for k, v in row.items()
                           if k not in ("task", "num_fewshot", "iterations", "metric", "score")}
                monitor.log_downstream(step, row["task"], metrics,
                                       num_fewshot=row["num_fewshot"],
                                       iterations=row["iterations"])
        if dist.is_initialized():
            dist.barrier()

    def _evaluate(self, model) -> list[dict]:
        from megaloop.hf import evaluate as ev
        from megaloop.models.export import to_reference

        section = self.section
        with preserved_rng(), torch.no_grad():
            reference = to_reference(model).to(next(model.parameters()).device)
            return ev.evaluate(reference, self.tokenizer, section.tasks,
                               data_dir=section.data_dir, task_dir=section.task_dir or ev.TASK_DIR,
                               num_fewshot=(section.num_fewshot,), limit=section.limit,
                               batch_size=section.batch_size, max_gen_toks=section.max_gen_toks)

    def close(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
