"""ALRS: heavy-tail-guided layerwise learning rates (He et al. 2026), as a distributed spectral hook.

Training-loop use::

    alrs = ALRS(model, total_steps=T, config=ALRSConfig(), tp_group=tp, log_path="run/alrs.zarr")
    for step in range(1, T + 1):          # 1-based optimizer steps
        ...backward...
        mult = alrs.step(step, base_lr)   # {param_name: multiplier}, same on every rank
        ...set each matrix's group LR to mult[name] * base_lr, then optimizer.step()...
    alrs.close()

``alrs.state_dict()`` / ``load_state_dict`` make a resume exact.
"""

from megaloop.alrs.allocator import allocate, initial_multipliers, linear_map
from megaloop.alrs.estimator import (SpectralStats, eigenvalues, median_hill_alpha, spectral_stats,
                                     stable_ranks)
from megaloop.alrs.log import ALRSLog, ALRSLogData, read_log
from megaloop.alrs.schedule import ALRSConfig, MultiplierSchedule
from megaloop.alrs.sharded import ALRS, BASE_GROUP, MatrixInfo, balance_by_cost, physical_matrices

__all__ = [
    "ALRS", "ALRSConfig", "ALRSLog", "ALRSLogData", "BASE_GROUP", "MatrixInfo", "MultiplierSchedule",
    "SpectralStats", "allocate", "balance_by_cost", "eigenvalues", "initial_multipliers",
    "linear_map", "median_hill_alpha", "physical_matrices", "read_log", "spectral_stats",
    "stable_ranks",
]
