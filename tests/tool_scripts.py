"""tools/ scripts are not a package: tests load them as modules."""

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).parents[1] / "tools"


def load_tool(name: str):
    """The script ``tools/<name>.py`` (``bench/generate`` for one in a subfolder) as a module."""
    spec = importlib.util.spec_from_file_location(f"tool_{name.replace('/', '_')}",
                                                  TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
