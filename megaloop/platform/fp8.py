"""Whether this machine can train in FP8 with a given Transformer Engine recipe.

FP8 needs Transformer Engine and a GPU whose tensor cores take FP8 (Hopper, Ada, Blackwell);
MXFP8 block scaling needs Blackwell, current scaling Transformer Engine >= 2.2. Each missing piece
is one ConfigError line naming the setting, before any process group or model exists.
"""

from __future__ import annotations

from megaloop.config import ConfigError

# megaloop's recipe name -> the Transformer Engine recipe class it needs.
_RECIPE_CLASSES = {"current": "Float8CurrentScaling", "delayed": "DelayedScaling",
                   "mxfp8": "MXFP8BlockScaling"}


def _state_manager():
    try:  # Transformer Engine >= 2.8 moved it; the old module still re-exports it, with a warning
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def check_fp8_support(recipe: str) -> None:
    """Raises ConfigError unless Transformer Engine can run ``recipe`` on this machine's GPU."""
    from megaloop.models.specs import transformer_engine_available

    setting = f"train.fp8_recipe={recipe!r}"
    if not transformer_engine_available():
        raise ConfigError(f"train.precision='fp8' ({setting}): needs Transformer Engine on a CUDA "
                          "GPU (use bf16 or fp32 here)")
    from transformer_engine.common import recipe as te_recipe

    if not hasattr(te_recipe, _RECIPE_CLASSES[recipe]):
        raise ConfigError(f"{setting}: this Transformer Engine has no {_RECIPE_CLASSES[recipe]} "
                          "(current scaling needs >= 2.2); use fp8_recipe=delayed")
    manager = _state_manager()
    available, reason = (manager.is_mxfp8_available() if recipe == "mxfp8"
                         else manager.is_fp8_available())
    if not available:
        raise ConfigError(f"{setting}: not supported on this GPU ({reason})")
