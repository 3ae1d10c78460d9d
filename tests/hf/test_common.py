"""The staged output directory both conversion directions write into."""

import logging

from megaloop.hf.common import staged_output


def test_a_staging_directory_a_killed_conversion_left_is_named_with_its_size(tmp_path, caplog):
    """Before: not a word; nothing removes it (a SIGKILL cannot be caught: the out-of-memory
    killer), and it holds a model's weights."""
    killed = tmp_path / ".hf.tmp-4242-0123abcd"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    others = [tmp_path / ".hf2.tmp-4243-89abcdef", tmp_path / ".hf.tmp-x-0123abcd"]
    for other in others:
        other.mkdir()
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        with staged_output(tmp_path / "hf") as staging:
            (staging / "config.json").write_text("{}")
    assert [r.getMessage() for r in caplog.records] == [
        f"{killed} (0.00 GB) is left from a conversion that was killed; remove it unless a "
        "conversion is writing it now"]
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"
    assert sorted(tmp_path.iterdir()) == sorted([killed, *others, tmp_path / "hf"])
