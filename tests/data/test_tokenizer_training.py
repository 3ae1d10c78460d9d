import re

import pytest

from megaloop.data import DataError, load_tokenizer
from megaloop.data.tokenizer_training import train_sentencepiece

LINES = [f"the {w} sat on {n} mats, said   {w.upper()}!" for w in ("cat", "dog", "emu", "yak")
         for n in range(40)]


def test_trained_model_round_trips_text_and_is_written_atomically(tmp_path, monkeypatch):
    import os

    out = tmp_path / "tok.model"
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or fsync(fd))
    train_sentencepiece(LINES, out, vocab_size=300)
    # The temporary, before its rename (it was not synced).
    assert [re.sub(r"-[0-9a-f]{8}$", "", path) for path in synced] == [
        f"{tmp_path}/.{out.name}-{os.getpid()}"]
    tokenizer = load_tokenizer("SentencePieceTokenizer", out)
    text = "the yak sat on 1234 mats,   said ÉMU!\n"
    assert tokenizer.decode(tokenizer.encode_batch([text])[0]) == text  # spaces, digits, unseen
    assert [p.name for p in tmp_path.iterdir()] == ["tok.model"]


def test_vocab_ceiling_versus_hard_limit(tmp_path):
    with pytest.raises(DataError, match="Vocabulary size too high"):
        train_sentencepiece(LINES, tmp_path / "hard.model", vocab_size=5000)
    assert not (tmp_path / "hard.model").exists()
    train_sentencepiece(LINES, tmp_path / "soft.model", vocab_size=5000, hard_vocab_limit=False)
    assert load_tokenizer("SentencePieceTokenizer", tmp_path / "soft.model").vocab_size < 5000
