"""Training a SentencePiece tokenizer from a stream of text lines (used by tools/train_tokenizer.py
and the quickstart).

The settings keep text round-trippable (decode(encode(text)) == text): no normalisation, spaces kept
as they are, digits split, byte fallback for unseen characters. The model file is written atomically.
"""

from __future__ import annotations

import io
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from megaloop.data.readers import BadRecords, DataError, RecordFilter, iter_documents
from megaloop.platform.files import atomic_open


class EmptyCorpus(DataError):
    """No line to train a tokenizer on (sentencepiece's own words: "[!sentences_.empty()]")."""


def document_lines(inputs, record_filter: RecordFilter, max_docs: int | None,
                   bad: BadRecords) -> Iterator[str]:
    """The non-blank lines of every document: SentencePiece caps a training "sentence" at a few
    KB and would drop whole documents fed as one."""
    for doc in iter_documents(inputs, record_filter, max_docs, bad):
        for line in doc.splitlines():
            if line.strip():
                yield line


def train_sentencepiece(lines: Iterable[str], output: str | os.PathLike, *, vocab_size: int,
                        model_type: str = "bpe", byte_fallback: bool = True,
                        special_tokens: Sequence[str] = (), character_coverage: float = 0.9995,
                        max_sentences: int = 10_000_000, threads: int | None = None,
                        hard_vocab_limit: bool = True) -> None:
    """Trains on ``lines`` and writes the model to ``output``; raises DataError on failure.

    ``hard_vocab_limit=False`` makes ``vocab_size`` a ceiling: a small corpus then gets the pieces it
    supports instead of an error."""
    import sentencepiece as spm

    output = os.fspath(output)
    _check_output(output)  # before the training, which can take hours
    lines = iter(lines)
    first = next(lines, None)
    if first is None:
        raise EmptyCorpus("no text to train the tokenizer on")
    model = io.BytesIO()
    failed: list[DataError] = []

    def read(lines: Iterator[str]) -> Iterator[str]:
        try:
            yield from lines
        except DataError as err:  # sentencepiece reports it as a RuntimeError quoting its traceback
            failed.append(err)
            raise

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=read(itertools.chain([first], lines)),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            byte_fallback=byte_fallback,
            user_defined_symbols=list(special_tokens),
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            num_threads=threads or os.cpu_count() or 1,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            hard_vocab_limit=hard_vocab_limit,
            minloglevel=2,
        )
    except RuntimeError as err:  # e.g. a vocab larger than the corpus allows
        if failed:
            raise failed[0] from None
        raise DataError(f"sentencepiece training failed: {str(err).strip().splitlines()[-1]}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with atomic_open(output, "wb") as f:  # a crash leaves the old model or this one
            f.write(model.getvalue())
    except OSError as err:
        raise DataError(f"{output}: cannot write the model ({err.strerror or err})") from None


def _check_output(output: str) -> None:
    """Refuses, writing nothing, a model path that cannot be created: a file where a directory
    must be, or a directory where the file must be."""
    path = Path(os.path.abspath(output))
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DataError(f"{output}: {blocker} is a file, not a directory")
    if path.is_dir():
        raise DataError(f"{output}: is a directory, not a model file path")
