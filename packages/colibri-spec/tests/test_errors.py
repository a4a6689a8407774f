"""colibri-spec's errors: all in errors.py, under SpecError (exit code 2), version errors also
VersionMismatchError."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import colibri_spec
from colibri_spec import errors

SRC = Path(colibri_spec.__file__).parent


def test_every_error_class_is_defined_in_errors_py():
    elsewhere = [f"{path.relative_to(SRC)}: {node.name}" for path in SRC.rglob("*.py") if path.name != "errors.py"
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
    assert elsewhere == []


def test_every_error_is_a_spec_error_with_exit_code_2_or_the_version_base():
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if cls is errors.VersionMismatchError:
            continue
        assert issubclass(cls, errors.SpecError) and cls.exit_code == 2, cls
        assert cls.__name__ in colibri_spec.__all__, cls
        if "Version" in cls.__name__:
            assert issubclass(cls, errors.VersionMismatchError), cls
