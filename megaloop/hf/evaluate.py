"""The LM Evaluation Harness (lm-eval) on megaloop models: local task files, offline, in process.

    model, tokenizer, info = load_for_evaluation("runs/asym/checkpoints", workdir)
    rows = evaluate(model, tokenizer, ["asymloop_tasks"], data_dir="/data/eval",
                    num_fewshot=(0, 5), depths=(None, 6))
    write_results(rows, "results/asym", info)        # results/asym.md and results/asym.json

The model is a Hugging Face model in memory wrapped in lm-eval's ``HFLM``: megaloop's reference model
(a remote-code export, or ``megaloop.models.export.to_reference`` of a canonical model) or the
native transformers class a Dense model exports as. ``load_for_evaluation`` reads a megaloop
checkpoint through a temporary export (which checks probe logits against the checkpoint) or a
Hugging Face directory (megaloop exports into megaloop's own classes: the directory's Python files
are never run).

Tasks are the lm-eval task YAMLs of examples/eval (``TASK_DIR``), read by lm-eval's TaskManager
without its built-in tasks; each reads its records from the data directory given here (task
metadata ``data_dir``: see examples/eval/local_files.py), so nothing is downloaded. A task is named
as in its YAML (``local_piqa``), by its short name (``piqa``) or by a tag that names several
(``asymloop_tasks``: the AsymLoop paper's seven; ``latentloop_tasks``: the LatentLoop paper's).

Test-time depth: each depth in ``depths`` sets the reference model's ``config.iterations`` (K, R or
visits) for its pass over the tasks; None keeps the configured one.

A row per (task, shots, depth) holds lm-eval's metrics under their names (``acc``, ``acc_norm``,
``perplexity``; a filtered metric as ``exact_match_strict-match``) and ``score``, the value of
``metric``: ``acc`` where the task has it, else its first metric; ``requests`` counts the task's
requests and ``truncated`` those longer than the model's context, which lm-eval cuts from the left.
The table's mean is the unweighted mean of the scores.
"""

from __future__ import annotations

import collections
import json
import logging
import math
from pathlib import Path
from typing import Sequence

TASK_DIR = Path(__file__).resolve().parents[2] / "examples" / "eval"
TASK_PREFIX = "local_"
# lm-eval HFLM's max_gen_toks: the new tokens of a generation task whose settings name none.
DEFAULT_GEN_TOKS = 256


class EvaluationError(ValueError):
    """Bad input to an evaluation (task, data, depth, model, tokenizer); one line naming it."""


def quiet_harness() -> None:
    """lm-eval logs every task's set-up at INFO and warns about ``limit`` and in-memory models."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def task_manager(data_dir: str | Path, task_dir: str | Path = TASK_DIR):
    """lm-eval's TaskManager over ``task_dir`` only, its tasks reading from ``data_dir``."""
    from lm_eval.tasks import TaskManager

    data_dir, task_dir = Path(data_dir), Path(task_dir)
    for what, path in (("data directory", data_dir), ("task directory", task_dir)):
        if not path.is_dir():
            raise EvaluationError(f"{path}: no such {what}")
    return TaskManager(include_path=str(task_dir), include_defaults=False,
                       metadata={"data_dir": str(data_dir.resolve())})


def resolve_tasks(names: Sequence[str], manager) -> list[str]:
    """lm-eval names (tasks and tags) of ``names``, short names given their prefix; each task's
    files are read once here, so that a missing or unreadable file fails before the model runs."""
    known, resolved = set(manager.all_tasks), []
    for name in names:
        full = TASK_PREFIX + name if TASK_PREFIX + name in known else name
        if full not in known:
            choices = sorted(n.removeprefix(TASK_PREFIX) for n in manager.all_subtasks)
            raise EvaluationError(f"task {name!r}: not in the task directory (tasks: "
                                  f"{', '.join(choices)}; tags: {', '.join(manager.all_tags)})")
        if full not in resolved:
            resolved.append(full)
    try:
        manager.load(resolved)
    except (OSError, ValueError) as e:
        raise EvaluationError(f"task data: {_one_line(e)}") from None
    return resolved


