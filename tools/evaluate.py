"""Downstream accuracy of a megaloop checkpoint or Hugging Face directory with the LM Evaluation
Harness, on local task files, as a results table (megaloop.hf.evaluate).

    python tools/evaluate.py runs/asym/checkpoints --data-dir /data/eval \\
        --tasks asymloop_tasks latentloop_tasks --num-fewshot 0 5 --depths 3 6 \\
        [--limit 100] [--batch-size 8] [--max-gen-toks 256] [--tokenizer FILE] \\
        [--output eval_results] [--overwrite]

SOURCE: a checkpoint (iter_N) of any parallel layout, a run's checkpoint directory (its latest; or
its ``latest`` pointer), or a Hugging Face directory (an export, or a native Llama/Qwen3/OLMo
2/Mixtral/Qwen3-MoE one). A checkpoint is exported into a temporary directory first (probe logits
checked) with the run's tokenizer or --tokenizer. --tasks: task names of examples/eval (piqa, siqa,
hellaswag, winogrande, arc_easy, arc_challenge, openbookqa, lambada, sciq, mmlu, gsm8k) or tags
(asymloop_tasks: the AsymLoop paper's seven; latentloop_tasks: the LatentLoop paper's eight).
--data-dir holds their files (names in each YAML's data_files). --depths: test-time iterations
(default: the model's); Dense has none to set and LatentLoop only its own iterations (other
values refused before any export).

Writes OUTPUT.md (tasks x settings, score in %, mean) and OUTPUT.json (every metric), atomically,
and prints the table; results already there are refused before the evaluation unless --overwrite.
Exit codes: 0 done, 2 bad input (one line naming the file, task or value) or results that could
not be written at the end (a full disk: the table is printed all the same), 1 the export's probe
logits differ from the checkpoint's, 143 SIGTERM (the temporary export removed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

from megaloop.cli import int_at_least, log_to_stderr, quiet_third_party_warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="megaloop checkpoint or Hugging Face directory")
    parser.add_argument("--data-dir", required=True, help="directory of the tasks' data files")
    parser.add_argument("--tasks", nargs="+", default=["asymloop_tasks"],
                        help="tasks or tags (default: %(default)s)")
    parser.add_argument("--num-fewshot", type=int_at_least(0), nargs="+", default=[0],
                        help="few-shot settings (default: 0)")
    parser.add_argument("--depths", type=int_at_least(1), nargs="+",
                        help="test-time iterations K (default: the model's)")
    parser.add_argument("--limit", type=int_at_least(1),
                        help="the first N records of each task only")
    parser.add_argument("--batch-size", type=int_at_least(1), default=8)
    parser.add_argument("--max-gen-toks", type=int_at_least(1),
                        help="new tokens of generation tasks (gsm8k; default: the task's 256)")
    parser.add_argument("--tokenizer", help="a checkpoint's tokenizer file (default: the run's)")
    parser.add_argument("--task-dir", help="task YAMLs (default: the repository's examples/eval)")
    parser.add_argument("--output", default="eval_results",
                        help="writes OUTPUT.md and OUTPUT.json (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results an earlier evaluation left there (refused "
                             "otherwise)")
    args = parser.parse_args(argv)

    quiet_third_party_warnings()
    log_to_stderr()
    from megaloop.config import ConfigError
    from megaloop.data.tokenizer import TokenizerError
    from megaloop.hf import evaluate as ev
    from megaloop.hf.common import (ConversionError, ProbeMismatch, Terminated,
                                    quiet_transformers, sigterm_as_exit)
    from megaloop.training.checkpoint import CheckpointError

    quiet_transformers()
    try:
        # An unwritable --output fails before the evaluation, as do earlier results there: the
        # default eval_results of every evaluation run in one directory would replace them.
        found = [str(file) for file in ev.result_files(args.output) if os.path.lexists(file)]
        if found and not args.overwrite:
            raise ev.EvaluationError(
                f"--output {args.output}: {' and '.join(found)} exist"
                f"{'s' if len(found) == 1 else ''}; pass --overwrite to replace "
                f"{'it' if len(found) == 1 else 'them'}, or choose another --output")
        ev.check_depths(args.source, args.depths or ())  # and depths the model has not, before
        # the export (minutes for a large checkpoint), as are tasks, data and few-shot records
        ev.prepare_tasks(args.tasks, args.data_dir, args.task_dir or ev.TASK_DIR,
                         args.num_fewshot, args.max_gen_toks)
        # SIGTERM (timeout, a scheduler's limit) removes the temporary export, as large as the
        # model, as it ends the evaluation (its default action left it in the temp directory).
        with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="megaloop-eval-") as workdir, \
                contextlib.redirect_stdout(sys.stderr):  # stdout is the table only
            model, tokenizer, info = ev.load_for_evaluation(args.source, workdir,
                                                            tokenizer=args.tokenizer)
            rows = ev.evaluate(model, tokenizer, args.tasks, data_dir=args.data_dir,
                               task_dir=args.task_dir or ev.TASK_DIR,
                               num_fewshot=args.num_fewshot, depths=args.depths or [None],
                               limit=args.limit, batch_size=args.batch_size,
                               max_gen_toks=args.max_gen_toks)
        info.update(data_dir=args.data_dir, limit=args.limit, max_gen_toks=args.max_gen_toks)
        try:
            markdown, _ = ev.write_results(rows, args.output, info)
        except OSError as e:  # a full disk, say: the evaluation's table is printed all the same
            print(ev.markdown_table(rows), end="")
            print(f"error: --output {args.output}: not written ({e.strerror or e})",
                  file=sys.stderr)
            return 2
    except (ev.EvaluationError, ConversionError, CheckpointError, ConfigError,
            TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ProbeMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Terminated as e:
        print("error: terminated (SIGTERM): the evaluation stopped, no results written",
              file=sys.stderr)
        return e.code
    print(markdown.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
