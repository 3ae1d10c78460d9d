"""GSM8K supervised fine-tuning and exact-match evaluation (AsymLoop paper, Appendix H.2).

Fine-tuning (``finetune_config``, run by tools/finetune_gsm8k.py through the ordinary trainer):
the model and tokenizer of a pre-trained checkpoint, its weights loaded without optimizer state
(``checkpoint.load``, ``load_optimizer=false``), ``data.format=sft`` on the GSM8K train file with
the loss on solution tokens only (megaloop.data.sft); a solution is the record's ``answer`` as it
is, ``<<...>>`` calculator annotations and the final ``#### n`` included. ``RECIPE`` holds what
the paper states: AdamW at 1e-4, cosine decay with 10% warmup, global batch 32, context 1024,
6,973 training and 500 development records (``data.split=6973,500,0`` of the 7,473-record train
file), 3 epochs. The paper names no LR floor: the cosine decays to 0. Weight decay, Adam betas
and clipping keep megaloop's defaults. Every field can be overridden.

Evaluation (``evaluate``): greedy decoding without demonstrations, up to 512 new tokens, the prompt
the model was fine-tuned with, exact match of the normalised final number against the reference.
A question whose prompt and new tokens would run past the model's context (``model.seq_length``)
generates only up to it (the prompt is kept whole: cutting the question would change it), is
counted in ``cut_at_context`` and marked ``stopped_at_context``; one warning gives the numbers
before decoding starts. A prompt that fills the context alone is an error naming its record.
Decoding uses the reference model's KV cache by default (megaloop.generation.Cached, which needs
transformers: the ``hf`` extra); ``cached=False`` recomputes the canonical model's full forward at
every step, the reference the cached decoder is tested against.

Answer rules (``extract_answer``):
- the answer is the first number after the first ``####`` of the generation (the format the
  solutions are trained in; text the model adds after its answer is ignored); without ``####``,
  the last number of the generation ("flexible" match; ``strict_accuracy`` counts ``####`` answers
  only); no number at all is wrong;
- a number is an optional sign (``-`` or the Unicode minus), an optional ``$`` on either side of
  the sign, digits with or without thousands commas (``1,234``; ``1,23`` reads as 1) and an
  optional decimal part: ``"#### 1,234"``, ``"$1234.00"`` and ``"1234."`` (a sentence's full stop)
  all give ``1234``; ``-$5`` gives ``-5``; ``0.50`` gives ``0.5``;
- two answers are equal when their decimal values are (``18 == 18.0``); fractions and units are
  not interpreted (``3/4`` reads as 3, then 4).
The reference is the number after ``####`` in the record's ``answer``; a record without one is an
error naming the record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Sequence

from megaloop.cli import with_settings
from megaloop.config import ConfigError, RunConfig, apply_overrides, run_config_from
from megaloop.data.readers import DataError
from megaloop.platform.files import write_text_atomic

log = logging.getLogger("megaloop.gsm8k")

PROMPT = "Question: {question}\nAnswer:"
SOLUTION = "{answer}"
ANSWER_MARK = "####"
MAX_NEW_TOKENS = 512
EPOCHS = 3.0
RECIPE = {
    "model": {"seq_length": 1024},
    "train": {"lr": 1e-4, "global_batch_size": 32, "warmup_fraction": 0.1, "min_lr_ratio": 0.0,
              "eval_iters": 15},  # 15 x 32 = 480 of the 500 development records per evaluation
    "data": {"format": "sft", "split": "6973,500,0", "sft_prompt": PROMPT,
             "sft_solution": SOLUTION},
    "checkpoint": {"load_optimizer": False},
}

_NUMBER = re.compile(r"(?<![\w.,])([-\u2212]?)\$?([-\u2212]?)"
                     r"(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")


def numbers(text: str) -> list[str]:
    """The numbers of ``text`` in order, normalised: no commas, sign, "$" or trailing zeros
    ("-$1,234.50" -> "-1234.5", "1234.00" -> "1234")."""
    found = []
    for sign_before, sign_after, whole, fraction in _NUMBER.findall(text):
        value = Decimal(whole.replace(",", "") + (fraction or ""))
        if (sign_before or sign_after) and value:
            value = -value
        found.append(_canonical(value))
    return found


def _canonical(value: Decimal) -> str:
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def normalize_answer(text: str) -> str | None:
    """The first number of ``text``, normalised; None when it holds none."""
    found = numbers(text)
    return found[0] if found else None


def extract_answer(generation: str) -> tuple[str | None, str | None]:
    """(normalised answer, rule that found it: "####" or "last number") of a generated
    solution; (None, None) when it holds no number, (None, "####") when nothing follows ``####``."""
    head, mark, tail = generation.partition(ANSWER_MARK)
    if mark:
        return normalize_answer(tail), ANSWER_MARK
    found = numbers(head)
    return (found[-1], "last number") if found else (None, None)


