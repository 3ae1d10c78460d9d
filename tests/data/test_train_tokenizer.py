import pytest

from megaloop.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("train_tokenizer")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_trains_a_usable_model_with_special_tokens(tmp_path, capsys, tool, articles, articles_path, model_type):
    out = tmp_path / "tok.model"
    code = tool.main(["--input", str(articles_path), "--output", str(out), "--model-type", model_type,
                      "--vocab-size", "600", "--special-tokens", "<|im_start|>", "--max-docs", "20", "--threads", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "vocab 600 (padded to 640 for a multiple of 128)" in err
    tok = load_tokenizer("SentencePieceTokenizer", out)
    assert tok.vocab_size == 600 and tok.eod == 2
    text = articles[30]["text"] + " naïve 東京 <|im_start|>"  # unseen characters need byte fallback
    ids = tok.encode_batch([text])[0]
    assert tok.decode(ids) == text
    assert tok._sp.piece_to_id("<|im_start|>") in ids
    assert [p.name for p in tmp_path.iterdir()] == ["tok.model"]  # no temporary left behind


def test_impossible_vocab_is_a_clear_error(tmp_path, capsys, tool):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a b c\n")
    code = tool.main(["--input", str(corpus), "--output", str(tmp_path / "t.model"), "--vocab-size", "5000"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: sentencepiece training failed")
    assert not (tmp_path / "t.model").exists()
