"""megaloop.api.build: one call, any preset and field, reproducible weights."""

import pytest
import torch

import megaloop.api as ml
from megaloop.config import ConfigError


def test_build_is_reproducible_per_seed_and_takes_any_field(mcore):
    a = ml.build("tiny", arch="fullloop", seq_length=32, vocab_size=256, seed=5)
    b = ml.build("tiny", arch="fullloop", seq_length=32, vocab_size=256, seed=5)
    c = ml.build("tiny", arch="fullloop", seq_length=32, vocab_size=256, seed=6)
    assert a.cfg.iterations == 2 and a.cfg.vocab_size == 256
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                            c.named_parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_build_rejects_bad_fields_in_one_line(mcore):
    with pytest.raises(ConfigError, match="model.encoder_layers=9: must be in"):
        ml.build("tiny", arch="asymloop", encoder_layers=9)
    with pytest.raises(ConfigError, match=r"unknown field model.hiden_size \(did you mean "
                                          r"hidden_size\?\)"):
        ml.build("tiny", hiden_size=3)