def prepare_tasks(tasks: Sequence[str], data_dir: str | Path, task_dir: str | Path = TASK_DIR,
                  num_fewshot: Sequence[int] = (0,), max_gen_toks: int | None = None):
    """(TaskManager, lm-eval names, {generation task: its generation settings}) of ``tasks``:
    everything about them that can be wrong (directories, names, data files, few-shot records,
    ``max_gen_toks`` without a generation task) an EvaluationError found here, before a model is
    loaded or exported."""
    quiet_harness()
    manager = task_manager(data_dir, task_dir)
    names = resolve_tasks(tasks, manager)
    new_tokens = {} if max_gen_toks is None else {"max_gen_toks": max_gen_toks}
    generation = {}
    for name, task in manager.load(names)["tasks"].items():
        check_fewshot(name, task, max(num_fewshot))
        if task.config.output_type == "generate_until":
            generation[name] = {**(task.config.generation_kwargs or {}), **new_tokens}
    if max_gen_toks is not None and not generation:
        raise EvaluationError(f"max_gen_toks {max_gen_toks}: none of the tasks generates text "
                              "(it sets the new tokens of a generation task, e.g. gsm8k)")
    return manager, names, generation


def check_fewshot(name: str, task, shots: int) -> None:
    """Task ``name``'s few-shot records hold ``shots`` examples besides the question being asked
    (lm-eval leaves it out): an EvaluationError naming the file where they do not, where lm-eval
    would fail with a bare 'Sample larger than population'."""
    if shots == 0:
        return
    split = task.config.fewshot_split
    same = split == task.config.test_split
    have = len(task.fewshot_docs())
    if have < shots + same:
        file = (task.config.dataset_kwargs or {}).get("data_files", {}).get(split, split)
        raise EvaluationError(f"num_fewshot {shots}: task {name.removeprefix(TASK_PREFIX)} "
                              f"draws its examples from {file}, which holds {have} records "
                              f"({shots + same} needed"
                              f"{', the question itself left out' if same else ''})")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _refused_depth(depth: int | None, arch: str | None, iterations: int | None) -> str | None:
    """ModelConfig.depth_refusal of a model of megaloop ``arch`` configured with ``iterations``;
    a native transformers class (``arch`` None) is a Dense export. None where ``depth`` is None."""
    from megaloop.config import ModelConfig

    if depth is None:
        return None
    return ModelConfig(arch=arch or "dense", iterations=iterations).depth_refusal(depth)


def set_depth(model, depth: int | None) -> int | None:
    """Sets ``model``'s test-time depth (None: leave it); returns the depth it now runs."""
    from megaloop.hf.from_hf import MEGALOOP_MODEL_TYPES

    config = model.config
    arch = config.arch if config.model_type in MEGALOOP_MODEL_TYPES else None
    problem = _refused_depth(depth, arch, getattr(config, "iterations", None))
    if problem:
        raise EvaluationError(f"depth {depth}: {type(model).__name__} "
                              f"(model_type={config.model_type}): {problem}")
    looped = arch not in (None, "dense")
    if depth is not None and looped:
        config.iterations = depth
    return config.iterations if looped else None


def check_depths(source: str | Path, depths: Sequence[int]) -> None:
    """``--depths`` checked against the architecture that ``source`` (a megaloop checkpoint or a
    Hugging Face directory, as ``load_for_evaluation`` takes) names in its config, before any
    export or load: an EvaluationError naming the flag and the architecture."""
    from megaloop.config import ModelConfig
    from megaloop.hf.checkpoint import checkpoint_path
    from megaloop.hf.from_hf import read_config
    from megaloop.training.checkpoint import saved_section

    config_file = Path(source) / "config.json"
    if config_file.is_file():  # read as an import reads it: the same one-line errors
        hf, cfg, _, _ = read_config(Path(source))
        name = f"{config_file} (model_type={hf.model_type})"
    else:
        path = checkpoint_path(source)
        cfg, name = saved_section(path, ModelConfig, "model"), str(path)
    for depth in depths:
        problem = _refused_depth(depth, cfg.arch, cfg.iterations)
        if problem:
            raise EvaluationError(f"--depths {depth}: {name}: {problem}")


def new_tokens(gen_kwargs: dict, task: str, context: int, default: int = DEFAULT_GEN_TOKS,
               setting: str = "--max-gen-toks") -> int:
    """The tokens generation settings ``gen_kwargs`` of ``task`` generate, at most (``default``
    where they name none); an EvaluationError, naming ``setting`` as the way out, where they leave
    no room for a prompt in a model's ``context``-token context."""
    from lm_eval.models.utils import normalize_gen_kwargs

    tokens = normalize_gen_kwargs(dict(gen_kwargs), default)["max_gen_toks"]
    if tokens >= context:
        raise EvaluationError(
            f"max_gen_toks {tokens} (task {task.removeprefix(TASK_PREFIX)}): leaves no room for "
            f"a prompt in the model's {context}-token context; set a smaller {setting}")
    return tokens


