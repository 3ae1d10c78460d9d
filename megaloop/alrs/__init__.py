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

from megaloop.lazy import lazy_exports

# Each name is imported from its module on first use (megaloop.lazy).
_SOURCES = {
    "allocator": ("allocate", "initial_multipliers", "linear_map"),
    "blocks": ("RowSplit", "WeightBlock", "fused_layouts", "weight_blocks"),
    "estimator": ("SpectralStats", "eigenvalues", "median_hill_alpha", "spectral_stats",
                  "stable_ranks"),
    "log": ("ALRSLog", "ALRSLogData", "read_log", "require_zarr"),
    "schedule": ("ALRSConfig", "MultiplierSchedule"),
    "sharded": ("ALRS", "BASE_GROUP", "balance_by_cost"),
}
__all__, __getattr__, __dir__ = lazy_exports(globals(), _SOURCES)
