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


def test_a_missing_tokenizer_is_refused():
    with pytest.raises(ConfigError, match=r"^data.tokenizer_model='/nonexistent.model': "):
        report(_run(tokenizer_model="/nonexistent.model"), world_size=1)
