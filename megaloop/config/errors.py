"""ConfigError and the helpers that word it: every config module checks its fields through
``require``, so that each mistake reads ``section.field=value: must be ...``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line."""


def require(ok: bool, prefix: str, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{prefix}.{name}={value!r}: must be {allowed}")


def require_no_tilde(prefix: str, name: str, value: str | list[str] | None) -> None:
    """Refuses a path (or a list of them, a blend) starting with ``~``: nothing expands it, not
    the shell in ``section.field=~/x`` (an argument, not a variable assignment), not YAML, not
    megaloop, so a run's outputs went to a directory named ``~`` in the working directory, while
    its log lines read as if they were in the home directory."""
    paths = value if isinstance(value, list) else [value]
    require(not any(isinstance(p, str) and p.startswith("~") for p in paths), prefix, name, value,
            "a path without a leading '~', which is not expanded (it would name a directory "
            "'~' in the working directory): write the full path, e.g. $HOME/...")


def require_finite(section: Any, prefix: str) -> None:
    """Refuses inf and nan in every float field of a config section and of the sections it holds:
    no setting means anything there, and range checks let them through (``lr > 0`` holds for inf;
    nan fails every comparison). Clipping is off at train.clip_grad=0 (megatron-core), not inf."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            require_finite(value, f"{prefix}.{f.name}")
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        require(all(math.isfinite(v) for v in values if isinstance(v, float)), prefix, f.name,
                value, "finite (not inf or nan)")


def divisors_text(n: int, limit: int | None = None) -> str:
    """"1, 2, 4, 8": the divisors of ``n`` up to ``limit``, for error messages."""
    return ", ".join(str(d) for d in range(1, min(n, limit or n) + 1) if n % d == 0)
