"""The one reader of small versioned JSON files (a checkpoint's config.json, the data manifest,
training_state.json, dcp.json, ...): present, valid JSON, an object, the same major version as
this reader (`require_major`), then the pydantic model. Every failure is one `error` naming the
file; the caller says what a missing file means."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .versions import require_major

Model = TypeVar("Model", bound=BaseModel)


def read_json_object(path: Path, *, error: type[Exception], missing: str) -> dict:
    """The JSON object in `path`; `error` when it is absent (saying `missing`), not JSON or not an object."""
    if not path.is_file():
        raise error(f"{path}: missing ({missing})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def read_versioned_json(path: Path, model: type[Model], *, version_key: str, version: str,
                        error: type[Exception], missing: str, what: str, reader: str = "colibri-spec") -> Model:
    """`model` validated from `path`; `version_key` must hold `version`'s major number.
    `missing` is said when the file is absent, `what` names the object in validation errors,
    `reader` names this reader in a version mismatch."""
    data = read_json_object(path, error=error, missing=missing)
    require_major(data.get(version_key), version, key=version_key, where=str(path), reader=reader, error=error)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{path}: invalid {what}: {' '.join(str(exc).splitlines()[:3])}") from None
