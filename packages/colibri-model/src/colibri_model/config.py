"""ColibriConfig lives in colibri-spec (torch-free, shared by every package); this module
re-exports it so `from colibri_model.config import ColibriConfig` keeps working."""

from colibri_spec import SCHEMA_VERSION, V1_1_DEFAULTS, V1_2_DEFAULTS, ColibriConfig, ConfigError, RopeScaling

__all__ = ["SCHEMA_VERSION", "V1_1_DEFAULTS", "V1_2_DEFAULTS", "ColibriConfig", "ConfigError", "RopeScaling"]
