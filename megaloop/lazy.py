"""Packages whose names are imported from their modules on first use (PEP 562): megaloop.config
imports a light module of megaloop.alrs and of megaloop.data, and importing a module runs its
package first; eager imports there would load numpy, torch or megatron-core (seconds) before a
config typo could be reported."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, sources: dict[str, tuple[str, ...]]):
    """(``__all__``, ``__getattr__``, ``__dir__``) for the package of ``namespace`` (its
    ``globals()``) exporting, for each of its modules in ``sources``, the names listed; each is
    imported and kept in ``namespace`` at its first use."""
    module_of = {name: module for module, names in sources.items() for name in names}
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return sorted(module_of), __getattr__, __dir__
