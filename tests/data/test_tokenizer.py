import pytest

from megaloop.data.tokenizer import TokenizerError, check_tokenizer_metadata, load_tokenizer, padded_vocab_size


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


def test_legacy_sentencepiece_types_encode_as_megatron_lm_legacy_tokenizers(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    text = "A <EOD> and </s> here <s>x"
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = load_tokenizer(kind, sp_model)  # megatron.core.tokenizers: plain text, eos ends documents
        assert tok.encode_batch([text]) == [sp.encode(text)] and tok.eod == sp.eos_id()
    assert load_tokenizer("GPTSentencePieceTokenizer", sp_model, legacy=True).encode_batch([text]) == [sp.encode(text)]
    legacy = load_tokenizer("SentencePieceTokenizer", sp_model, legacy=True)
    # <CLS> <SEP> <EOD> <MASK> and <PAD> (LLaMA-2 has no pad piece) are added past its 32000 pieces;
    # <s> and </s> are its own bos and eos.
    assert legacy.vocab_size == 32005 and legacy.eod == 32002
    expected = (sp.encode("A ") + [32002] + sp.encode(" and ") + [sp.eos_id()] + sp.encode(" here ")
                + [sp.bos_id()] + sp.encode("x"))
    assert legacy.encode_batch([text, "plain", ""]) == [expected, sp.encode("plain"), []]
    llama = load_tokenizer("Llama2Tokenizer", sp_model, legacy=True)
    assert llama.encode_batch(["x", ""]) == [[sp.bos_id()] + sp.encode("x"), [sp.bos_id()]]


def test_legacy_sentencepiece_decodes_its_added_ids_as_megatron_lm_does(sp_model):
    """A generated <CLS> (an id past the model's pieces) used to be an IndexError."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    legacy = load_tokenizer("SentencePieceTokenizer", sp_model, legacy=True)
    ids = sp.encode("The answer") + [32000] + sp.encode("is 42") + [32002]
    assert legacy.decode(ids) == "The answer <CLS> is 42 <EOD> "
    assert legacy.decode(sp.encode("plain text")) == "plain text"


def test_legacy_huggingface_adds_the_special_tokens_transformers_adds(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    # Megatron-LM's legacy HF tokenizer calls the transformers tokenizer; its new one adds nothing.
    reference, texts = PreTrainedTokenizerFast(tokenizer_file=str(path)), ["hello world", "world"]
    assert load_tokenizer("HuggingFaceTokenizer", path, legacy=True).encode_batch(texts) == [
        reference(t).input_ids for t in texts]
    assert load_tokenizer("HuggingFaceTokenizer", path).encode_batch(texts) == [
        reference(t, add_special_tokens=False).input_ids for t in texts]


@pytest.mark.parametrize("metadata, message", [
    ('{"library": "huggingface"}', "metadata names library 'huggingface', but Llama2Tokenizer reads sentencepiece"),
    ('{"library": "sentencepiece", "tokenizer_class": "x.Y"}', "names a tokenizer class"),
    ('{"model_type": "llama"}', "unknown model_type 'llama'"),
    ('["sentencepiece"]', "must be a JSON object, got list"),
    ("{library", "unreadable tokenizer metadata"),
])
def test_tokenizer_metadata_must_agree_with_the_type(tmp_path, metadata, message):
    path = tmp_path / "tokenizer_metadata.json"
    path.write_text('{"library": "sentencepiece", "model_type": "gpt", "chat_template": null}')
    check_tokenizer_metadata(str(path), "Llama2Tokenizer")
    path.write_text(metadata)
    with pytest.raises(TokenizerError, match=f"^{path}: .*{message}"):
        check_tokenizer_metadata(str(path), "Llama2Tokenizer")


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


def test_a_tokenizer_file_of_the_other_type_names_the_type_it_is(sp_model, hf_tokenizer):
    # Before: only the library's parse error ("could not parse ModelProto", "stream did not
    # contain valid UTF-8"), not that the file is the other kind.
    for kind, path, hint in (("Llama2Tokenizer", hf_tokenizer, "; it is an HF tokenizer.json: "
                              "tokenizer type HuggingFaceTokenizer"),
                             ("HuggingFaceTokenizer", sp_model, "; it is a SentencePiece model: "
                              "tokenizer type SentencePieceTokenizer")):
        with pytest.raises(TokenizerError) as err:
            load_tokenizer(kind, path)
        assert str(err.value).startswith(str(path)) and str(err.value).endswith(hint)


def test_malformed_tokenizer_config_names_the_file(tmp_path, hf_tokenizer):
    (tmp_path / "tokenizer.json").write_bytes(hf_tokenizer.read_bytes())
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"eos_token": ')
    with pytest.raises(TokenizerError, match=f"{config}: unreadable tokenizer config"):
        load_tokenizer("HuggingFaceTokenizer", tmp_path)
    # Before: an eos_token the tokenizer lacks fell back to <|endoftext|> without a word.
    config.write_text('{"eos_token": {"content": "<|im_end|>"}}')
    with pytest.raises(TokenizerError) as error:
        load_tokenizer("HuggingFaceTokenizer", tmp_path)
    assert str(error.value) == (f"{config}: eos_token '<|im_end|>' is not a token of "
                                f"{tmp_path / 'tokenizer.json'}")
    config.write_text('{"eos_token": "<|endoftext|>"}')
    assert load_tokenizer("HuggingFaceTokenizer", tmp_path).eod == 50256


def test_unknown_tokenizer_type():
    with pytest.raises(TokenizerError, match="unsupported tokenizer type 'GPT3'"):
        load_tokenizer("GPT3", "x")


def test_padded_vocab_size():
    assert padded_vocab_size(32000) == 32128  # the paper's T5 vocab
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(32000, multiple=128 * 4) == 32256
    assert padded_vocab_size(32127) == 32128
