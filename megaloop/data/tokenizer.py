"""Text tokenizers for preprocessing and training: SentencePiece ``.model`` and HF ``tokenizer.json``.

Kept free of torch and megatron-core imports: preprocessing workers load this module in fresh
processes, and each heavy import would cost seconds per worker.

The type names follow Megatron-LM's ``--tokenizer-type`` so its command lines carry over, and each
encodes as Megatron-LM core_v0.16.1 does. By default that is its tokenizer library
(``megatron.core.tokenizers``): every SentencePiece type encodes plain text and ends documents with
the model's ``eos`` id; HF tokenizers add no special tokens. ``legacy=True`` is its
``--legacy-tokenizer`` (``megatron.training.tokenizer``), which differs for two types:
SentencePieceTokenizer cuts seven special-token strings (``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``
and the pad/bos/eos pieces) out of the text as ids of their own, numbered past the model's pieces
when new, and ends documents with the added ``<EOD>`` id; Llama2Tokenizer starts every text with bos.
HF tokenizers then add the special tokens their post-processor defines.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence

from megaloop.data.readers import first_line

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HUGGINGFACE_TYPES = ("HuggingFaceTokenizer",)
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + HUGGINGFACE_TYPES
# The types whose encoding ``legacy=True`` changes (GPTSentencePieceTokenizer encodes alike in both).
LEGACY_CHANGES = ("SentencePieceTokenizer", "Llama2Tokenizer") + HUGGINGFACE_TYPES

# Names tried, in order, when a tokenizer.json has no tokenizer_config.json beside it naming eos.
_EOD_TOKEN_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
# megatron.core.tokenizers: the library each type reads, and the model types its metadata may name
# (all of which encode text alike).
_METADATA_LIBRARIES = {**{t: "sentencepiece" for t in SENTENCEPIECE_TYPES}, "HuggingFaceTokenizer": "huggingface"}
_METADATA_MODEL_TYPES = ("default", "gpt", "mamba", "bert", "t5")


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
    """A SentencePiece model; ``encode_batch`` uses its C++ batch path (one call per chunk).

    ``add_bos`` starts every text with the model's bos id (Megatron-LM's legacy Llama2Tokenizer).
    """

    def __init__(self, model_path: str | os.PathLike, eod_id: int | None = None, add_bos: bool = False):
        import sentencepiece

        self.path = str(model_path)
        _check_readable(self.path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"{self.path}: not a SentencePiece model ({first_line(err)})"
                                 f"{_other_type_hint(self.path, 'HuggingFaceTokenizer')}")
        self.vocab_size = self._sp.vocab_size()
        eos = self._sp.eos_id()
        self.eod = eod_id if eod_id is not None else (eos if eos >= 0 else None)
        if add_bos and self._sp.bos_id() < 0:
            raise TokenizerError(f"{self.path}: the model has no bos piece to start each text with")
        self._add_bos = add_bos

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: process-level parallelism is the caller's choice (--workers).
        return self._sp.encode(list(texts), num_threads=1, add_bos=self._add_bos)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class LegacySentencePieceTokenizer(SentencePieceTextTokenizer):
    """Megatron-LM's legacy SentencePieceTokenizer: special-token strings in the text become ids of
    their own (new ones numbered past the model's pieces, in this order), and EOD is ``<EOD>``."""

    def __init__(self, model_path: str | os.PathLike):
        super().__init__(model_path)
        vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

        def piece(token_id: int, missing: str) -> str:
            return self._sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else missing

        names = ("<CLS>", "<SEP>", "<EOD>", "<MASK>", piece(self._sp.pad_id(), "<PAD>"),
                 piece(self._sp.bos_id(), "<BOS>"), piece(self._sp.eos_id(), "<EOS>"))
        self.special: dict[str, int] = {}
        for name in names:
            self.special[name] = vocab.setdefault(name, len(vocab))
        self.vocab_size = len(vocab)
        self.eod = self.special["<EOD>"]
        # Leftmost match first, ties to the earlier name: the order Megatron-LM searches in.
        self._pattern = re.compile("(" + "|".join(map(re.escape, self.special)) + ")")

    def decode(self, ids: Sequence[int]) -> str:
        """As Megatron-LM's legacy tokenizer decodes: a special id is written as its string with a
        space on either side, and the runs of the model's pieces between them decode as usual (the
        model alone knows no id past its pieces: an IndexError for a generated ``<CLS>``)."""
        names = {token: name for name, token in self.special.items()}
        text, pieces = "", []
        for token in map(int, ids):
            if token in names:
                text += f"{super().decode(pieces)} {names[token]} "
                pieces = []
            else:
                pieces.append(token)
        return text + super().decode(pieces)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        parts = [self._pattern.split(text) for text in texts]  # text, special, text, ..., text
        encoded = iter(super().encode_batch([p for text_parts in parts for p in text_parts[::2]]))
        result = []
        for text_parts in parts:
            ids: list[int] = []
            for j, part in enumerate(text_parts):
                if j % 2:
                    ids.append(self.special[part])
                else:
                    ids.extend(next(encoded))
            result.append(ids)
        return result


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The file a tokenizer ``path`` is read from: ``tokenizer.json`` inside a directory, else the
    path itself (the file a data sidecar's ``tokenizer_sha256`` digests)."""
    return Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)


class HuggingFaceTextTokenizer:
    """An HF ``tokenizers`` JSON file (or a directory holding ``tokenizer.json``), used as is.

    Special tokens are not added around documents; the end-of-document id is ``eos_token`` from a
    ``tokenizer_config.json`` beside the file, else the first of the usual end-of-text names found.
    """

    def __init__(self, path: str | os.PathLike, eod_id: int | None = None, add_special_tokens: bool = False):
        from tokenizers import Tokenizer

        self.path = str(tokenizer_file(path))
        _check_readable(self.path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as err:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{self.path}: not an HF tokenizer.json ({first_line(err)})"
                                 f"{_other_type_hint(self.path, 'SentencePieceTokenizer')}")
        # Saved tokenizer.json files often carry a model's max_length truncation (GPT-2's: 1024),
        # which would silently cut every longer document.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = eod_id if eod_id is not None else self._find_eod(Path(self.path).parent)
        self._add_special_tokens = add_special_tokens

    def _find_eod(self, directory: Path) -> int | None:
        config = directory / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (ValueError, AttributeError) as err:  # bad JSON, bad UTF-8, not an object
                raise TokenizerError(f"{config}: unreadable tokenizer config ({first_line(err)})")
            if isinstance(eos, dict):  # AddedToken serialized as a dict
                eos = eos.get("content")
            if isinstance(eos, str):
                # Not another end-of-text name instead: the config's eos is what Megatron-LM uses.
                token_id = self._tok.token_to_id(eos)
                if token_id is None:
                    raise TokenizerError(f"{config}: eos_token {eos!r} is not a token of {self.path}")
                return token_id
        for name in _EOD_TOKEN_NAMES:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=self._add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


TextTokenizer = SentencePieceTextTokenizer | HuggingFaceTextTokenizer


def load_tokenizer(
    tokenizer_type: str, model_path: str | os.PathLike | None, eod_id: int | None = None, legacy: bool = False
) -> TextTokenizer:
    """Load a tokenizer by Megatron-LM type name; raises TokenizerError naming the file.

    ``legacy`` encodes as Megatron-LM's ``--legacy-tokenizer`` does (see the module's docstring).
    """
    if model_path is None:
        raise TokenizerError(f"--tokenizer-model is required for {tokenizer_type}")
    if legacy and tokenizer_type == "SentencePieceTokenizer" and eod_id is None:
        return LegacySentencePieceTokenizer(model_path)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTextTokenizer(model_path, eod_id, add_bos=legacy and tokenizer_type == "Llama2Tokenizer")
    if tokenizer_type in HUGGINGFACE_TYPES:
        # Rust-side parallelism would oversubscribe the cores that --workers already uses.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return HuggingFaceTextTokenizer(model_path, eod_id, add_special_tokens=legacy)
    raise TokenizerError(
        f"unsupported tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def check_tokenizer_metadata(path: str, tokenizer_type: str) -> None:
    """Refuse a ``--tokenizer-metadata`` file that would make Megatron-LM encode otherwise than
    ``tokenizer_type`` does here: another library, a custom class, an unknown model type. What it
    may hold besides (a chat template, a model type) does not change how text is encoded."""
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{path}: unreadable tokenizer metadata ({first_line(err)})")
    if not isinstance(metadata, dict):
        raise TokenizerError(f"{path}: tokenizer metadata must be a JSON object, got {type(metadata).__name__}")
    library, expected = metadata.get("library"), _METADATA_LIBRARIES.get(tokenizer_type)
    if library is not None and library != expected:
        raise TokenizerError(f"{path}: metadata names library {library!r}, but {tokenizer_type} reads "
                             f"{expected} models (megaloop reads no other library)")
    if metadata.get("tokenizer_class"):
        raise TokenizerError(f"{path}: metadata names a tokenizer class, which megaloop cannot load")
    model_type = metadata.get("model_type")
    if model_type is not None and model_type not in _METADATA_MODEL_TYPES:
        raise TokenizerError(f"{path}: unknown model_type {model_type!r}; Megatron-LM knows "
                             f"{', '.join(_METADATA_MODEL_TYPES)}")


def _other_type_hint(path: str, other: str) -> str:
    """``"; it is a <kind>: tokenizer type <other>"`` when the file loads as the ``other`` type's
    kind of file (given with the wrong tokenizer type), else ""."""
    try:
        if other in HUGGINGFACE_TYPES:
            from tokenizers import Tokenizer

            Tokenizer.from_file(path)
        else:
            import sentencepiece

            sentencepiece.SentencePieceProcessor(model_file=path)
    except Exception:  # neither kind: the first error says enough
        return ""
    kind = "an HF tokenizer.json" if other in HUGGINGFACE_TYPES else "a SentencePiece model"
    return f"; it is {kind}: tokenizer type {other}"


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
