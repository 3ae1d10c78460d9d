"""FP8 is refused in one line, naming the setting, where Transformer Engine or the GPU cannot run
the chosen recipe. (tests/training/test_gpu_training.py trains with each recipe the GPU has.)"""

import sys
import types

import pytest

from megaloop.config import ConfigError, RunConfig, apply_overrides
from megaloop.models import specs
from megaloop.platform.fp8 import check_fp8_support


@pytest.mark.parametrize("recipe", ["current", "delayed", "mxfp8"])
def test_fp8_without_transformer_engine_is_one_line(monkeypatch, recipe):
    monkeypatch.setattr(specs, "transformer_engine_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        check_fp8_support(recipe)
    assert str(err.value) == (f"train.precision='fp8' (train.fp8_recipe={recipe!r}): needs "
                              "Transformer Engine on a CUDA GPU (use bf16 or fp32 here)")


def _fake_transformer_engine(monkeypatch, recipes, fp8=(True, ""), mxfp8=(True, "")):
    """Stands in for the parts of Transformer Engine the check reads (it does not install here)."""
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in recipes:
        setattr(recipe, name, type(name, (), {}))
    manager = type("FP8GlobalStateManager", (), {
        "is_fp8_available": staticmethod(lambda: fp8),
        "is_mxfp8_available": staticmethod(lambda: mxfp8)})
    quantization = types.ModuleType("transformer_engine.pytorch.quantization")
    quantization.FP8GlobalStateManager = manager
    modules = {"transformer_engine": types.ModuleType("transformer_engine"),
               "transformer_engine.common": types.ModuleType("transformer_engine.common"),
               "transformer_engine.common.recipe": recipe,
               "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
               "transformer_engine.pytorch.quantization": quantization}
    modules["transformer_engine.common"].recipe = recipe
    modules["transformer_engine.pytorch"].quantization = quantization
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(specs, "transformer_engine_available", lambda: True)


ALL = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling")


@pytest.mark.parametrize("recipes, gpu, recipe, message", [
    (ALL, dict(mxfp8=(False, "MXFP8 needs Blackwell")), "mxfp8",
     "train.fp8_recipe='mxfp8': not supported on this GPU (MXFP8 needs Blackwell)"),
    (ALL, dict(fp8=(False, "Device compute capability 8.9 or higher required")), "current",
     "train.fp8_recipe='current': not supported on this GPU (Device compute capability 8.9 or "
     "higher required)"),
    (("DelayedScaling", "MXFP8BlockScaling"), {}, "current",
     "train.fp8_recipe='current': this Transformer Engine has no Float8CurrentScaling"),
])
def test_a_recipe_this_machine_cannot_run_is_one_line(monkeypatch, recipes, gpu, recipe, message):
    _fake_transformer_engine(monkeypatch, recipes, **gpu)
    with pytest.raises(ConfigError) as err:
        check_fp8_support(recipe)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_supported_recipe_passes(monkeypatch):
    _fake_transformer_engine(monkeypatch, ALL)
    for recipe in ("current", "delayed", "mxfp8"):
        check_fp8_support(recipe)


def test_the_trainer_refuses_fp8_before_any_set_up(monkeypatch, tmp_path):
    from megaloop.training.trainer import Trainer

    monkeypatch.setattr(specs, "transformer_engine_available", lambda: False)
    cfg = apply_overrides(RunConfig(), ["train.precision=fp8", "train.fp8_recipe=mxfp8",
                                        "data.path=[/nonexistent/data]", "data.eod_id=0",
                                        f"train.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"train.fp8_recipe='mxfp8'\): needs Transformer Engine"):
        Trainer(cfg)
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused run"


def _fp8_run(model, recipe="current", sections=None):
    from megaloop.presets import preset

    cfg = RunConfig(model=preset(model) if isinstance(model, str) else model)
    cfg.train.precision, cfg.train.fp8_recipe = "fp8", recipe
    for name, fields in (sections or {}).items():
        for field, value in fields.items():
            setattr(getattr(cfg, name), field, value)
    cfg.model.validate()
    return cfg


@pytest.mark.parametrize("model, recipe, sections, message", [
    ("60M", "current", {}, "model ffn_hidden_size = 1512 is a GEMM inner dimension"),
    ("1B", "delayed", {}, "model ffn_hidden_size = 5461 is a GEMM inner dimension"),
    ("350M", "mxfp8", {}, "model ffn_hidden_size = 2736 is a GEMM inner dimension, which "
                          "Transformer Engine's FP8 GEMMs need to be a multiple of 32"),
    ("350M", "current", {"parallel": {"tensor": 8}},
     "model ffn_hidden_size / parallel.tensor = 342 is a GEMM inner dimension"),
    ("7B", "current", {"train": {"micro_batch_size": 1}, "model": {"seq_length": 100}},
     "train.micro_batch_size x model.seq_length = 100 is a GEMM row count, which Transformer "
     "Engine's FP8 GEMMs need to be a multiple of 8"),
    # The width visit runs the middle block at hidden_size // 2 = 40.
    ({"arch": "latentloop", "num_layers": 4, "hidden_size": 80, "num_attention_heads": 5,
      "ffn_hidden_size": 256, "latent_reduction": "width"}, "current", {},
     "visit 1's (model.latent_reduction='width') hidden_size = 40 is a GEMM inner dimension"),
])
def test_fp8_gemm_shapes_transformer_engine_refuses_are_one_line(model, recipe, sections,
                                                                 message):
    """Transformer Engine asserts them in the first forward pass (a traceback at step 1, the
    model built); the 60M and 1B presets' FFN widths are such shapes."""
    from megaloop.config import ModelConfig
    from megaloop.platform.fp8 import check_fp8_shapes

    if isinstance(model, dict):
        model = ModelConfig(**model)
    with pytest.raises(ConfigError) as err:
        check_fp8_shapes(_fp8_run(model, recipe, sections))
    text = str(err.value)
    assert text.startswith(f"train.precision='fp8' (fp8_recipe={recipe!r}): {message}"), text
    assert "\n" not in text


def test_fp8_gemm_shapes_it_takes_pass():
    from megaloop.platform.fp8 import check_fp8_shapes

    for model, recipe, parallel in (("7B", "delayed", {}), ("350M", "current", {}),
                                    ("135M", "mxfp8", {"tensor": 2})):
        check_fp8_shapes(_fp8_run(model, recipe, {"parallel": parallel}))


def test_the_trainer_refuses_fp8_gemm_shapes_before_any_set_up(monkeypatch, tmp_path):
    """Where Transformer Engine runs the recipe: the default model's FFN (344) is no FP8 width."""
    from megaloop.training.trainer import Trainer

    _fake_transformer_engine(monkeypatch, ALL)
    cfg = apply_overrides(RunConfig(), ["train.precision=fp8", "data.path=[/nonexistent/data]",
                                        "data.eod_id=0", f"train.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"\): model ffn_hidden_size = 344 is a GEMM inner"):
        Trainer(cfg)
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused run"
