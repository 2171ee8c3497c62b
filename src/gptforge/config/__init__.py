"""Typed configuration: schema (dataclasses), loading (YAML, `_base_`, `-o`), derivation."""

from gptforge.config.loader import (
    ARCH_KEYS,
    apply_overrides,
    config_to_yaml,
    load_config,
    load_raw,
    save_config,
)
from gptforge.config.resolve import check_train_shapes, resolve, resolve_model
from gptforge.config.schema import (
    CompressConfig,
    Config,
    DataConfig,
    DistributedConfig,
    EngineConfig,
    GenerationConfig,
    GlobalConfig,
    InferenceConfig,
    ModelConfig,
    OfflineEvalConfig,
    OptimizerConfig,
    PruneConfig,
    QuantizationConfig,
)
from gptforge.config.typed import build_config

__all__ = [
    "ARCH_KEYS",
    "Config",
    "CompressConfig",
    "DataConfig",
    "DistributedConfig",
    "EngineConfig",
    "GenerationConfig",
    "GlobalConfig",
    "InferenceConfig",
    "ModelConfig",
    "OfflineEvalConfig",
    "OptimizerConfig",
    "PruneConfig",
    "QuantizationConfig",
    "apply_overrides",
    "build_config",
    "check_train_shapes",
    "config_to_yaml",
    "load_config",
    "load_raw",
    "resolve",
    "resolve_model",
    "save_config",
]
