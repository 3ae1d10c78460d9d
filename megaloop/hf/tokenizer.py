"""The run's tokenizer as Hugging Face tokenizer files, checked to encode as megaloop does.

A SentencePiece ``.model`` is converted by transformers (``TokenizersBackend`` builds a ``tokenizers``
pipeline from the model's own normaliser settings) into tokenizer.json / tokenizer_config.json, and
also kept as tokenizer.model. A ``tokenizer.json`` is taken as it is. Either way the result must
encode a set of probe texts to the ids megaloop's tokenizer gives (no BOS added: megaloop's
documents have none, only the end-of-document id between them), or the conversion fails.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megaloop.hf.common import ConversionError, ProbeMismatch

PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog.", "  two  spaces\tand a tab",
               "line one\nline two", "naïve café, 東京, 😀, ﬁ", "x=1; y = [2, 3]", "")


def write_tokenizer(path: str | Path, out: Path, vocab_size: int) -> dict:
    """Writes the tokenizer at ``path`` (SentencePiece .model, or tokenizer.json / a directory
    holding one) into ``out``; returns its special token ids (bos/eos, eos being megaloop's
    end-of-document id). ``vocab_size``: the model's embedding rows, at least the tokenizer's
    size."""
    from transformers import AutoTokenizer, TokenizersBackend

    path = Path(path)
    megaloop_tokenizer, sentencepiece = _megaloop_tokenizer(path)
    if megaloop_tokenizer.vocab_size > vocab_size:
        raise ConversionError(f"{path}: {megaloop_tokenizer.vocab_size} tokens, more than the "
                              f"model's vocab_size={vocab_size} (not this model's tokenizer?)")
    eod = megaloop_tokenizer.eod
    if sentencepiece:
        shutil.copyfile(path, out / "tokenizer.model")
        tokenizer = TokenizersBackend.from_pretrained(out)
    else:
        json_file = path / "tokenizer.json" if path.is_dir() else path
        tokenizer = TokenizersBackend(tokenizer_file=str(json_file))
    if eod is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eod)
    tokenizer.save_pretrained(out)
    saved = AutoTokenizer.from_pretrained(out)
    expected = megaloop_tokenizer.encode_batch(list(PROBE_TEXTS))
    for text, ids in zip(PROBE_TEXTS, expected):
        got = saved(text, add_special_tokens=False)["input_ids"]
        if got != ids or saved(text)["input_ids"] != ids:
            raise ProbeMismatch(f"tokenizer {path}: the Hugging Face conversion encodes {text!r} "
                                f"as {got[:8]}..., megaloop as {ids[:8]}...")
    return {"bos_token_id": saved.bos_token_id, "eos_token_id": eod}


def _megaloop_tokenizer(path: Path):
    """(megaloop's tokenizer of ``path``, whether it is a SentencePiece model)."""
    from megaloop.data.tokenizer import TokenizerError, load_tokenizer

    sentencepiece = path.suffix != ".json" and not path.is_dir()
    try:
        return load_tokenizer("SentencePieceTokenizer" if sentencepiece else "HuggingFaceTokenizer",
                              path), sentencepiece
    except TokenizerError as e:
        raise ConversionError(f"tokenizer: {e}") from None


def check_encodes_like(path: str | Path, original: str | Path) -> None:
    """The tokenizer at ``path``, given in place of a run's ``original`` one, encodes the probe
    texts as it does and ends documents with the same id; else a ConversionError naming both (a
    copy or a conversion of the run's tokenizer passes, another model's does not)."""
    given, _ = _megaloop_tokenizer(Path(path))
    theirs, _ = _megaloop_tokenizer(Path(original))
    if given.eod != theirs.eod:
        raise ConversionError(f"--tokenizer {path}: ends documents with id {given.eod}, the run's "
                              f"data.tokenizer_model {original} with {theirs.eod} (not the "
                              "tokenizer this model was trained with)")
    texts = list(PROBE_TEXTS)
    for text, ours, expected in zip(texts, given.encode_batch(texts), theirs.encode_batch(texts)):
        if ours != expected:
            raise ConversionError(f"--tokenizer {path}: encodes {text!r} as {ours[:8]}..., the "
                                  f"run's data.tokenizer_model {original} as {expected[:8]}... "
                                  "(not the tokenizer this model was trained with)")
