"""From per-matrix α to LR multipliers: the linear map onto [s1, s2] and the two baselines.

Every function here is pure Python arithmetic on floats in a fixed order, so ranks that feed it the
same all-gathered α values get bit-identical multipliers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from megaloop.alrs.schedule import ALRSConfig


def is_embedding_or_head(name: str, config: ALRSConfig) -> bool:
    return name.startswith(config.embedding_head_prefixes)


# LatentLoop (megaloop.models.latent) registers a visit's own parts of the looped middle block
# (untied attention or MoE) as visits.visit<v>.block.<name in the decoder>: copies of the decoder's
# parameters, looped as the decoder is, so they are decoder matrices where their decoder originals
# are. (A visit's width projections are not: they run once per forward, around the block.)
_VISIT_BLOCK = re.compile(r"^visits\.visit\d+\.block\.")


def is_decoder(name: str, config: ALRSConfig) -> bool:
    return _VISIT_BLOCK.sub("decoder.", name).startswith(config.decoder_prefix)


def initial_multipliers(names: Iterable[str], config: ALRSConfig) -> dict[str, float]:
    """Multipliers before the first allocation: 1 everywhere, except the constant decoder boost."""
    boost = config.decoder_boost if config.mode == "decoder_boost" else 1.0
    return {n: boost if is_decoder(n, config) else 1.0 for n in names}


def linear_map(alphas: Mapping[str, float], s1: float, s2: float,
               previous: Mapping[str, float]) -> dict[str, float]:
    """s = s1 + (s2 − s1)·(α − α_min)/(α_max − α_min): higher α (lighter tail) gets the higher LR.

    NaN α values are left out of [α_min, α_max] and keep their previous multiplier. When every finite
    α is equal the range is empty and all get s1 (the reference's np.interp would hand out s2).
    """
    finite = [a for a in alphas.values() if not math.isnan(a)]
    if not finite:
        return {n: previous[n] for n in alphas}
    lo, hi = min(finite), max(finite)
    out = {}
    for name, a in alphas.items():
        if math.isnan(a):
            out[name] = previous[name]
        elif hi == lo:
            out[name] = s1
        else:
            out[name] = s1 + (s2 - s1) * (a - lo) / (hi - lo)
    return out


def allocate(alphas: Mapping[str, float], config: ALRSConfig,
             previous: Mapping[str, float]) -> dict[str, float]:
    """Target multiplier of every matrix in ``alphas`` for the configured mode.

    ``previous`` holds the targets of the last allocation (what a NaN matrix keeps).
    """
    if config.mode != "alrs":
        return initial_multipliers(alphas, config)
    special = {n for n in alphas if is_embedding_or_head(n, config)}
    if config.embedding_head == "include":
        special = set()
    ranged = {n: a for n, a in alphas.items() if n not in special}
    targets = linear_map(ranged, config.s1, config.s2, previous)
    pinned = config.s2 if config.embedding_head == "pin_s2" else 1.0
    return {n: pinned if n in special else targets[n] for n in alphas}
