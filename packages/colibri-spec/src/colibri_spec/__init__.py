"""colibri-spec: the schemas of the files Colibri's packages exchange, and their one reader each.

pydantic and the standard library only (no torch, no numpy), so every package, the relay's
dashboard included, can depend on it. See CHECKPOINT.md and METRICS.md beside this file.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

from .checkpoint_config import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL_TYPE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    checkpoint_config_dict,
    config_to_checkpoint_json,
    load_config,
    parse_checkpoint_config,
    read_config,
)
from .config import SCHEMA_VERSION, V1_1_DEFAULTS, V1_2_DEFAULTS, ColibriConfig
from .errors import (
    CheckpointFormatError,
    CheckpointVersionError,
    ConfigError,
    FP8ConfigError,
    HFConfigError,
    MetricsFormatError,
    MetricsVersionError,
    SpecError,
    VersionMismatchError,
)
from .metrics import (
    METRICS_FILE,
    METRICS_VERSION,
    MetricsLine,
    MetricsRecord,
    RouterLayerMetrics,
    ScannedMetrics,
    parse_metrics_text,
    read_metrics,
    scan_metrics_lines,
)
from .mla_cost import MLA_FORMS, MlaForm, cheaper_mla_form, mla_form_flops, most_decompressed_keys
from .param_count import count_params, mla_params
from .presets import PRESETS, get_preset
from .rope_scaling import RopeScaling
from .tensor_table import ModelShape, TensorShapeFields, checkpoint_tensor_shapes, expert_tensor_names
from .versioned_json import read_json_object, read_versioned_json
from .versions import major, require_major

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-spec")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CONFIG_FILE", "FORMAT_VERSION", "METRICS_FILE", "METRICS_VERSION", "MLA_FORMS", "MODEL_TYPE", "PRESETS", "SCHEMA_VERSION",
    "TOKENIZER_FILE", "V1_1_DEFAULTS", "V1_2_DEFAULTS", "WEIGHTS_FILE",
    "CheckpointFormatError", "CheckpointVersionError", "ColibriConfig", "ConfigError", "FP8ConfigError",
    "HFConfigError", "MetricsFormatError",
    "MetricsLine", "MetricsRecord", "MetricsVersionError", "MlaForm", "ModelShape", "RopeScaling", "RouterLayerMetrics", "ScannedMetrics",
    "SpecError", "TensorShapeFields", "VersionMismatchError",
    "cheaper_mla_form", "checkpoint_config_dict", "checkpoint_tensor_shapes", "config_to_checkpoint_json", "count_params", "expert_tensor_names",
    "get_preset", "load_config", "major", "mla_form_flops", "mla_params", "most_decompressed_keys", "parse_checkpoint_config",
    "parse_metrics_text", "read_config", "read_json_object", "read_metrics", "read_versioned_json", "require_major",
    "scan_metrics_lines",
]
