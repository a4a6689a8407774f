"""A results file of another major version is refused naming both versions; a newer minor reads."""

from __future__ import annotations

import json

import pytest
from colibri_eval import RESULTS_VERSION, ResultsFormatError, ResultsVersionError, read_results
from colibri_spec import VersionMismatchError


def test_another_major_results_version_names_both(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results_version": "9.0"}))
    with pytest.raises(ResultsVersionError) as caught:
        read_results(path)
    assert str(caught.value) == f"{path}: results_version 9.0 is not supported (this colibri-eval reads {RESULTS_VERSION})"
    assert isinstance(caught.value, ResultsFormatError) and isinstance(caught.value, VersionMismatchError)
    assert caught.value.exit_code == 2
