"""One base for colibri-model's errors, in one module, each with the exit code the CLI gives it."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import colibri_model
from colibri_model import errors
from colibri_model.errors import ColibriModelError, TrainingDivergedError

SRC = Path(colibri_model.__file__).parent


def test_every_error_class_is_defined_in_errors_py():
    elsewhere = []
    for path in SRC.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                elsewhere.append(f"{path.relative_to(SRC)}: {node.name}")
    assert elsewhere == ["cli/training.py: UserError"]  # click's exception for the one-line message


def test_every_error_derives_from_the_base_and_carries_its_exit_code():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) == 15
    for cls in classes:
        assert issubclass(cls, ColibriModelError)
        expected = (1, RuntimeError) if cls is TrainingDivergedError else (2, ValueError if cls is not ColibriModelError else Exception)
        assert cls.exit_code == expected[0] and issubclass(cls, expected[1]), cls


def test_the_old_import_paths_name_the_same_classes():
    from colibri_model.data.manifest import ManifestError
    from colibri_model.training import TrainingDivergedError as diverged
    from colibri_model.training.state import TrainingStateError

    assert ManifestError is errors.ManifestError and TrainingStateError is errors.TrainingStateError
    assert diverged is TrainingDivergedError


def test_errors_import_no_torch():
    code = "import sys, colibri_model.errors; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
