"""Configuration: frozen dataclasses, YAML presets, ``key=value`` overrides, and all validation.

Everything a user can get wrong is caught here, before jax is imported or anything is compiled,
and reported as a one-line :class:`ConfigError` naming the field and the allowed values (the CLI
turns it into exit code 2). This package deliberately imports neither jax nor flax: the CLI must
read the config (``host_devices``) before jax initialises its backend.

The one exception is the device count, which only jax knows: :func:`validate` takes it as an
argument, so callers resolve it once (``host_devices`` or ``jax.device_count()``) and pass it in.

:mod:`~jaxpar.config.schema` holds the dataclasses, :mod:`~jaxpar.config.loading` builds them
from YAML and overrides, :mod:`~jaxpar.config.validation` checks the rules between fields.
"""

from jaxpar.config.loading import (
    config_from_dict,
    load_config,
    parse_overrides,
    resolve_config_path,
    saved_run_config,
    to_dict,
    to_yaml,
)
from jaxpar.config.schema import (
    BATCH_AXES,
    LOGICAL_AXES,
    MESH_AXES,
    PRESETS_DIR,
    VOCAB_AXES,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DcnConfig,
    DistributedConfig,
    GenerationConfig,
    LoggingConfig,
    LoraConfig,
    MeshConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    OffloadConfig,
    ParallelConfig,
    ProfileConfig,
    RopeScalingConfig,
    SourceConfig,
    TrainConfig,
    WandbConfig,
)
from jaxpar.config.validation import check_generation, documents_masked, slices_line, validate

__all__ = [
    "BATCH_AXES", "LOGICAL_AXES", "MESH_AXES", "PRESETS_DIR", "VOCAB_AXES", "CheckpointConfig",
    "Config",
    "ConfigError", "DataConfig", "DcnConfig", "DistributedConfig", "GenerationConfig",
    "LoggingConfig", "LoraConfig", "MeshConfig", "MLAConfig",
    "ModelConfig", "MoEConfig", "OffloadConfig", "ParallelConfig", "ProfileConfig",
    "RopeScalingConfig",
    "SourceConfig", "TrainConfig", "WandbConfig",
    "config_from_dict", "load_config", "parse_overrides", "resolve_config_path", "saved_run_config",
    "to_dict",
    "to_yaml", "check_generation", "documents_masked", "slices_line", "validate",
]