def harness_model(model, tokenizer, batch_size: int = 8):
    """lm-eval's HFLM around an in-memory model (its device and dtype are the model's). Its
    generation never chooses the embedding rows past the tokenizer, as an export's
    generation_config.json says (megaloop.hf.tokenizer.untokenized_ids), whatever the model's
    generation config holds (training's downstream evaluation passes ``to_reference(model)``)."""
    from lm_eval.models.huggingface import HFLM

    from megaloop.hf.tokenizer import untokenized_ids

    untokenized = untokenized_ids(tokenizer, model.config.vocab_size)

    class CheckedHFLM(HFLM):
        """HFLM whose too-long continuations are an EvaluationError naming the text: HFLM only
        asserts (a bare AssertionError) when a continuation does not fit the model's context.
        It counts, per task, the requests (``sent``) and those longer than the model's context
        (``cut``), which HFLM cuts from the left and only logs."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sent, self.cut = collections.Counter(), collections.Counter()
            self._cut_pairs = set()

        def loglikelihood(self, requests, *args, **kwargs):
            self._cut_pairs.clear()
            results = super().loglikelihood(requests, *args, **kwargs)
            for request in requests:
                self.sent[request.task_name] += 1
                self.cut[request.task_name] += tuple(request.args) in self._cut_pairs
            return results

        def _loglikelihood_tokens(self, requests, *args, **kwargs):
            for key, context, continuation in requests:
                if len(continuation) > self.max_length:
                    text = key[1] if isinstance(key, tuple) else key
                    raise EvaluationError(
                        f"a continuation of {len(continuation)} tokens does not fit the model's "
                        f"{self.max_length}-token context ({str(text)[:40]!r}...); evaluate a "
                        f"model with a longer seq_length or leave that task out")
                fed = len(context) + len(continuation) - 1  # the last token is not fed
                if isinstance(key, tuple) and fed > self.max_length:
                    self._cut_pairs.add(key)
            # HFLM (lm-eval 0.4.13, logits_cache) scores requests of the same context +
            # continuation[:-1] from one forward, the longest continuation's, but gathers a
            # shorter continuation's log-probabilities from the leading positions of those
            # logits, not the trailing ones: requests that split one text at different points
            # (Winogrande's twins can; rolling windows of repeated text do) got plausible, wrong
            # scores. Those are scored without the grouping, the rest with it.
            lengths = collections.defaultdict(set)
            for _, context, continuation in requests:
                lengths[tuple(context + continuation[:-1])].add(len(continuation))
            apart = [len(lengths[tuple(context + continuation[:-1])]) > 1
                     for _, context, continuation in requests]
            results = [None] * len(requests)
            grouping = self.logits_cache
            for alone in (False, True):
                indices = [i for i, flag in enumerate(apart) if flag == alone]
                if not indices:
                    continue
                self.logits_cache = grouping and not alone
                try:
                    scored = super()._loglikelihood_tokens([requests[i] for i in indices],
                                                           *args, **kwargs)
                finally:
                    self.logits_cache = grouping
                for i, result in zip(indices, scored):
                    results[i] = result
            return results

        def new_tokens(self, gen_kwargs: dict, task: str) -> int:
            return new_tokens(gen_kwargs, task, self.max_length, self.max_gen_toks)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            if untokenized:
                generation_kwargs.setdefault("suppress_tokens", untokenized)
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

        def generate_until(self, requests, *args, **kwargs):
            """HFLM only asserts (a bare AssertionError) when the new tokens leave no room for a
            prompt in the model's context."""
            for request in requests:
                context, gen_kwargs = request.args
                new_tokens = self.new_tokens(gen_kwargs, request.task_name)
                self.sent[request.task_name] += 1
                self.cut[request.task_name] += \
                    len(self.tok_encode(context)) > self.max_length - new_tokens
            return super().generate_until(requests, *args, **kwargs)

    return CheckedHFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=batch_size)


