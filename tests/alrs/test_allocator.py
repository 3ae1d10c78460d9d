import math

from megaloop.alrs.allocator import allocate, initial_multipliers, linear_map
from megaloop.alrs.schedule import ALRSConfig

ENC_QKV = "encoder.layers.0.self_attention.linear_qkv.weight"
ENC_FC1 = "encoder.layers.0.mlp.linear_fc1.weight"
DEC_QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
DEC_FC2 = "decoder.layers.0.mlp.linear_fc2.weight"
EMB = "embedding.word_embeddings.weight"
HEAD = "output_layer.weight"


def test_linear_map_sends_alpha_range_onto_s1_s2():
    out = linear_map({"a": 2.0, "b": 3.0, "c": 6.0}, 1.0, 5.0, previous={})
    assert out == {"a": 1.0, "b": 2.0, "c": 5.0}  # higher α (lighter tail) -> higher LR


def test_equal_alphas_give_s1_not_s2():
    assert linear_map({"a": 2.5, "b": 2.5}, 1.0, 5.0, previous={}) == {"a": 1.0, "b": 1.0}


def test_nan_alpha_is_excluded_from_the_range_and_keeps_its_previous_multiplier():
    out = linear_map({"a": 2.0, "dead": math.nan, "c": 4.0}, 1.0, 3.0,
                     previous={"a": 9.0, "dead": 1.7, "c": 9.0})
    assert out == {"a": 1.0, "dead": 1.7, "c": 3.0}
    assert linear_map({"x": math.nan}, 1.0, 3.0, previous={"x": 2.2}) == {"x": 2.2}


def test_embedding_and_head_pinned_to_s2_do_not_set_the_range():
    alphas = {EMB: 50.0, HEAD: 0.5, ENC_QKV: 2.0, DEC_QKV: 4.0, ENC_FC1: 3.0}
    out = allocate(alphas, ALRSConfig(s1=1.0, s2=5.0), previous={})
    assert out == {EMB: 5.0, HEAD: 5.0, ENC_QKV: 1.0, DEC_QKV: 5.0, ENC_FC1: 3.0}


def test_embedding_and_head_excluded_keep_base_lr():
    alphas = {EMB: 50.0, HEAD: 0.5, ENC_QKV: 2.0, DEC_QKV: 4.0}
    out = allocate(alphas, ALRSConfig(embedding_head="exclude"), previous={})
    assert out == {EMB: 1.0, HEAD: 1.0, ENC_QKV: 1.0, DEC_QKV: 5.0}


def test_embedding_and_head_included_join_the_range():
    alphas = {EMB: 6.0, HEAD: 2.0, ENC_QKV: 4.0}
    out = allocate(alphas, ALRSConfig(embedding_head="include"), previous={})
    assert out == {EMB: 5.0, HEAD: 1.0, ENC_QKV: 3.0}


def test_baselines_ignore_alpha():
    alphas = {EMB: 6.0, ENC_QKV: 2.0, DEC_QKV: 4.0, DEC_FC2: 3.0}
    assert set(allocate(alphas, ALRSConfig(mode="uniform"), previous={}).values()) == {1.0}
    boost = ALRSConfig(mode="decoder_boost", decoder_boost=2.5)
    expected = {EMB: 1.0, ENC_QKV: 1.0, DEC_QKV: 2.5, DEC_FC2: 2.5}
    assert allocate(alphas, boost, previous={}) == expected
    assert initial_multipliers(alphas, boost) == expected  # constant from the first step


def test_dense_models_have_only_decoder_names():
    # Dense / Full Loop name every layer "decoder.": ALRS works on them unchanged.
    alphas = {DEC_QKV: 2.0, DEC_FC2: 4.0, "decoder.layers.1.mlp.linear_fc1.weight": 3.0}
    out = allocate(alphas, ALRSConfig(s1=1.0, s2=3.0), previous={})
    assert out == {DEC_QKV: 1.0, DEC_FC2: 3.0, "decoder.layers.1.mlp.linear_fc1.weight": 2.0}


def _boosted(variant: str) -> tuple[list[str], list[str]]:
    """(boosted, not boosted) matrices of a LatentLoop variant under mode=decoder_boost, through
    the ALRS hook on the model; layer and expert indices as *."""
    import re

    from megaloop.alrs import ALRS
    from megaloop.models.model import build_model
    from tests.models.variants import small_config

    hook = ALRS(build_model(small_config(variant)), total_steps=10,
                config=ALRSConfig(mode="decoder_boost", granularity="parameter"))
    multipliers = hook.step(1)
    return tuple(sorted({re.sub(r"\.\d+\.", ".*.", n) for n, m in multipliers.items()
                         if (m == 2.0) == boosted}) for boosted in (True, False))


def test_latentloop_decoder_boost_covers_the_tied_middle_block(seeded):
    boosted, others = _boosted("latentloop")
    assert boosted == ["decoder.layers.*.mlp.linear_fc1.weight",
                       "decoder.layers.*.mlp.linear_fc2.weight",
                       "decoder.layers.*.self_attention.linear_proj.weight",
                       "decoder.layers.*.self_attention.linear_qkv.weight"]
    assert {n.split(".")[0] for n in others} == {"embedding", "output_layer", "encoder", "coda"}


def test_latentloop_decoder_boost_covers_the_untied_visit_copies(seeded):
    """Visits 2 and 3 own their attention and MoE (visits.visit<v>.block.*): looped middle-block
    matrices, boosted like the decoder's. Before, only decoder.* was."""
    boosted, others = _boosted("latentloop_moe_untied_v3")
    middle = ["layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
              "layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
              "layers.*.mlp.router.weight", "layers.*.self_attention.linear_proj.weight",
              "layers.*.self_attention.linear_qkv.weight"]
    assert boosted == [f"{block}.{name}" for block in ("decoder", "visits.visit2.block",
                                                       "visits.visit3.block") for name in middle]
    assert {n.split(".")[0] for n in others} == {"embedding", "output_layer", "encoder", "coda"}


def test_latentloop_width_projections_are_not_boosted(seeded):
    """The width reduction's projections run once per forward, around the block: not looped."""
    _, others = _boosted("latentloop_moe_width")
    assert {"visits.visit1.projection.down_weight",
            "visits.visit1.projection.up_weight"} <= set(others)
