"""Typed run configuration: dataclasses that round-trip through YAML and take dotted overrides.

A run is a ``RunConfig`` of six sections: model, parallel, train, data, checkpoint and alrs. Every
field has a default or is derived in ``resolve()``; ``validate()`` runs before any heavy work and
turns a user's mistake into one ``ConfigError`` line that names the field, the value and what is
allowed.

The modules: ``errors`` (ConfigError and the checks that word it), ``model`` (ModelConfig),
``run`` (the other sections and RunConfig) and ``serialization`` (dicts, YAML files, overrides).
Import from ``megaloop.config`` itself.
"""

from megaloop.config.errors import ConfigError
from megaloop.config.model import (DEFAULT_ITERATIONS, FLASH_HEAD_DIM_MULTIPLE, FLASH_MAX_HEAD_DIM,
                                   Arch, Block, Injection, JointImpl, LatentReduction, MoELayers,
                                   ModelConfig, ResidualScale)
from megaloop.config.run import (CheckpointConfig, DataConfig, DownstreamEvalConfig, Fp8Recipe,
                                 ParallelConfig, ProfileConfig, RunConfig, TrainConfig, micro_batches_per_step,
                                 split_weights, template_fields)
from megaloop.config.serialization import (apply_overrides, check_field_names, dump_yaml,
                                           flat_settings, from_dict, load_yaml, run_config_from,
                                           save_yaml, to_dict)

__all__ = [
    "ConfigError",
    "DEFAULT_ITERATIONS", "FLASH_HEAD_DIM_MULTIPLE", "FLASH_MAX_HEAD_DIM", "Arch", "Block",
    "Injection", "JointImpl", "LatentReduction", "MoELayers", "ModelConfig", "ResidualScale",
    "CheckpointConfig", "DataConfig", "DownstreamEvalConfig", "Fp8Recipe", "ParallelConfig",
    "ProfileConfig", "RunConfig", "TrainConfig", "micro_batches_per_step", "split_weights", "template_fields",
    "apply_overrides", "check_field_names", "dump_yaml", "flat_settings", "from_dict", "load_yaml",
    "run_config_from", "save_yaml", "to_dict",
]