def run_harness(lm, tasks: Sequence[str], manager, *, num_fewshot: int, limit: int | None,
                log_samples: bool = False, gen_kwargs: dict | None = None) -> dict:
    """lm-eval's ``simple_evaluate`` results (seeded as lm-eval seeds by default).
    ``gen_kwargs`` update the generation tasks' settings (e.g. ``max_gen_toks``)."""
    from lm_eval import simple_evaluate

    # No standard errors: lm-eval bootstraps some of them in a fork()ed multiprocessing pool, and a
    # fork of a process that already runs threads (torch, gloo/NCCL: a training run evaluating
    # its checkpoints, a test session) can deadlock in the child, hanging the evaluation forever.
    return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                           task_manager=manager, log_samples=log_samples, bootstrap_iters=0,
                           gen_kwargs=gen_kwargs)


def result_rows(results: dict, num_fewshot: int, iterations: int | None, lm=None) -> list[dict]:
    """One row per task of a ``simple_evaluate`` result; with ``lm`` (the ``harness_model`` that
    ran it), its requests and those cut to the model's context (``requests``, ``truncated``)."""
    rows = []
    for task, values in results["results"].items():
        metrics = {}
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or isinstance(value, str):  # name, alias; "N/A" standard errors
                continue
            metrics[metric if kind == "none" else f"{metric}_{kind}"] = float(value)
        if not metrics:
            continue
        metric = "acc" if "acc" in metrics else next(iter(metrics))
        counts = {} if lm is None else {"requests": lm.sent[task], "truncated": lm.cut[task]}
        rows.append({"task": task.removeprefix(TASK_PREFIX), "num_fewshot": num_fewshot,
                     "iterations": iterations,
                     "samples": results["n-samples"][task]["effective"],
                     "metric": metric, "score": metrics[metric], **counts, **metrics})
    return rows


def evaluate(model, tokenizer, tasks: Sequence[str], *, data_dir: str | Path,
             task_dir: str | Path = TASK_DIR, num_fewshot: Sequence[int] = (0,),
             depths: Sequence[int | None] = (None,), limit: int | None = None,
             batch_size: int = 8, max_gen_toks: int | None = None) -> list[dict]:
    """Rows of ``tasks`` at every (shots, depth), each setting once however often it is given.
    The model's configured depth is restored. ``max_gen_toks``: new tokens of the generation
    tasks (None: each task's own)."""
    quiet_harness()
    num_fewshot, depths = list(dict.fromkeys(num_fewshot)), list(dict.fromkeys(depths))
    for name, value in (("limit", limit), ("max_gen_toks", max_gen_toks)):
        if value is not None and value < 1:
            raise EvaluationError(f"{name} {value}: must be >= 1")
    if any(n < 0 for n in num_fewshot):
        raise EvaluationError(f"num_fewshot {list(num_fewshot)}: must be >= 0")
    configured = getattr(model.config, "iterations", None)
    for depth in depths:  # every depth checked before the first one runs
        set_depth(model, depth)
    if configured is not None:
        model.config.iterations = configured
    manager, names, generation = prepare_tasks(tasks, data_dir, task_dir, num_fewshot,
                                               max_gen_toks)
    lm = harness_model(model, tokenizer, batch_size)
    for name, settings in generation.items():
        lm.new_tokens(settings, name)
    gen_kwargs = None if max_gen_toks is None else {"max_gen_toks": max_gen_toks}
    rows = []
    try:
        for depth in depths:
            iterations = set_depth(model, depth)
            for shots in num_fewshot:
                lm.sent.clear()
                lm.cut.clear()
                results = run_harness(lm, names, manager, num_fewshot=shots, limit=limit,
                                      gen_kwargs=gen_kwargs)
                rows += result_rows(results, shots, iterations, lm)
    finally:
        if configured is not None:
            model.config.iterations = configured
    return rows


# ------------------------------------------------------------------------------ models
def load_for_evaluation(source: str | Path, workdir: str | Path, *,
                        tokenizer: str | None = None):
    """(model in fp32, Hugging Face tokenizer, description) of a megaloop checkpoint (exported
    into ``workdir`` first, with the run's tokenizer or the tokenizer file ``tokenizer``) or of a
    Hugging Face directory (with its own tokenizer files)."""
    import torch
    from transformers import AutoTokenizer

    from megaloop.hf.from_hf import load_hf_model

    source = Path(source)
    info = {"source": str(source)}
    if (source / "config.json").is_file():
        if tokenizer is not None:
            raise EvaluationError(f"--tokenizer {tokenizer}: only for a megaloop checkpoint; the "
                                  f"Hugging Face directory {source} brings its own")
        directory = source
    else:
        directory = _export(source, Path(workdir) / "hf", tokenizer, info)
    model, _, family = load_hf_model(directory)
    if torch.cuda.is_available():
        model.cuda()
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise EvaluationError(f"{directory}: no usable tokenizer files ({_one_line(e)})") from None
    info.update({"class": type(model).__name__, "native_family": family,
                 "iterations": getattr(model.config, "iterations", None)})
    return model, hf_tokenizer, info


