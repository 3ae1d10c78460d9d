"""The weight mapping onto the reference model (megaloop.models.export) maps part of a model to the
same part of the whole model's mapping: the conversions map a layer at a time."""

import pytest

from megaloop.hf.common import by_layer
from megaloop.models.export import invert_mapping, reference_state_dict
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


@pytest.mark.parametrize("variant", ["asymloop_tied_gqa1", "latentloop_moe_untied_v3"])
def test_inverting_the_mapping_indexes_no_tensor_it_only_renames(seeded, variant):
    """invert_mapping (the import, a layer at a time) gives every tensor back; the embedding and
    the output layer, which the mapping only renames, come back as the tensors given, with no
    index of their elements (before: an int64 index of them, twice their fp32 size, and two
    copies: most of an import's peak memory on a small model, whose vocabulary dominates)."""
    cfg = small_config(variant)
    state = {name: tensor for name, tensor in build_model(cfg).state_dict().items()
             if not name.endswith("_extra_state")}
    renamed = {"embedding.word_embeddings.weight", "output_layer.weight"}
    for names in by_layer(list(state)):
        part = {name: state[name] for name in names}
        values = {name: tensor.clone() for name, tensor in
                  reference_state_dict(part, cfg).items()}
        indexed = []

        def mapping(tensors):  # the index tensors exist when the mapping is called
            indexed.append(sum(t.numel() * t.element_size() for t in tensors.values()
                               if not t.is_meta))
            return reference_state_dict(tensors, cfg)

        back = invert_mapping(mapping, values, {n: tuple(t.shape) for n, t in part.items()})
        assert back.keys() == part.keys()
        for name, tensor in part.items():
            assert back[name].equal(tensor), name
        others = sum(t.numel() for name, t in part.items() if name not in renamed)
        assert max(indexed) <= 8 * others, (names, indexed)
        for name in set(renamed) & set(part):  # tied: the head's values, equal to the embedding's
            assert any(back[name] is tensor for tensor in values.values()), name
