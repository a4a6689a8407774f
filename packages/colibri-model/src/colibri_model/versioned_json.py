"""The one reader of the small versioned JSON files colibri-model writes beside its data and
checkpoints (the data manifest, training_state.json, dcp.json): present, valid JSON, an object,
the same major version as this reader, then the pydantic model. Every failure is one `error`
naming the file; the caller says what a missing file means."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def read_versioned_json(path: Path, model: type[Model], *, version_key: str, version: str,
                        error: type[Exception], missing: str, what: str) -> Model:
    """`model` validated from `path`; `version_key` must hold `version`'s major number.
    `missing` is said when the file is absent, `what` names the object in validation errors."""
    if not path.is_file():
        raise error(f"{path}: missing ({missing})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    found = str(data.get(version_key, ""))
    if found.split(".")[0] != version.split(".")[0]:
        raise error(f"{path}: {version_key} {found or '(missing)'} is not supported (this colibri-model reads {version})")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{path}: invalid {what}: {' '.join(str(exc).splitlines()[:3])}") from None
