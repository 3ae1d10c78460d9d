"""ConfigError and the helpers that word it: every config module checks its fields through
``require``, so that each mistake reads ``section.field=value: must be ...``."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line."""


def require(ok: bool, prefix: str, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{prefix}.{name}={value!r}: must be {allowed}")


def divisors_text(n: int, limit: int | None = None) -> str:
    """"1, 2, 4, 8": the divisors of ``n`` up to ``limit``, for error messages."""
    return ", ".join(str(d) for d in range(1, min(n, limit or n) + 1) if n % d == 0)
