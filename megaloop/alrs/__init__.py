"""ALRS: heavy-tail-guided layerwise learning rates (He et al. 2026), as a distributed spectral hook.

Training-loop use::

    alrs = ALRS(model, total_steps=T, config=ALRSConfig(), tp_group=tp, log_path="run/alrs.zarr")
    for step in range(1, T + 1):          # 1-based optimizer steps
        ...backward...
        mult = alrs.step(step, base_lr)   # {block_name: multiplier}, same on every rank
        ...give each block the LR mult[name] * base_lr (megaloop.training.optimizer.LRMultipliers
        does it exactly, also for the Q/K/V and gate/up blocks inside fused weights),
        then optimizer.step()...
    alrs.close()

``alrs.state_dict()`` / ``load_state_dict`` make a resume exact.
"""

from megaloop.alrs.allocator import allocate, initial_multipliers, linear_map
from megaloop.alrs.blocks import RowSplit, WeightBlock, fused_layouts, weight_blocks
from megaloop.alrs.estimator import (SpectralStats, eigenvalues, median_hill_alpha, spectral_stats,
                                     stable_ranks)
from megaloop.alrs.log import ALRSLog, ALRSLogData, read_log, require_zarr
from megaloop.alrs.schedule import ALRSConfig, MultiplierSchedule
from megaloop.alrs.sharded import ALRS, BASE_GROUP, balance_by_cost

__all__ = [
    "ALRS", "ALRSConfig", "ALRSLog", "ALRSLogData", "BASE_GROUP", "MultiplierSchedule", "RowSplit",
    "SpectralStats", "WeightBlock", "allocate", "balance_by_cost", "eigenvalues", "fused_layouts",
    "initial_multipliers", "linear_map", "median_hill_alpha", "read_log", "require_zarr",
    "spectral_stats", "stable_ranks", "weight_blocks",
]
