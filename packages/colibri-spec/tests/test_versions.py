"""The one version check, and the versioned-JSON reader built on it."""

from __future__ import annotations

import json

import pytest
from colibri_spec import SpecError, VersionMismatchError, major, read_versioned_json, require_major
from pydantic import BaseModel


class Manifest(BaseModel):
    manifest_version: str
    shards: int


class ManifestError(SpecError):
    pass


class ManifestVersionError(ManifestError, VersionMismatchError):
    pass


def test_same_major_passes_another_fails_naming_both():
    assert major("1.2") == "1" and major("7") == "7"
    require_major("1.9", "1.0", key="v", where="f")
    with pytest.raises(VersionMismatchError, match=r"^f: v 2.0 is not supported \(this colibri-x reads 1.0\)$"):
        require_major("2.0", "1.0", key="v", where="f", reader="colibri-x")
    with pytest.raises(VersionMismatchError, match=r"f: v \(missing\) is not supported"):
        require_major(None, "1.0", key="v", where="f")


def test_a_package_error_that_is_also_a_version_mismatch():
    with pytest.raises(ManifestError) as caught:
        require_major("3.0", "1.0", key="manifest_version", where="m.json", error=ManifestVersionError)
    assert isinstance(caught.value, VersionMismatchError) and caught.value.found == "3.0"
    with pytest.raises(ManifestError, match="^m.json: v 3.0"):  # a plain error class gets the same message
        require_major("3.0", "1.0", key="v", where="m.json", error=ManifestError)


def test_read_versioned_json(tmp_path):
    path = tmp_path / "manifest.json"
    kwargs = dict(version_key="manifest_version", version="1.0", error=ManifestError, missing="not a data dir",
                  what="manifest")
    with pytest.raises(ManifestError, match=r"manifest.json: missing \(not a data dir\)"):
        read_versioned_json(path, Manifest, **kwargs)
    path.write_text(json.dumps({"manifest_version": "1.1", "shards": 3}))
    assert read_versioned_json(path, Manifest, **kwargs).shards == 3
    path.write_text(json.dumps({"manifest_version": "2.0", "shards": 3}))
    with pytest.raises(ManifestError, match=r"manifest_version 2.0 is not supported \(this colibri-spec reads 1.0\)"):
        read_versioned_json(path, Manifest, **kwargs)
    path.write_text(json.dumps({"manifest_version": "1.0", "shards": "many"}))
    with pytest.raises(ManifestError, match="invalid manifest: .*shards"):
        read_versioned_json(path, Manifest, **kwargs)
