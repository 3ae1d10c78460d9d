"""Train a SentencePiece tokenizer (BPE or unigram) on the same inputs preprocess_data.py reads.

    python tools/train_tokenizer.py --input data/fineweb-edu/ --output tok.model --vocab-size 32000

Documents are fed line by line (SentencePiece caps a training "sentence" at a few KB and would
drop whole documents), streamed from .jsonl(.gz/.zst), parquet or text via megaloop.data.readers.
The model is written atomically. The report gives the embedding size padded for tensor
parallelism (32000 -> 32128 with --pad-multiple 128); HF tokenizer.json files are for use only.
"""

from __future__ import annotations

import argparse
import os
import sys

from megaloop.cli import float_in, int_at_least, json_keys_refusal
from megaloop.data.preprocess import named_inputs
from megaloop.data.readers import BadRecords, DataError, RecordFilter, expand_inputs, input_notes
from megaloop.data.tokenizer import padded_vocab_size
from megaloop.data.tokenizer_training import EmptyCorpus, document_lines, train_sentencepiece


# SentencePiece's own bounds of --character-coverage, which it reports as an internal check
# ("INTERNAL: ... trainer_interface.cc(94) [trainer_spec.character_coverage() >= 0.98 && ...]")
# naming no flag.
COVERAGE = (0.98, 1.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, nargs="+", help="files, directories or globs (as preprocess_data.py reads them)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to train on")
    p.add_argument("--output", required=True, help="path of the .model file to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --output that exists (refused otherwise)")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--vocab-size", type=int_at_least(1), default=32000)
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="encode unseen characters as bytes instead of <unk> (default: on)")
    p.add_argument("--special-tokens", nargs="*", default=[], help="extra pieces kept whole, e.g. <|im_start|>")
    p.add_argument("--character-coverage", type=float_in(*COVERAGE), default=0.9995,
                   help="share of the characters the pieces cover, in [0.98, 1]")
    p.add_argument("--max-sentences", type=int_at_least(1), default=10_000_000, help="lines sampled for training")
    p.add_argument("--max-docs", type=int_at_least(1),
                   help="read the first this many records (documents), every --json-keys field of each: "
                        "what preprocess_data.py --max-docs tokenizes")
    p.add_argument("--min-int-score", type=int, help="FineWeb-Edu: keep records with int_score >= this")
    p.add_argument("--threads", type=int_at_least(1), default=os.cpu_count() or 1)
    p.add_argument("--pad-multiple", type=int_at_least(1), default=128, help="report the vocab padded to this multiple")
    return p


def train(args: argparse.Namespace) -> dict:
    bad, skipped = BadRecords(), []
    files = expand_inputs(args.input, skipped)
    for line in input_notes(files, skipped):  # as preprocess_data.py says for the same inputs
        print(f"note: {line}", file=sys.stderr)
    try:
        # One pass, every key of a record, as preprocess_data.py reads them (a record lacking one
        # is bad there too); --max-docs counts records, not documents per key.
        lines = document_lines(files, RecordFilter(tuple(args.json_keys), args.min_int_score), args.max_docs, bad)
        train_sentencepiece(lines, args.output, vocab_size=args.vocab_size,
                            model_type=args.model_type, byte_fallback=args.byte_fallback,
                            special_tokens=args.special_tokens,
                            character_coverage=args.character_coverage,
                            max_sentences=args.max_sentences, threads=args.threads)
    except EmptyCorpus:
        why = (bad.explain(args.json_keys) if bad.total
               else "every record is empty or below the score threshold")
        raise DataError(f"no usable document in {named_inputs(files)}: {why}") from None
    return {"vocab_size": args.vocab_size,
            "padded_vocab_size": padded_vocab_size(args.vocab_size, args.pad_multiple), "bad": bad}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if refusal := json_keys_refusal(args.json_keys):
        parser.error(refusal)
    if "" in args.special_tokens:  # SentencePiece: "INTERNAL: ... [!sp->piece().empty()]"
        parser.error("--special-tokens: an empty piece (give each piece as text, e.g. "
                     "<|im_start|>)")
    if os.path.lexists(args.output) and not os.path.isdir(args.output) and not args.overwrite:
        # As preprocess_data.py refuses its outputs: the data and runs made with a tokenizer name
        # it by its path, and a new one there would be taken for it (training refuses it beside
        # the data's sidecars; an export only warns).
        print(f"error: --output {args.output}: exists; pass --overwrite to replace it, or choose "
              "another path", file=sys.stderr)
        return 2
    try:
        report = train(args)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report["bad"].total:
        print(f"warning: {report['bad'].summary()}: {'; '.join(report['bad'].examples)}", file=sys.stderr)
    print(f"wrote {args.output}: {args.model_type}, vocab {report['vocab_size']} "
          f"(padded to {report['padded_vocab_size']} for a multiple of {args.pad_multiple})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
