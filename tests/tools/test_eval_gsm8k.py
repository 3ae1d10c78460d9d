"""tools/eval_gsm8k.py: a tokenizer read otherwise than the run's is refused before decoding, and
megaloop's log lines reach stderr as the trainer writes them (the decoding itself:
tests/test_gsm8k.py)."""

import json
import logging
import shutil
from pathlib import Path

from megaloop.data import load_tokenizer
from megaloop.hf.tokenizer import check_encodes_like
from tests.test_gsm8k import _run_with_tokenizer, _save_tiny, _sentencepiece
from tests.tool_scripts import load_tool


def test_the_runs_tokenizer_read_as_another_type_is_refused_before_decoding(mcore, tmp_path,
                                                                            capsys):
    """Before: both tokenizers were read as --tokenizer-type, and the run's own file under
    another type was not checked at all: a legacy SentencePieceTokenizer run (EOD: the added
    <EOD>) evaluated as Llama2Tokenizer ended documents at eos, with a bos on every prompt."""
    run_tokenizer = _sentencepiece(tmp_path / "run.model", ("cat", "dog", "emu"))
    base = tmp_path / "base" / "checkpoints"
    _save_tiny(base, data={"tokenizer_model": str(run_tokenizer), "legacy_tokenizer": True},
               vocab_size=512)
    argv = [str(base), "--test", "t.jsonl", "--predictions", str(tmp_path / "p.jsonl"),
            "--max-new-tokens", "2"]
    evaluate = load_tool("eval_gsm8k").main
    copy = Path(shutil.copy(run_tokenizer, tmp_path / "copy.model"))
    legacy_eod = load_tokenizer("SentencePieceTokenizer", run_tokenizer, legacy=True).eod
    for given, name in (([], "--tokenizer-type Llama2Tokenizer"),
                        (["--tokenizer", str(copy)],
                         f"--tokenizer {copy} --tokenizer-type Llama2Tokenizer")):
        assert evaluate(argv + given + ["--tokenizer-type", "Llama2Tokenizer"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {name}: ends documents with id ") and err.count("\n") == 1
        assert err.endswith(f", the run's data.tokenizer_model {run_tokenizer} (data."
                            f"tokenizer_type SentencePieceTokenizer) with {legacy_eod} (not the "
                            "tokenizer this model was trained with)\n")
    assert not (tmp_path / "p.jsonl").exists()
    # Without the legacy encoding the SentencePiece types encode alike: no refusal.
    check_encodes_like(copy, run_tokenizer, tokenizer_type="GPTSentencePieceTokenizer",
                       original_type="SentencePieceTokenizer", legacy=False)


def test_megaloops_warnings_reach_stderr_as_the_trainers_do(mcore, tmp_path, capsys, monkeypatch):
    """Before: no handler, so Python's last resort printed warnings bare (and dropped notes)."""
    _, argv = _run_with_tokenizer(tmp_path)
    # A prompt of about 120 tokens: the 12 new tokens asked for run past the 128-token context.
    Path(argv[2]).write_text(json.dumps({"question": "the cat sat on the mats " * 17,
                                         "answer": "#### 2"}) + "\n")
    monkeypatch.setattr(logging.root, "handlers", [])  # as outside pytest
    monkeypatch.setattr(logging.root, "level", logging.root.level)  # restored afterwards
    assert load_tool("eval_gsm8k").main(argv + ["--max-new-tokens", "12"]) == 0
    assert " megaloop.gsm8k: 1 of 1 questions: the prompt (up to " in capsys.readouterr().err


def test_a_tokenizer_ending_documents_otherwise_or_a_test_file_as_output_is_refused(
        mcore, tmp_path, capsys):
    """Before: a run on pre-tokenized data (data.eod_id 5) was decoded with a --tokenizer ending
    documents at another id (never stopping where the model learned to), and --predictions naming
    the --test file replaced it with the predictions; both exit 0."""
    tokenizer = _sentencepiece(tmp_path / "tok.model", ("cat", "dog", "emu"))
    base = tmp_path / "base" / "checkpoints"
    _save_tiny(base, data={"eod_id": 5}, vocab_size=512)
    test_file = tmp_path / "t.jsonl"
    test_file.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    argv = [str(base), "--test", str(test_file), "--tokenizer", str(tokenizer),
            "--max-new-tokens", "2"]
    evaluate = load_tool("eval_gsm8k").main
    assert evaluate(argv + ["--predictions", str(tmp_path / "p.jsonl")]) == 2
    eod = load_tokenizer("SentencePieceTokenizer", tokenizer).eod
    assert capsys.readouterr().err == (
        f"error: --tokenizer {tokenizer}: ends documents with id {eod}, the run's data.eod_id is "
        "5 (not the tokenizer this model was trained with)\n")
    assert evaluate(argv + ["--predictions", str(test_file)]) == 2
    assert capsys.readouterr().err == (f"error: --predictions {test_file}: cannot be written (it "
                                       "is a --test file, which the predictions would replace)\n")
    assert not (tmp_path / "p.jsonl").exists() and "#### 2" in test_file.read_text()


def test_a_tokenizer_in_place_of_a_moved_one_must_match_the_datas_sidecar(mcore, tmp_path,
                                                                          capsys):
    """Before: with the run's tokenizer file gone, any --tokenizer of at most vocab_size pieces
    was decoded with, unchecked."""
    from megaloop.data.preprocess import write_sidecar

    run_tokenizer = _sentencepiece(tmp_path / "run.model", ("cat", "dog", "emu"))
    trained = load_tokenizer("SentencePieceTokenizer", run_tokenizer)
    prefix = str(tmp_path / "data_text_document")
    write_sidecar(prefix, {"tokenizer_model": "run.model", "tokenizer_sha256": "0" * 64,
                           "eod_id": trained.eod, "vocab_size": trained.vocab_size + 7})
    base = tmp_path / "base" / "checkpoints"
    _save_tiny(base, data={"tokenizer_model": str(tmp_path / "moved.model")}, vocab_size=512)
    config = next(base.glob("iter_*")) / "config.yaml"
    config.write_text(config.read_text().replace("- x\n", f"- {prefix}\n"))
    assert load_tool("eval_gsm8k").main(
        [str(base), "--test", "t.jsonl", "--predictions", str(tmp_path / "p.jsonl"),
         "--tokenizer", str(run_tokenizer), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        f"error: --tokenizer {run_tokenizer}: vocab_size={trained.vocab_size}, but "
        f"{prefix}.tokenizer.json says the run's data was tokenized with vocab_size="
        f"{trained.vocab_size + 7} (by 'run.model'; not the tokenizer this model was trained "
        "with)\n")
