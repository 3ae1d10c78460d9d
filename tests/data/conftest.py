"""Fixtures for the data pipeline tests: the shared offline corpus and a tokenized copy of it."""

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
# Beside the checkout by default; MEGALOOP_SHARED_DATA points elsewhere (a git worktree, say).
SHARED_DATA = Path(os.environ.get("MEGALOOP_SHARED_DATA", REPO.parent / "shared" / "data"))
SP_MODEL = SHARED_DATA / "llama2_tokenizer.model"
HF_TOKENIZER = SHARED_DATA / "gpt2_tokenizer.json"
ARTICLES = SHARED_DATA / "wikitext2_raw_test_articles.jsonl"


@pytest.fixture(scope="session")
def sp_model() -> Path:
    if not SP_MODEL.is_file():
        pytest.skip(f"{SP_MODEL} not available")
    return SP_MODEL


@pytest.fixture(scope="session")
def hf_tokenizer() -> Path:
    if not HF_TOKENIZER.is_file():
        pytest.skip(f"{HF_TOKENIZER} not available")
    return HF_TOKENIZER


@pytest.fixture(scope="session")
def articles() -> list[dict]:
    if not ARTICLES.is_file():
        pytest.skip(f"{ARTICLES} not available")
    return [json.loads(line) for line in ARTICLES.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def articles_path(articles) -> Path:
    return ARTICLES


@pytest.fixture(scope="session")
def tokenized_articles(tmp_path_factory, sp_model, articles_path) -> str:
    """The WikiText articles tokenized with EOD, once per session; returns the dataset prefix."""
    from megaloop.data.preprocess import PreprocessOptions, output_prefix, preprocess, whole_files

    prefix = str(tmp_path_factory.mktemp("tokenized") / "wiki")
    options = PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=True, workers=0)
    preprocess(whole_files([str(articles_path)]), prefix, options)
    return output_prefix(prefix, "text")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="module")
def preprocess_tool(load_tool):
    return load_tool("preprocess_data")


@pytest.fixture
def run(preprocess_tool, capsys):
    """Runs tools/preprocess_data.py in-process; returns (exit code, stderr)."""
    def run(*args):
        code = preprocess_tool.main([str(a) for a in args])
        return code, capsys.readouterr().err

    return run


def sp_args(sp_model, *extra) -> list:
    """preprocess_data.py's tokenizer arguments for the SentencePiece model, with EOD."""
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod", *extra]
