"""Text tokenizers for preprocessing and training: SentencePiece ``.model`` and HF ``tokenizer.json``.

Kept free of torch and megatron-core imports: preprocessing workers load this module in fresh
processes, and each heavy import would cost seconds per worker.

The type names follow Megatron-LM's ``--tokenizer-type`` so its command lines carry over. For every
SentencePiece type the end-of-document id is the model's ``eos`` id (what Megatron-LM's
GPTSentencePieceTokenizer and Llama2Tokenizer use): it is a real piece the model can decode, unlike
the synthetic ``<EOD>`` id that Megatron-LM's plain SentencePieceTokenizer appends past the vocab.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from megaloop.data.readers import first_line

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HUGGINGFACE_TYPES = ("HuggingFaceTokenizer",)
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES

# Names tried, in order, when a tokenizer.json has no tokenizer_config.json beside it naming eos.
_EOD_TOKEN_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class TokenizerError(ValueError):
    """A tokenizer file that is missing, unreadable or unsuitable; the message names the file."""


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Embedding rows for ``vocab_size`` tokens: the next multiple of ``multiple`` above it.

    Always strictly above, so at least one spare row exists for padding / sentinel ids that must
    not collide with a real token: a 32000-piece SentencePiece model gives 32128 rows, as T5's
    vocabulary does. Pass ``multiple = 128 * tensor_parallel_size`` so every TP shard is even.
    """
    if vocab_size <= 0 or multiple <= 0:
        raise ValueError(f"vocab_size and multiple must be positive, got {vocab_size}, {multiple}")
    return (vocab_size // multiple + 1) * multiple


class SentencePieceTextTokenizer:
    """A SentencePiece model; ``encode_batch`` uses its C++ batch path (one call per chunk)."""

    def __init__(self, model_path: str | os.PathLike, eod_id: int | None = None):
        import sentencepiece

        self.path = str(model_path)
        _check_readable(self.path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"{self.path}: not a SentencePiece model ({first_line(err)})")
        self.vocab_size = self._sp.vocab_size()
        eos = self._sp.eos_id()
        self.eod = eod_id if eod_id is not None else (eos if eos >= 0 else None)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: process-level parallelism is the caller's choice (--workers).
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTextTokenizer:
    """An HF ``tokenizers`` JSON file (or a directory holding ``tokenizer.json``), used as is.

    Special tokens are not added around documents; the end-of-document id is ``eos_token`` from a
    ``tokenizer_config.json`` beside the file, else the first of the usual end-of-text names found.
    """

    def __init__(self, path: str | os.PathLike, eod_id: int | None = None):
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        self.path = str(p)
        _check_readable(self.path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as err:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{self.path}: not an HF tokenizer.json ({first_line(err)})")
        # Saved tokenizer.json files often carry a model's max_length truncation (GPT-2's: 1024),
        # which would silently cut every longer document.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = eod_id if eod_id is not None else self._find_eod(p.parent)

    def _find_eod(self, directory: Path) -> int | None:
        names = list(_EOD_TOKEN_NAMES)
        config = directory / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (ValueError, AttributeError) as err:  # bad JSON, bad UTF-8, not an object
                raise TokenizerError(f"{config}: unreadable tokenizer config ({first_line(err)})")
            if isinstance(eos, dict):  # AddedToken serialized as a dict
                eos = eos.get("content")
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


TextTokenizer = SentencePieceTextTokenizer | HuggingFaceTextTokenizer


def load_tokenizer(
    tokenizer_type: str, model_path: str | os.PathLike | None, eod_id: int | None = None
) -> TextTokenizer:
    """Load a tokenizer by Megatron-LM type name; raises TokenizerError naming the file."""
    if model_path is None:
        raise TokenizerError(f"--tokenizer-model is required for {tokenizer_type}")
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTextTokenizer(model_path, eod_id)
    if tokenizer_type in HUGGINGFACE_TYPES:
        # Rust-side parallelism would oversubscribe the cores that --workers already uses.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return HuggingFaceTextTokenizer(model_path, eod_id)
    raise TokenizerError(
        f"unsupported tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def _check_readable(path: str) -> None:
    if not os.path.exists(path):
        raise TokenizerError(f"{path}: tokenizer file not found")
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: tokenizer path is not a file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        raise TokenizerError(f"{path}: tokenizer file unreadable ({err.strerror})")
