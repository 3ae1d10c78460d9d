"""tools/bench/preprocess.py runs tools/preprocess_data.py once per round into the same output
prefix, which the tool refuses while an earlier round's outputs are there, unless --overwrite."""

import json

import pytest

from tests.data.conftest import SP_MODEL


@pytest.mark.skipif(not SP_MODEL.is_file(), reason=f"{SP_MODEL} not available")
def test_a_round_replaces_the_outputs_of_the_one_before(load_tool, tmp_path):
    """Before: every round after the first failed ('... exist; pass --overwrite to replace
    them'), so the bench with --rounds > 1 (the default 3) ended in an error."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(5)))
    for suffix in (".bin", ".idx"):  # what the round before left (its contents are not read)
        (tmp_path / f"bench_w1_text_document{suffix}").write_bytes(b"an earlier round's")
    argv = load_tool("bench/preprocess").tool_arguments(str(data), str(SP_MODEL), 1, str(tmp_path))
    assert load_tool("preprocess_data").main(argv) == 0
    assert (tmp_path / "bench_w1_text_document.idx").read_bytes() != b"an earlier round's"