def reference_answer(answer: str) -> str | None:
    """The normalised number after ``####`` in a GSM8K ``answer`` field, None without one."""
    _, mark, tail = answer.partition(ANSWER_MARK)
    return normalize_answer(tail) if mark else None


def same_number(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Decimal(a) == Decimal(b)


# ------------------------------------------------------------------------------ fine-tuning
def finetune_config(base_checkpoint: str | os.PathLike, data_files: Sequence[str], out_dir: str,
                    overrides: Sequence[str] = ()) -> RunConfig:
    """The fine-tuning run: the base checkpoint's model and tokenizer, ``RECIPE``, then
    ``overrides`` (``section.field=value``), then ``finetune_settings``; validated.
    ``train.train_steps`` is left for the caller (``steps_for_epochs``)."""
    from megaloop.training import checkpoint as ckpt

    path = ckpt.find_checkpoint(base_checkpoint)
    saved = ckpt.saved_config(path)
    # Tokenised as the base model was trained: its EOD (legacy <EOD> or eos) ends each solution.
    tokenizer = {key: saved.get("data", {}).get(key) for key in ("tokenizer_type",
                                                                 "tokenizer_model",
                                                                 "legacy_tokenizer")}
    run = {"model": {**saved["model"], **RECIPE["model"]}, "train": {**RECIPE["train"]},
           "data": {**RECIPE["data"], **{k: v for k, v in tokenizer.items() if v is not None}},
           "checkpoint": {**RECIPE["checkpoint"]}}
    cfg = apply_overrides(run_config_from(run), list(overrides))
    return with_settings(cfg, finetune_settings(str(path), data_files, out_dir)).validate()


def finetune_settings(checkpoint: str, data_files: Sequence[str], out_dir: str
                      ) -> dict[str, object]:
    """What ``finetune_config`` sets from its arguments (``section.field: value``), after the
    overrides: the base checkpoint's weights, the data, the run directory."""
    return {"checkpoint.load": checkpoint, "data.path": [str(f) for f in data_files],
            "train.out_dir": out_dir}


def resumed_config(cfg: RunConfig, base_checkpoint: str | os.PathLike) -> RunConfig:
    """``cfg`` (``finetune_config``) as the run resumes it, once its checkpoint directory holds
    its checkpoints; a CheckpointError or ConfigError in one line where the trainer's resume
    would refuse it, so that the caller writes nothing for a config the run does not accept.

    ``--base`` naming a base run's directory resolves to its latest checkpoint, which moves on as
    that run trains (and its ``keep_last`` may delete the one this run started from): the run's
    own checkpoints record the base checkpoint it started from, and the resume keeps that
    ``checkpoint.load`` (a resume continues its own checkpoints; it cannot take other weights).
    ``--base`` naming a checkpoint itself is taken as given."""
    from megaloop.training import checkpoint as ckpt
    from megaloop.training.resume import check_resume

    own_dir = Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")
    complete = ckpt.complete_checkpoints(own_dir)
    if not (cfg.checkpoint.resume and complete):
        return cfg
    own = ckpt.choose_own_checkpoint(own_dir, complete, cfg.checkpoint.fallback_to_previous)[0]
    started = (ckpt.saved_config(own).get("checkpoint") or {}).get("load")
    now = Path(cfg.checkpoint.load)
    if started and Path(base_checkpoint).resolve() != now.resolve() and \
            Path(started).parent.resolve() == now.parent.resolve():
        cfg = with_settings(cfg, {"checkpoint.load": started})
    # The trainer's checks of a resume, here before anything is written. The changes they
    # accept are logged by the trainer once it resumes, not twice.
    check_resume(own, cfg, report=False)
    return cfg


def steps_for_epochs(cfg: RunConfig, epochs: float) -> tuple[int, int]:
    """(optimizer steps for ``epochs`` passes over the training records that fit
    ``model.seq_length``, rounded up; that record count)."""
    from megaloop.data.sft import build_sft_datasets
    from megaloop.training.data import text_tokenizer

    if not (epochs > 0 and math.isfinite(epochs)):
        raise ConfigError(f"--epochs {epochs}: must be a positive number")
    train, _, _ = build_sft_datasets(
        cfg.data.path, text_tokenizer(cfg), cfg.model.seq_length, (1, 0, 0),
        split=cfg.data.split, seed=cfg.train.seed, prompt=cfg.data.sft_prompt,
        solution=cfg.data.sft_solution)
    if train is None:
        raise ConfigError(f"data.split={cfg.data.split!r}: gives the training split no records")
    records = len(train.examples)
    return math.ceil(epochs * records / cfg.train.global_batch_size), records


# ------------------------------------------------------------------------------ evaluation
def evaluate(model, tokenizer, records: list[dict[str, str]], *, prompt: str = PROMPT,
             max_new_tokens: int = MAX_NEW_TOKENS, num_iterations: int | None = None,
             source: str = "records", cached: bool = True) -> tuple[dict, list[dict]]:
    """(summary, one prediction per record) of greedy decoding on ``records`` (fields
    ``question``, ``answer`` and whatever ``prompt`` names). Every reference is checked before
    the first generation: a record without ``#### <number>`` raises DataError naming it as
    record n (1-based) of ``source``. ``cached``: decode with the reference model's KV cache
    (megaloop.generation.Cached); False: the canonical model's full forward at every step."""
    from megaloop.generation import Cached, FullForward, greedy_generate

    references = [reference_answer(r["answer"]) for r in records]
    missing = [i for i, ref in enumerate(references) if ref is None]
    if missing:
        raise DataError(f"{source}: record {missing[0] + 1}: its answer has no "
                        f"'{ANSWER_MARK} <number>' to score against "
                        f"(ends {records[missing[0]]['answer'][-40:]!r})")
    prompts = tokenizer.encode_batch([prompt.format_map(r) for r in records])
    if cached:
        from megaloop.models.export import to_reference

        backend = Cached(to_reference(model).to(next(model.parameters()).device), num_iterations)
    else:
        backend = FullForward(model, num_iterations)
    budgets = _budgets(prompts, max_new_tokens, backend.context, source)
    predictions, start = [], time.perf_counter()
    for index, (record, ids, reference, budget) in enumerate(zip(records, prompts, references,
                                                                 budgets)):
        out = greedy_generate(backend, ids, budget, tokenizer.eod, tokenizer.vocab_size)
        text = tokenizer.decode(out.tokens)
        answer, rule = extract_answer(text)
        predictions.append({
            "index": index, "question": record["question"], "reference": reference,
            "generation": text, "prediction": answer, "rule": rule,
            "correct": same_number(answer, reference), "new_tokens": len(out.tokens),
            "stopped_at_eos": out.stopped_at_eos,
            "stopped_at_context": not out.stopped_at_eos and budget < max_new_tokens})
        if (index + 1) % 50 == 0:
            log.info("%d/%d questions, %.1f s", index + 1, len(records),
                     time.perf_counter() - start)
    correct = sum(p["correct"] for p in predictions)
    strict = sum(p["correct"] and p["rule"] == ANSWER_MARK for p in predictions)
    total = len(predictions)
    summary = {"accuracy": correct / total, "strict_accuracy": strict / total,
               "correct": correct, "total": total, "max_new_tokens": max_new_tokens,
               "cut_at_context": sum(b < max_new_tokens for b in budgets),
               "num_iterations": num_iterations or model.cfg.num_iterations,
               "decoder": "cached" if cached else "uncached",
               "seconds": round(time.perf_counter() - start, 2)}
    return summary, predictions


def _budgets(prompts: list[list[int]], max_new_tokens: int, context: int, source: str
             ) -> list[int]:
    """The new tokens each prompt may generate: ``max_new_tokens`` within ``context``. A prompt
    leaving no room is a DataError naming its record; prompts cut short are one warning."""
    full = [i for i, ids in enumerate(prompts) if len(ids) >= context]
    if full:
        raise DataError(f"{source}: record {full[0] + 1}: its prompt of {len(prompts[full[0]])} "
                        f"tokens leaves no room to generate in the model's {context}-token "
                        "context (model.seq_length)")
    budgets = [min(max_new_tokens, context - len(ids)) for ids in prompts]
    cut = [len(ids) for ids, budget in zip(prompts, budgets) if budget < max_new_tokens]
    if cut:
        log.warning("%d of %d questions: the prompt (up to %d tokens) and max_new_tokens=%d run "
                    "past the model's %d-token context (model.seq_length); they generate only "
                    "up to it (summary cut_at_context)", len(cut), len(prompts), max(cut),
                    max_new_tokens, context)
    return budgets


def write_predictions(path: str | os.PathLike, predictions: list[dict]) -> None:
    """JSON lines, written atomically."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(p, ensure_ascii=False) + "\n"
                                    for p in predictions))
