"""GSM8K exact-match accuracy of a megaloop checkpoint: greedy decoding, normalised final numbers.

    python tools/eval_gsm8k.py runs/asym1b_gsm8k/checkpoints --test gsm8k_test.jsonl \\
        [--max-new-tokens 512] [--num-iterations 6] [--limit 100] [--predictions preds.jsonl]
        [--overwrite] [--uncached]

Prints one JSON object (accuracy, strict_accuracy, correct, total, ...) on stdout and writes one
JSON line per question (reference, generation, extracted prediction, rule, correct) to
``--predictions``, atomically (one already there is refused before decoding unless
``--overwrite``). The prompt is the one the checkpoint was fine-tuned with
(``data.sft_prompt``; megaloop.gsm8k.PROMPT for a checkpoint that was not), the tokenizer its
``data.tokenizer_model`` unless ``--tokenizer`` is given, encoding as its
``data.legacy_tokenizer`` says (a legacy SentencePiece run stops at the ``<EOD>`` id it was trained
with). A ``--tokenizer`` or ``--tokenizer-type`` given while the run's tokenizer is still there
must encode probe texts as the run's file read as its ``data.tokenizer_type`` does (the check
``tools/convert_checkpoint.py to-hf --tokenizer`` makes), one in place of a run's ``data.eod_id``
must end documents with it, and no tokenizer may have ids past the model's ``vocab_size``
embedding rows. ``--predictions`` may not name a ``--test`` file. Decoding runs in this one process, one question at a time,
with the checkpoint's weights in megaloop's reference (Hugging Face) model and its KV cache;
``--uncached`` recomputes the canonical model's full forward at every step instead (the same
tokens, much slower; megaloop.generation). Decoding stays within the model's context (``model.seq_length``):
``--max-new-tokens`` must leave room for a prompt in it (as tools/evaluate.py requires of lm-eval's
``--max-gen-toks``), and a question whose prompt and new tokens run past it generates only up to it
(one warning line; ``cut_at_context`` in the summary). Answer rules are in megaloop.gsm8k.
Exit codes: 0 done, 2 a bad checkpoint, tokenizer, test file or argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megaloop.cli import int_at_least, log_to_stderr, quiet_third_party_warnings, unwritable


def check_tokenizer(tokenizer, given: str | None, tokenizer_type: str, data: dict,
                    vocab_size: int) -> None:
    """Refuses, before the weights are read, a tokenizer that is not the run's: ``given``
    (``--tokenizer``, else the run's own file) read as ``tokenizer_type`` in place of a run's
    ``data.tokenizer_model`` that is still there, read as its ``data.tokenizer_type``, must encode
    as it does (ConversionError, megaloop.hf.tokenizer.check_encodes_like); in place of one that
    is gone, match the data's tokenizer sidecar (``check_against_data``); in place of a run's
    ``data.eod_id`` it must end documents with that id; and ``tokenizer``'s ids must all be rows
    of the model's embedding (ConfigError): else the accuracy would be computed from ids the model
    never learned, or fail at the embedding."""
    from megaloop.config import ConfigError, DataConfig, from_dict
    from megaloop.hf.tokenizer import check_stands_in_for_runs

    run_tokenizer, eod_id = data.get("tokenizer_model"), data.get("eod_id")
    if run_tokenizer is not None:  # ``given`` is None only where the run's was found and read
        check_stands_in_for_runs(given or run_tokenizer, from_dict(DataConfig, data),
                                 tokenizer_type=tokenizer_type)
    if run_tokenizer is None and eod_id is not None and tokenizer.eod != eod_id:
        # A run on pre-tokenized data names only its EOD: decoding would not stop at it.
        raise ConfigError(f"--tokenizer {given}: ends documents with id {tokenizer.eod}, the "
                          f"run's data.eod_id is {eod_id} (not the tokenizer this model was "
                          "trained with)")
    if tokenizer.vocab_size > vocab_size:
        source = f"--tokenizer {given}" if given else f"data.tokenizer_model {run_tokenizer}"
        raise ConfigError(f"{source}: ids up to {tokenizer.vocab_size - 1}, past the model's "
                          f"vocab_size={vocab_size} (not the tokenizer this model was trained "
                          "with)")


def run_tokenizer_type(data: dict) -> str:
    """The data.tokenizer_type the run trained with (its default where its config has none)."""
    from megaloop.config import DataConfig

    return data.get("tokenizer_type") or DataConfig.tokenizer_type


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="an iter_N directory or a run's checkpoint directory")
    parser.add_argument("--test", required=True, nargs="+",
                        help="GSM8K test .jsonl (fields question, answer)")
    parser.add_argument("--tokenizer", help="tokenizer model (default: the checkpoint's)")
    parser.add_argument("--tokenizer-type", help="default: the checkpoint's, or "
                                                 "SentencePieceTokenizer")
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=512)
    parser.add_argument("--num-iterations", type=int_at_least(1),
                        help="test-time depth K (default: the checkpoint's)")
    parser.add_argument("--limit", type=int_at_least(1), help="the first N questions only")
    parser.add_argument("--uncached", action="store_true",
                        help="decode without a KV cache, on the canonical model (the reference)")
    parser.add_argument("--predictions", default="gsm8k_predictions.jsonl",
                        help="output JSON lines (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the --predictions an earlier evaluation left (refused "
                             "otherwise)")
    args = parser.parse_args(argv)

    quiet_third_party_warnings()
    log_to_stderr()
    import megaloop.api as ml
    from megaloop import gsm8k
    from megaloop.config import ConfigError, ModelConfig, template_fields
    from megaloop.data import DataError, TokenizerError, load_tokenizer
    from megaloop.data.sft import read_records
    from megaloop.hf.common import ConversionError
    from megaloop.training import checkpoint as ckpt

    try:
        problem = unwritable(args.predictions)
        if problem is None and any(Path(args.predictions).resolve() == Path(test).resolve()
                                   for test in args.test):
            problem = "it is a --test file, which the predictions would replace"
        if problem is not None:
            raise ConfigError(f"--predictions {args.predictions}: cannot be written ({problem})")
        if os.path.lexists(args.predictions) and not args.overwrite:
            # Before decoding: the default gsm8k_predictions.jsonl of every checkpoint evaluated
            # in one directory would replace the one before.
            raise ConfigError(f"--predictions {args.predictions}: exists; pass --overwrite to "
                              "replace it, or choose another path")
        path = ckpt.find_checkpoint(args.checkpoint)
        saved = ckpt.saved_config(path)
        model_cfg = ckpt.saved_section(path, ModelConfig, "model")
        if args.num_iterations is not None:
            problem = model_cfg.depth_refusal(args.num_iterations)
            if problem:
                raise ConfigError(f"--num-iterations {args.num_iterations}: {path}: {problem}")
        if args.max_new_tokens >= model_cfg.seq_length:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: leaves no room for a "
                              f"prompt in the model's {model_cfg.seq_length}-token context "
                              f"(model.seq_length of {path}); pass a smaller --max-new-tokens")
        data = saved.get("data", {})
        prompt = data.get("sft_prompt") if data.get("format") == "sft" else gsm8k.PROMPT
        tokenizer_model = args.tokenizer or data.get("tokenizer_model")
        if tokenizer_model is None:
            raise ConfigError(f"{path}: its config names no tokenizer; give --tokenizer")
        tokenizer_type = args.tokenizer_type or run_tokenizer_type(data)
        tokenizer = load_tokenizer(tokenizer_type, tokenizer_model,
                                   legacy=bool(data.get("legacy_tokenizer")))
        check_tokenizer(tokenizer, args.tokenizer, tokenizer_type, data, model_cfg.vocab_size)
        fields = tuple(dict.fromkeys(("question", "answer") + template_fields(prompt)))
        records = read_records(args.test, fields)[:args.limit]
        model = ml.load(path)
        summary, predictions = gsm8k.evaluate(
            model, tokenizer, records, prompt=prompt, max_new_tokens=args.max_new_tokens,
            num_iterations=args.num_iterations, source=", ".join(args.test),
            cached=not args.uncached)
    except (ConfigError, ConversionError, DataError, TokenizerError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        gsm8k.write_predictions(args.predictions, predictions)
    except OSError as e:  # e.g. a full disk: the accuracy is still printed
        print(json.dumps({**summary, "checkpoint": str(path), "test": args.test,
                          "predictions": None}))
        print(f"error: --predictions {args.predictions}: not written ({e.strerror or e})",
              file=sys.stderr)
        return 2
    print(json.dumps({**summary, "checkpoint": str(path), "test": args.test,
                      "predictions": args.predictions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
