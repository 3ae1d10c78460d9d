"""What names a run's data, checked without reading it: a Megatron-LM blend (``data.path``) and a
``data.split`` string. Standard library only: megaloop.config checks both when a config is
loaded, and a typo there should be answered before numpy or the dataset machinery loads."""

from __future__ import annotations

import math
import os
import re
from typing import Sequence

from megaloop.data.readers import DataError

SPLIT_NAMES = ("train", "valid", "test")
SPLIT_RULE = ("up to three non-negative decimal numbers train,valid,test with train > 0, e.g. "
              "'969,30,1'")


def parse_blend(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's ``--data-path``: ``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]``.

    Refused: a weight that is not a finite positive number (megatron-core's BlendedDataset
    asserts every weight is above zero), and a prefix given twice, however spelt: each entry is a
    dataset of its own, so the repeated one would be drawn from twice as often without a word."""
    items = [str(x) for x in data_path]
    if not items:
        raise DataError("empty data blend: give at least one dataset prefix")
    if len(items) % 2 == 1 or not _is_number(items[0]):
        prefixes, weights = items, None
    else:
        prefixes, weights = items[1::2], items[0::2]
        for w, prefix in zip(weights, prefixes):
            if not _is_number(w) or not 0 < float(w) < math.inf:  # nan fails both
                raise DataError(f"data blend: weight {w!r} of {prefix!r} is not a finite positive "
                                "number (to leave a dataset out, drop it from the blend)")
    seen: dict[str, str] = {}
    for i, prefix in enumerate(prefixes):
        first = seen.setdefault(os.path.realpath(prefix), prefix)
        if len(seen) <= i:  # its real path was seen before
            spelt = "" if first == prefix else f" (as {first!r} and {prefix!r})"
            more = "with a larger weight" if weights else "with weights for a larger share"
            raise DataError(f"data blend: {prefix!r} is given twice{spelt}, which draws from it "
                            f"twice as often; give it once, {more}")
    return prefixes, None if weights is None else [float(w) for w in weights]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def split_weights(split: str) -> list[float] | None:
    """A Megatron ``--split`` string ("969,30,1"; "/" also separates) as three weights, or None
    when malformed. megatron-core's own parser reads any digits it finds ("-1,2" as 1,2; "abc" as
    0,0,0, then divides by zero; "1e2" as 1,2, "1_000" as 1,000): each weight is plain decimal
    digits, which it reads as float() does, and finite (a weight of over 308 digits is inf to
    both, and megatron-core's normalised shares NaN)."""
    parts = re.split(r"[,/]", split.strip())
    if not all(re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*", part) for part in parts):
        return None
    weights = [float(p) for p in parts]
    if not 1 <= len(weights) <= 3 or not all(map(math.isfinite, weights)):
        return None
    return (weights + [0.0, 0.0])[:3] if weights[0] > 0 else None
