"""Load-time settings of the remote-code models: ``from_pretrained(dir, name=value)`` applies the
settings a loaded model may change (as megaloop's checkpoint.RESUMABLE_MODEL_FIELDS) and refuses,
in one line naming the field, one the saved weights fix or replace."""

import re

import pytest
import torch

from megaloop.models.export import reference_config
from megaloop.reference.configuration_megaloop import LOAD_TIME_SETTINGS
from megaloop.training.checkpoint_load import ARCHITECTURE_FIELDS, RESUMABLE_MODEL_FIELDS
from tests.models.variants import small_config
from tests.reference.test_generation import reference_model, tokens

# megaloop's names of the fields config.json holds under Hugging Face names.
HF_NAMES = {"seq_length": "max_position_embeddings", "init_std": "initializer_range",
            "tie_embeddings": "tie_word_embeddings"}


def test_the_load_time_settings_are_megaloops_resumable_fields():
    assert set(LOAD_TIME_SETTINGS) == {HF_NAMES.get(n, n) for n in RESUMABLE_MODEL_FIELDS}
    assert not set(LOAD_TIME_SETTINGS) & {HF_NAMES.get(n, n) for n in ARCHITECTURE_FIELDS}


@pytest.fixture
def saved(tmp_path):
    """A LatentLoop (learned scales, visits [1, 2] compressed) saved with save_pretrained."""
    model = reference_model("latentloop", latent_visits=[1, 2])
    model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.parametrize("name, value", [
    ("latent_writeback_lag", 1), ("latent_visits", [2]), ("latent_stride", 4),
    ("residual_scale", "fixed"), ("tie_word_embeddings", True), ("qk_norm", True)])
def test_a_setting_the_weights_fix_is_refused_naming_it(saved, name, value):
    """Before: latent_writeback_lag=1 built another model around the weights without a word."""
    model, directory = saved
    given = re.escape(f"{name}={value!r}")
    with pytest.raises(ValueError, match=rf"^{given}: fixed by the saved weights \(config.json "
                                         r"has .*\); from_pretrained may change only iterations, "):
        type(model).from_pretrained(directory, **{name: value})


def test_learned_residual_scales_refuse_an_initial_value_the_weights_replace(saved):
    """Before: taken into the config, then overwritten by the loaded scales."""
    model, directory = saved
    with pytest.raises(ValueError, match=r"^residual_scale_init=\[0.5, 2.0\]: without effect on "
                                         "a loaded model .*learned"):
        type(model).from_pretrained(directory, residual_scale_init=[0.5, 2.0])


def test_the_same_model_spelt_otherwise_and_applied_settings_load(saved):
    """The visits in another order are the same model; a fixed scale's initial value is the
    scale (applied); the saved value given again is no change; use_cache is no model setting."""
    model, directory = saved
    x = tokens(batch=1, length=6)
    same = type(model).from_pretrained(directory, latent_visits=[2, 1], latent_stride=2,
                                       use_cache=False)
    with torch.no_grad():
        torch.testing.assert_close(same(x).logits, model(x).logits)
    fixed = reference_model("moe_loop")
    fixed.save_pretrained(directory / "fixed")
    halved = type(fixed).from_pretrained(directory / "fixed", residual_scale_init=[0.5, 0.5])
    assert halved.residual_scales.tolist() == [0.5, 0.5]
    with torch.no_grad():
        assert not torch.allclose(halved(x).logits, fixed(x).logits)


def test_an_asymloop_takes_another_depth_and_refuses_another_injection(tmp_path):
    model = reference_model("asymloop")
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path, iterations=5).config.iterations == 5
    with pytest.raises(ValueError, match=r"^injection='none': fixed by the saved weights"):
        type(model).from_pretrained(tmp_path, injection="none")
    with pytest.raises(ValueError, match=r"^iterations=0: must be an integer >= 1$"):
        type(model).from_pretrained(tmp_path, iterations=0)


def test_a_dense_model_refuses_a_depth_at_load_time(tmp_path):
    """As megaloop.api.load does (ModelConfig.depth_refusal). Before: loaded, and its first
    forward failed."""
    model = reference_model("dense_olmo")  # remote code: the OLMo block with several heads
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^iterations=2: arch=dense has no depth to vary"):
        type(model).from_pretrained(tmp_path, iterations=2)


