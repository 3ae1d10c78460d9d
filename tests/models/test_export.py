"""The weight mapping onto the reference model (megaloop.models.export) maps part of a model to the
same part of the whole model's mapping: the conversions map a layer at a time."""

import pytest

from megaloop.hf.common import by_layer
from megaloop.models.export import reference_state_dict
from megaloop.models.model import build_model
from tests.models.variants import small_config


@pytest.mark.parametrize("variant", ["asymloop_tied_gqa1", "latentloop_moe_untied_v3"])
def test_a_layer_at_a_time_maps_as_the_whole_model_does(seeded, variant):
    cfg = small_config(variant)
    state = {name: tensor for name, tensor in build_model(cfg).state_dict().items()
             if not name.endswith("_extra_state")}
    whole = reference_state_dict(state, cfg)
    parts = {}
    for names in by_layer(list(state)):
        part = reference_state_dict({name: state[name] for name in names}, cfg)
        assert not set(part) & set(parts)
        parts.update(part)
    assert parts.keys() == whole.keys()
    for name, tensor in whole.items():
        assert parts[name].equal(tensor), name
    if cfg.tie_embeddings:  # the head, the embedding itself, comes with the embedding's group
        assert parts["lm_head.weight"] is parts["embed_tokens.weight"]