def _export(checkpoint: Path, out: Path, tokenizer: str | None, info: dict) -> Path:
    from megaloop.hf.checkpoint import checkpoint_path
    from megaloop.hf.to_hf import export_checkpoint
    from megaloop.training.checkpoint import saved_config

    path = checkpoint_path(checkpoint)
    run_tokenizer = saved_config(path).get("data", {}).get("tokenizer_model")
    if tokenizer is None and run_tokenizer is None:
        raise EvaluationError(f"{path}: its run names no tokenizer (data.tokenizer_model); "
                              "pass --tokenizer")
    if not Path(tokenizer or run_tokenizer).exists():  # the export would advise --no-tokenizer
        source = "--tokenizer" if tokenizer else "the run's data.tokenizer_model"
        raise EvaluationError(f"{tokenizer or run_tokenizer}: tokenizer file not found ({source});"
                              " pass --tokenizer PATH")
    report = export_checkpoint(path, out, tokenizer=tokenizer)
    info.update(checkpoint=report["checkpoint"], probe_max_abs_difference=report[
        "probe_max_abs_difference"])
    return out


# ------------------------------------------------------------------------------ results
def _percent(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{100 * value:.1f}"


def _setting(shots: int, iterations: int | None) -> str:
    return f"{shots}-shot" + ("" if iterations is None else f", K={iterations}")


def markdown_table(rows: list[dict]) -> str:
    """Tasks down, (shots, depth) across: each task's score in %, then their mean; under it, the
    settings whose requests were longer than the model's context (cut from the left)."""
    settings = list(dict.fromkeys((r["num_fewshot"], r["iterations"]) for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = {(r["task"], r["num_fewshot"], r["iterations"]): r for r in rows}
    header = ["task", "metric", "n"] + [_setting(*setting) for setting in settings]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task in tasks:
        first = next(r for r in rows if r["task"] == task)
        values = [_percent(cell[(task, *s)]["score"]) if (task, *s) in cell else ""
                  for s in settings]
        lines.append("| " + " | ".join([task, first["metric"], str(first["samples"])] + values)
                     + " |")
    means = []
    for setting in settings:
        scores = [cell[(task, *setting)]["score"] for task in tasks if (task, *setting) in cell]
        means.append(_percent(sum(scores) / len(scores)))
    lines.append("| " + " | ".join([f"mean ({len(tasks)} tasks)", "", ""] + means) + " |")
    cut = [f"{r['task']} {_setting(r['num_fewshot'], r['iterations'])}: {r['truncated']} of "
           f"{r['requests']} requests" for r in rows if r.get("truncated")]
    if cut:
        lines += ["", "Longer than the model's context, cut from the left: " + "; ".join(cut) + "."]
    return "\n".join(lines) + "\n"


def result_files(prefix: str | Path) -> tuple[Path, Path]:
    """(``prefix``.md, ``prefix``.json); an EvaluationError where they cannot be written (a file
    where a directory must be, a directory of their name), to be found before an evaluation
    rather than after it. Nothing is created."""
    from megaloop.cli import unwritable

    given, prefix = str(prefix), Path(prefix)
    if prefix.name in ("", ".."):  # ('', '.', '/': pathlib's with_name fails on them)
        raise EvaluationError(f"--output {given!r}: names a directory, not the prefix of the "
                              "results (PREFIX.md and PREFIX.json); give one such as results/eval")
    files = prefix.with_name(prefix.name + ".md"), prefix.with_name(prefix.name + ".json")
    for file in files:
        problem = unwritable(file)
        if problem:
            raise EvaluationError(f"{file}: cannot be written ({problem}); choose another "
                                  "--output")
    return files


def write_results(rows: list[dict], prefix: str | Path, info: dict) -> tuple[Path, Path]:
    """``prefix``.md (the table) and ``prefix``.json (every metric), each written atomically."""
    import lm_eval

    from megaloop.platform.files import write_text_atomic

    markdown, data = result_files(prefix)
    markdown.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(data, json.dumps({**info, "lm_eval_version": lm_eval.__version__,
                                        "rows": rows}, indent=2) + "\n")
    write_text_atomic(markdown, markdown_table(rows))
    return markdown, data