def test_reduced_visits_in_any_order_are_one_config():
    spelt = [reference_config(small_config("latentloop", latent_visits=v)).to_dict()
             for v in ([1, 2], [2, 1])]
    assert spelt[0] == spelt[1]


@pytest.mark.parametrize("variant, name, value", [
    ("asymloop", "norm_eps", 0.5), ("asymloop_moe", "moe_top_k", 1),
    ("moe_loop", "residual_scale_init", [0.5, 0.25]), ("asymloop", "iterations", 5),
    ("asymloop", "rotary_base", 500.0)])
def test_a_setting_edited_after_loading_is_applied_as_at_load_time(tmp_path, variant, name, value):
    """model.config.<name> = value, then forward: the logits of from_pretrained(dir, name=value).
    Before: norm_eps, moe_top_k and fixed scales' residual_scale_init were ignored (the modules
    keep what they were built with), without a word."""
    model = reference_model(variant)
    model.save_pretrained(tmp_path)
    x = tokens(batch=1, length=6)
    setattr(model.config, name, value)
    loaded = type(model).from_pretrained(tmp_path, **{name: value})
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, loaded(x).logits)
        assert not torch.allclose(model(x).logits, type(model).from_pretrained(tmp_path)(x).logits)


@pytest.mark.parametrize("variant, name, value, problem", [
    ("latentloop", "iterations", 1, "arch=latentloop runs exactly its iterations=2 visits"),
    ("asymloop", "injection", "none", "fixed by the saved weights"),
    ("asymloop", "qk_norm", False, "fixed by the saved weights")])
def test_a_setting_edited_after_loading_that_load_time_refuses_is_refused(tmp_path, variant, name,
                                                                          value, problem):
    """Before: a LatentLoop ran 1 of its 2 visits, an AsymLoop without its Global KV, and QK-norm
    stayed on: another model than the weights', or the edit ignored. Refused by forward and by
    save_pretrained (whose config.json would build another model around the weights)."""
    model = reference_model(variant)
    setattr(model.config, name, value)
    expected = rf"^model\.config\.{name}={re.escape(repr(value))} \(changed after loading; .*" \
               + re.escape(problem)
    with pytest.raises(ValueError, match=expected):
        model(tokens(batch=1, length=6))
    with pytest.raises(ValueError, match=expected):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_resized_token_embeddings_are_no_config_edit():
    """resize_token_embeddings sets config.vocab_size to the new embedding's rows."""
    model = reference_model("asymloop")
    model.resize_token_embeddings(model.config.vocab_size + 8)
    assert model(tokens(batch=1, length=6)).logits.shape[-1] == model.config.vocab_size


@pytest.mark.parametrize("variant, name, value, problem", [
    ("asymloop", "residual_scale_init", [0.5, 0.5, 0.5],
     "without effect: arch=asymloop has no residual scales"),
    ("moe_loop", "residual_scale_init", [0.5], "must be 2 numbers, one per visit"),
    ("asymloop_moe", "moe_top_k", 100, "must be in [1, num_experts=4]"),
    ("asymloop_moe", "moe_top_k", 0, "must be an integer >= 1"),
    ("asymloop", "moe_top_k", 3, "without effect: the model has no experts"),
    ("latentloop_moe_topk", "moe_top_k", 1, "must be in [2, num_experts=8]"),
    ("asymloop", "norm_eps", -1.0, "must be a number >= 0"),
    ("asymloop", "rotary_base", 0.0, "must be a number > 0"),
    ("asymloop", "max_position_embeddings", 0, "must be an integer >= 1"),
    ("asymloop", "joint_attention", "bogus", "must be 'fused' or 'masked'"),
    ("asymloop", "iterations", 2.5, "must be an integer >= 1")])
def test_a_load_time_setting_the_model_cannot_run_is_refused_naming_it(tmp_path, variant, name,
                                                                       value, problem):
    """As megaloop's ModelConfig.validate. Before: loaded, then an IndexError (too few scales), a
    RuntimeError from topk (more experts than there are) or a TypeError at the first forward; NaN
    logits (norm_eps < 0, rotary_base 0); or loaded and silently without effect (an AsymLoop's
    residual scales, a dense FFN's top-k, moe_top_k=0 routing to no expert, a top-k reduced visit
    routing to moe_top_k // 2 = 0, so to all of them)."""
    model = reference_model(variant)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{name}={value!r}: {problem}')}"):
        type(model).from_pretrained(tmp_path, **{name: value})
