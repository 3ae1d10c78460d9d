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
