"""The config side of a Colibri checkpoint (CHECKPOINT.md): its file names, its format version,
and the one reader and writer of its `config.json`, which other packages call instead of
parsing the file themselves (colibri-int4 carries the object in a container header,
colibri-stream rebuilds a `ColibriConfig` from it). The tensors are colibri-model's to read and
write; their names and shapes are in tensor_table.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .config import SCHEMA_VERSION, ColibriConfig
from .errors import CheckpointFormatError, CheckpointVersionError
from .versioned_json import read_json_object
from .versions import require_major

FORMAT_VERSION = "1.0"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MODEL_TYPE = "colibri"


def checkpoint_config_dict(config: ColibriConfig) -> dict:
    """The config.json object of a checkpoint of `config` (CHECKPOINT.md): the config's fields
    plus `format_version` and `model_type`. `parse_checkpoint_config` reads it back."""
    return {"format_version": FORMAT_VERSION, "model_type": MODEL_TYPE, **config.to_dict()}


def config_to_checkpoint_json(config: ColibriConfig) -> str:
    """The text of a checkpoint's config.json for `config`."""
    return json.dumps(checkpoint_config_dict(config), indent=2) + "\n"


def read_config(directory: str | os.PathLike) -> ColibriConfig:
    """Parse and validate `config.json` of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    data = read_json_object(path, error=CheckpointFormatError, missing="not a Colibri checkpoint directory")
    return parse_checkpoint_config(data, str(path))


def parse_checkpoint_config(data: dict, where: str) -> ColibriConfig:
    """The validated `ColibriConfig` of a checkpoint's config.json object: the one reader of
    that format, for checkpoint directories and for the copy an int4 container carries.
    `where` names the source in errors (every error is a `CheckpointFormatError`; one of another
    major version a `CheckpointVersionError`, which names both versions).

    `model_type` is required, like `format_version`: every writer has always written it, and it
    is what tells a Colibri config.json from another model's config.json of the same shape.
    """
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
    data = dict(data)
    version = data.pop("format_version", None)
    if version is None:
        raise CheckpointFormatError(f"{where}: no format_version field")
    require_major(version, FORMAT_VERSION, key="checkpoint format_version", where=where, error=CheckpointVersionError)
    if "model_type" not in data:
        raise CheckpointFormatError(f"{where}: no model_type field (expected {MODEL_TYPE!r})")
    model_type = data.pop("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointFormatError(f"{where}: model_type {model_type!r} is not {MODEL_TYPE!r}")
    if "schema_version" in data:
        require_major(data["schema_version"], SCHEMA_VERSION, key="config schema_version", where=where,
                      error=CheckpointVersionError)
    try:
        return ColibriConfig.model_validate(data)
    except ValueError as exc:
        first = str(exc).splitlines()
        raise CheckpointFormatError(f"{where}: invalid config: {' '.join(first[:3])}") from None


def load_config(path: str | os.PathLike) -> ColibriConfig:
    """A config JSON file: a bare config (`ColibriConfig.save`), or a checkpoint's config.json
    (whose `format_version` is checked and stripped). Like `json.loads` and pydantic, it raises
    `OSError`, `ValueError` (not JSON) or `pydantic.ValidationError` (a bare config's field), and
    `CheckpointFormatError` for a checkpoint's config.json."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "format_version" in data:
        return parse_checkpoint_config(data, str(path))
    return ColibriConfig.model_validate(data)
