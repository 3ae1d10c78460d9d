"""The run's tokenizer as Hugging Face tokenizer files, checked to encode as megaloop does.

A SentencePiece ``.model`` is converted by transformers (``TokenizersBackend`` builds a ``tokenizers``
pipeline from the model's own normaliser settings) into tokenizer.json / tokenizer_config.json, and
also kept as tokenizer.model. A ``tokenizer.json`` is taken as it is, less any truncation (megaloop
encodes without). Either way the result must encode a set of probe texts to the ids megaloop's
tokenizer gives (no BOS added: megaloop's documents have none, only the end-of-document id between
them), or the conversion fails.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from megaloop.hf.common import ConversionError, ProbeMismatch

PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog.", "  two  spaces\tand a tab",
               "line one\nline two", "naïve café, 東京, 😀, ﬁ", "x=1; y = [2, 3]", "")


def write_tokenizer(path: str | Path, out: Path, vocab_size: int,
                    tokenizer_type: str | None = None, legacy: bool = False) -> dict:
    """Writes the tokenizer at ``path`` (SentencePiece .model, or tokenizer.json / a directory
    holding one) into ``out``, encoding as the run's ``data.tokenizer_type`` and
    ``data.legacy_tokenizer`` do; returns its special token ids (bos/eos, eos being megaloop's
    end-of-document id). ``vocab_size``: the model's embedding rows, at least the tokenizer's
    size.

    Legacy SentencePieceTokenizer's ids past the model's pieces (``<EOD>``, the trained EOD, among
    them) become added special tokens with the same ids, so they are cut out of text as they were
    in training; legacy Llama2Tokenizer's bos starts every text, as the post-processor then adds
    it; a legacy tokenizer.json keeps its post-processor, which training applied."""
    from transformers import AutoTokenizer, TokenizersBackend

    path = Path(path)
    megaloop_tokenizer, sentencepiece = _megaloop_tokenizer(path, tokenizer_type, legacy)
    if megaloop_tokenizer.vocab_size > vocab_size:
        raise ConversionError(f"{path}: {megaloop_tokenizer.vocab_size} tokens, more than the "
                              f"model's vocab_size={vocab_size} (not this model's tokenizer?)")
    eod = megaloop_tokenizer.eod
    if sentencepiece:
        shutil.copyfile(path, out / "tokenizer.model")
        tokenizer = TokenizersBackend.from_pretrained(out)
        _add_legacy_special_tokens(tokenizer, megaloop_tokenizer, path)
        if legacy and tokenizer_type == "Llama2Tokenizer":
            tokenizer.add_bos_token = True
            tokenizer.update_post_processor()
    else:
        from tokenizers import Tokenizer

        json_file = path / "tokenizer.json" if path.is_dir() else path
        # Without the file's truncation (GPT-2's at 1024 tokens), which megaloop's tokenizer turns
        # off: the export's tokenizer.json would cut every longer text where the tokenizers library
        # reads it (transformers resets it per call; servers and Rust readers apply it).
        backend = Tokenizer.from_file(str(json_file))
        backend.no_truncation()
        tokenizer = TokenizersBackend(tokenizer_object=backend)
    if eod is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eod)
    tokenizer.save_pretrained(out)
    saved = AutoTokenizer.from_pretrained(out)
    # By default the HF tokenizer adds what training's did (legacy bos, a legacy tokenizer.json's
    # post-processor); add_special_tokens=False encodes the text alone.
    texts = list(PROBE_TEXTS) + _special_probes(megaloop_tokenizer)
    plain = _megaloop_tokenizer(path, tokenizer_type)[0] if legacy and _adds_tokens(
        tokenizer_type, sentencepiece) else megaloop_tokenizer
    for text, ids, text_ids in zip(texts, megaloop_tokenizer.encode_batch(texts),
                                   plain.encode_batch(texts)):
        for add, expected in ((True, ids), (False, text_ids)):
            got = saved(text, add_special_tokens=add)["input_ids"]
            if got != expected:
                raise ProbeMismatch(
                    f"tokenizer {path}: the Hugging Face conversion encodes {text!r} as "
                    f"{got[:8]}... (add_special_tokens={add}), megaloop as {expected[:8]}..."
                    f"{' (data.legacy_tokenizer=true)' if legacy else ''}")
    return {"bos_token_id": saved.bos_token_id, "eos_token_id": eod}


def untokenized_ids(tokenizer, vocab_size: int) -> list[int]:
    """The ids below ``vocab_size`` (the model's embedding rows) that the Hugging Face
    ``tokenizer`` has no token for: the rows of a vocab_size padded past the tokenizer. Never a
    training target, they decode to nothing, and megaloop's greedy decoding never chooses them
    (megaloop.generation's ``vocab_size``); generate() would, wherever an undertrained model
    scores one highest, and go on from an untrained embedding row: its ``suppress_tokens``."""
    known = set(tokenizer.get_vocab().values())
    return [i for i in range(vocab_size) if i not in known]


def _adds_tokens(tokenizer_type: str | None, sentencepiece: bool) -> bool:
    """Whether the legacy encoding of this type adds tokens around the text (bos, a
    post-processor's) rather than reading special strings out of it."""
    return not sentencepiece or tokenizer_type == "Llama2Tokenizer"


def _add_legacy_special_tokens(tokenizer, megaloop_tokenizer, path: Path) -> None:
    """Legacy SentencePieceTokenizer's special strings as added special tokens of ``tokenizer``
    with megaloop's ids (new ones are numbered past the pieces in the same order)."""
    special = getattr(megaloop_tokenizer, "special", {})
    new = [name for name, token_id in special.items() if token_id >= len(tokenizer)]
    if new:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens({"additional_special_tokens": [
            AddedToken(name, special=True, normalized=False) for name in new]})
    got = tokenizer.convert_tokens_to_ids(list(special))
    if got != list(special.values()):
        raise ConversionError(f"tokenizer {path}: the Hugging Face conversion numbers the "
                              f"data.legacy_tokenizer special tokens {list(special)} as {got}, "
                              f"megaloop as {list(special.values())}")


def _special_probes(megaloop_tokenizer) -> list[str]:
    """Probe texts with legacy SentencePieceTokenizer's special strings inside and around text."""
    names = list(getattr(megaloop_tokenizer, "special", ()))
    return [f"one{name} two {name}" for name in names] + (["".join(names)] if names else [])


def _megaloop_tokenizer(path: Path, tokenizer_type: str | None = None, legacy: bool = False):
    """(megaloop's tokenizer of ``path`` encoding as ``tokenizer_type`` (the run's; by default
    the one its file kind takes) and ``legacy`` say, whether it is a SentencePiece model)."""
    from megaloop.data.tokenizer import (HUGGINGFACE_TYPES, SENTENCEPIECE_TYPES, TokenizerError,
                                         load_tokenizer)

    sentencepiece = path.suffix != ".json" and not path.is_dir()
    types = SENTENCEPIECE_TYPES if sentencepiece else HUGGINGFACE_TYPES
    try:
        return load_tokenizer(tokenizer_type if tokenizer_type in types else types[0], path,
                              legacy=legacy), sentencepiece
    except TokenizerError as e:
        raise ConversionError(f"tokenizer: {e}") from None


def check_encodes_like(path: str | Path, original: str | Path, *, tokenizer_type: str | None,
                       original_type: str | None, legacy: bool) -> None:
    """The tokenizer at ``path`` encoding as ``tokenizer_type`` says, given in place of a run's
    ``original`` one encoding as the run did (``original_type``, its data.tokenizer_type; both as
    ``legacy``, its data.legacy_tokenizer), encodes the probe texts as the run's does and ends
    documents with the same id; else a ConversionError naming both (a copy or a conversion of the
    run's tokenizer passes, another model's does not, nor the run's own file read as another type
    would: a legacy Llama2Tokenizer adds a bos, a legacy SentencePieceTokenizer another EOD)."""
    same_file = Path(path).resolve() == Path(original).resolve()
    if same_file and tokenizer_type == original_type:
        return
    given, _ = _megaloop_tokenizer(Path(path), tokenizer_type, legacy)
    theirs, _ = _megaloop_tokenizer(Path(original), original_type, legacy)
    name = " ".join(([] if same_file else [f"--tokenizer {path}"]) + (
        [] if tokenizer_type == original_type else [f"--tokenizer-type {tokenizer_type}"]))
    run = f"the run's data.tokenizer_model {original}" + (
        "" if tokenizer_type == original_type else f" (data.tokenizer_type {original_type})")
    if given.eod != theirs.eod:
        raise ConversionError(f"{name}: ends documents with id {given.eod}, {run} with "
                              f"{theirs.eod} (not the tokenizer this model was trained with)")
    texts = list(PROBE_TEXTS)
    for text, ours, expected in zip(texts, given.encode_batch(texts), theirs.encode_batch(texts)):
        if ours != expected:
            raise ConversionError(f"{name}: encodes {text!r} as {ours[:8]}..., {run} as "
                                  f"{expected[:8]}... (not the tokenizer this model was trained "
                                  "with)")


def check_against_data(path: str | Path, data, *, tokenizer_type: str | None) -> None:
    """The tokenizer at ``path`` (read as ``tokenizer_type``) given in place of a run's whose file
    (``data.tokenizer_model`` of the run's data section ``data``) is gone, so that
    ``check_encodes_like`` cannot compare the two: checked against what the run's data says it was
    tokenized with instead, the sidecar tools/preprocess_data.py wrote beside each ``data.path``
    prefix still there. Its file (sha256) passes; another must have the sidecar's vocabulary size
    and EOD id, or is a ConversionError naming the sidecar (a tokenizer of 2,000 pieces would be
    exported for a model trained on 32,000 without a word). With no sidecar to read (data moved
    too, Megatron-LM's data, SFT records) one warning line says it went unchecked."""
    from megaloop.data.datasets import parse_blend
    from megaloop.data.preprocess import file_sha256, read_sidecar, sidecar_path

    prefixes = parse_blend(data.path)[0] if data.format == "indexed" and data.path else []
    sidecars = [(prefix, found) for prefix in prefixes if (found := read_sidecar(prefix))]
    if not sidecars:
        logging.getLogger("megaloop.hf").warning(
            "tokenizer %s: not checked against the run's (its data.tokenizer_model %s is gone, and "
            "no data.path prefix has a tokenizer sidecar to compare with)", path,
            data.tokenizer_model)
        return
    sha256 = file_sha256(path) if Path(path).is_file() else None
    given, _ = _megaloop_tokenizer(Path(path), tokenizer_type, data.legacy_tokenizer)
    for prefix, record in sidecars:
        if record.get("tokenizer_sha256") == sha256:
            continue
        for key, value in (("vocab_size", given.vocab_size), ("eod_id", given.eod)):
            if key in record and record[key] != value:
                raise ConversionError(
                    f"--tokenizer {path}: {key}={value}, but {sidecar_path(prefix)} says the run's "
                    f"data was tokenized with {key}={record[key]} (by "
                    f"{record.get('tokenizer_model')!r}; not the tokenizer this model was trained "
                    "with)")


def check_stands_in_for_runs(path: str | Path, data, *, tokenizer_type: str | None) -> None:
    """The tokenizer at ``path`` (read as ``tokenizer_type``) in place of the run's (``data``, the
    run's DataConfig): where the run's ``data.tokenizer_model`` is still there, it must encode as
    that does (``check_encodes_like``); where it is gone, match what the run's data says it was
    tokenized with (``check_against_data``). Nothing to compare with for a run without one."""
    if data.tokenizer_model is None:
        return
    if Path(data.tokenizer_model).exists():
        check_encodes_like(path, data.tokenizer_model, tokenizer_type=tokenizer_type,
                           original_type=data.tokenizer_type, legacy=data.legacy_tokenizer)
        if Path(path).resolve() == Path(data.tokenizer_model).resolve():
            _warn_if_rewritten_since(path, data)
    else:
        check_against_data(path, data, tokenizer_type=tokenizer_type)


def _warn_if_rewritten_since(path: str | Path, data) -> None:
    """One warning line where the run's own tokenizer file ``path`` is not the one a sidecar of
    its data (``data``: the run's DataConfig) says the data was tokenized with: training refuses
    such a pair at every start, so the file or the data was rewritten since the run (a tokenizer
    trained anew under the same name was exported for the model without a word). Which of the two
    cannot be told, so the export goes on."""
    from megaloop.data.datasets import parse_blend
    from megaloop.data.preprocess import file_sha256, read_sidecar, sidecar_path
    from megaloop.data.readers import DataError
    from megaloop.data.tokenizer import tokenizer_file

    prefixes = parse_blend(data.path)[0] if data.format == "indexed" and data.path else []
    sha256 = file_sha256(tokenizer_file(path))  # a directory's tokenizer.json
    for prefix in prefixes:
        try:
            record = read_sidecar(prefix) or {}
        except DataError as err:  # a check that only warns does not stop the export
            logging.getLogger("megaloop.hf").warning("tokenizer %s: not compared with the run's "
                                                     "data: %s", path, err)
            continue
        if record.get("tokenizer_sha256", sha256) != sha256:
            logging.getLogger("megaloop.hf").warning(
                "tokenizer %s: sha256 %s, but %s says the run's data was tokenized with sha256 %s "
                "(%r): the tokenizer or the data was rewritten since the run; if the tokenizer, "
                "give the one the model was trained with as --tokenizer", path, sha256[:12],
                sidecar_path(prefix), record["tokenizer_sha256"][:12],
                record.get("tokenizer_model"))
            return
