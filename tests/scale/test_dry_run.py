"""The dry run refuses what the run would refuse at start-up, before anything heavy runs."""

import dataclasses

import pytest

from megaloop.config import ConfigError, DataConfig, RunConfig
from megaloop.presets import preset
from megaloop.scale.dry_run import report
from tests.data.conftest import SP_MODEL


def _run(**data):
    return RunConfig(model=preset("tiny"), data=DataConfig(path=["x"], **data))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    cfg = _run(tokenizer_model=str(SP_MODEL))
    with pytest.raises(ConfigError, match=r"^model.vocab_size=4096: smaller than the tokenizer's "
                                          r"32000 tokens"):
        report(cfg, world_size=1)
    cfg.model = dataclasses.replace(cfg.model, vocab_size=32000)
    assert "fits" in report(cfg, world_size=1)


def test_an_unloadable_tokenizer_is_refused_and_an_absent_one_noted(tmp_path):
    broken = tmp_path / "broken.model"
    broken.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ConfigError, match=rf"^data.tokenizer_model='{broken}': "):
        report(_run(tokenizer_model=str(broken)), world_size=1)
    # A cluster recipe sized on a laptop: the tokenizer lives on the cluster's filesystem.
    text = report(_run(tokenizer_model="/cluster/tok.model"), world_size=1)
    assert ("# note: data.tokenizer_model /cluster/tok.model is not on this machine; "
            "model.vocab_size is checked against it at start-up") in text.splitlines()
