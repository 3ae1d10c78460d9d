import os

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


@pytest.mark.parametrize("flag", ["--vocab-size", "--threads", "--max-docs", "--pad-multiple"])
def test_a_count_below_one_is_refused_in_one_line(tmp_path, capsys, tool, flag):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--input", "x.txt", "--output", str(tmp_path / "t.model"), flag, "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].endswith(f"argument {flag}: 0: must be >= 1")


@pytest.mark.parametrize("argv, message", [
    # Before: sentencepiece's "INTERNAL: src/trainer_interface.cc(94) [...]", naming no flag.
    (["--character-coverage", "0.5"], "argument --character-coverage: 0.5: must be in [0.98, 1.0]"),
    (["--character-coverage", "1.5"], "argument --character-coverage: 1.5: must be in [0.98, 1.0]"),
    (["--special-tokens", "<a>", ""], "--special-tokens: an empty piece"),
])
def test_settings_sentencepiece_refuses_are_argparse_lines(tmp_path, capsys, tool, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--input", "x.txt", "--output", str(tmp_path / "t.model"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and message in err[-1]


def test_a_json_keys_typo_names_the_keys_the_records_hold(tmp_path, capsys, tool):
    corpus = tmp_path / "x.jsonl"
    corpus.write_text('{"text": "a b c", "id": 1}\n')
    code = tool.main(["--input", str(corpus), "--json-keys", "txt", "--output", str(tmp_path / "t.model"),
                      "--vocab-size", "500"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: no usable document in {corpus}: 1 bad records (1 missing key)")
    assert err.rstrip().endswith("--json-keys 'txt' but the records hold 'text', 'id'")
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]


@pytest.mark.parametrize("blocked", ["file/t.model", "dir"])
def test_an_output_path_that_cannot_be_written_is_refused_before_training(tmp_path, capsys, tool, blocked):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a b c\n")
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "dir").mkdir()
    output = tmp_path / blocked
    code = tool.main(["--input", str(corpus), "--output", str(output), "--vocab-size", "5000"])
    err = capsys.readouterr().err
    reason = {"dir": "is a directory", "file/t.model": f"{tmp_path / 'file'} is a file"}[blocked]
    assert code == 2 and err.startswith(f"error: {output}: {reason}") and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file", "tiny.txt"]
    assert list((tmp_path / "dir").iterdir()) == []


def test_a_json_key_given_twice_is_refused(tmp_path, capsys, tool):
    # Before: the field's documents were fed to SentencePiece twice, and exit 0.
    with pytest.raises(SystemExit) as exc:
        tool.main(["--input", "x.jsonl", "--output", str(tmp_path / "t.model"), "--json-keys", "text", "text"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith("error: --json-keys text text: 'text' given twice\n")
    assert list(tmp_path.iterdir()) == []


def test_files_a_directory_input_leaves_out_are_noted(tmp_path, capsys, tool):
    # Before: left out without a word (preprocess_data.py notes them for the same input).
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "ab ab abc abc ba"}\n')
    (corpus / "b.jsonl.bz2").write_bytes(b"BZh")
    code = tool.main(["--input", str(corpus), "--output", str(tmp_path / "t.model"), "--vocab-size", "12",
                      "--no-byte-fallback", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.splitlines()[0] == f"note: skipped 1 files of unsupported types (1 .bz2): {corpus / 'b.jsonl.bz2'}"


def test_a_truncated_compressed_input_is_an_error_naming_it(tmp_path, capsys, tool):
    # Before: "sentencepiece training failed:   .../readers.py(591): iter_documents", a line of
    # the traceback sentencepiece made of the reader's error (and, earlier, a bad record and exit 0).
    import gzip

    corpus = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(b"".join(b'{"text": "line %d of some text"}\n' % i for i in range(5000)))
    corpus.write_bytes(data[: len(data) // 2])
    code = tool.main(["--input", str(corpus), "--output", str(tmp_path / "t.model"), "--vocab-size", "300",
                      "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {corpus}: truncated compressed file, ends at line ") and len(err.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["cut.jsonl.gz"]


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, capsys, tool):
    """Data preprocessed with a tokenizer and the runs trained on it name it by its path. Before:
    a second run with the same --output replaced it without a word."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the {w} sat on {n} mats\n" for w in ("cat", "dog") for n in range(50)))
    out = tmp_path / "tok.model"
    def argv(vocab_size, *more):
        return ["--input", str(corpus), "--output", str(out), "--vocab-size", str(vocab_size),
                "--no-byte-fallback", "--threads", "1", *more]

    assert tool.main(argv(40)) == 0, capsys.readouterr().err
    first = out.read_bytes()
    assert tool.main(argv(50)) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --output {out}: exists; pass --overwrite to replace it, or choose another path")
    assert out.read_bytes() == first
    assert tool.main(argv(50, "--overwrite")) == 0, capsys.readouterr().err
    assert out.read_bytes() != first


def test_overwrite_through_a_symbolic_link_replaces_the_file_it_names(tmp_path, capsys, tool):
    """A tokenizer kept on shared storage and linked into a project: --overwrite writes the new
    model where the link points, as writing to the link with any other tool would. Before: the
    link was replaced by a file, and the shared model left as it was."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the {w} sat on {n} mats\n" for w in ("cat", "dog") for n in range(50)))
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "tok.model"
    target.write_bytes(b"the old model")
    link = tmp_path / "project" / "tok.model"
    link.parent.mkdir()
    link.symlink_to(target)
    assert tool.main(["--input", str(corpus), "--output", str(link), "--vocab-size", "40",
                      "--no-byte-fallback", "--threads", "1", "--overwrite"]) == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_tokenizer("SentencePieceTokenizer", target).vocab_size == 40
    assert sorted(p.name for p in shared.iterdir()) == ["tok.model"]  # no temporary left behind
