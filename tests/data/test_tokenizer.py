import pytest

from megaloop.data.tokenizer import TokenizerError, load_tokenizer, padded_vocab_size


def test_sentencepiece_round_trip_on_wikitext_articles(sp_model, articles):
    tok = load_tokenizer("SentencePieceTokenizer", sp_model)
    texts = [a["text"] for a in articles]
    ids = tok.encode_batch(texts)
    assert tok.vocab_size == 32000 and tok.eod == 2  # LLaMA-2: eos is the document separator
    for text, doc in zip(texts, ids):
        assert tok.decode(doc) == text


def test_huggingface_round_trip_and_eod(hf_tokenizer, articles):
    tok = load_tokenizer("HuggingFaceTokenizer", hf_tokenizer)
    texts = [a["text"] for a in articles[:5]]
    for text, doc in zip(texts, tok.encode_batch(texts)):
        assert tok.decode(doc) == text
    assert tok.vocab_size == 50257 and tok.eod == 50256  # <|endoftext|>


def test_missing_tokenizer_names_the_file(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(TokenizerError, match=f"{missing}: tokenizer file not found"):
        load_tokenizer("SentencePieceTokenizer", missing)


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "HuggingFaceTokenizer"])
def test_unreadable_tokenizer_names_the_file(tmp_path, kind):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01not a tokenizer" * 10)
    with pytest.raises(TokenizerError, match=str(garbage)):
        load_tokenizer(kind, garbage)


def test_malformed_tokenizer_config_names_the_file(tmp_path, hf_tokenizer):
    (tmp_path / "tokenizer.json").write_bytes(hf_tokenizer.read_bytes())
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"eos_token": ')
    with pytest.raises(TokenizerError, match=f"{config}: unreadable tokenizer config"):
        load_tokenizer("HuggingFaceTokenizer", tmp_path)


def test_unknown_tokenizer_type():
    with pytest.raises(TokenizerError, match="unsupported tokenizer type 'GPT3'"):
        load_tokenizer("GPT3", "x")


def test_padded_vocab_size():
    assert padded_vocab_size(32000) == 32128  # the paper's T5 vocab
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(32000, multiple=128 * 4) == 32256
    assert padded_vocab_size(32127) == 32128
