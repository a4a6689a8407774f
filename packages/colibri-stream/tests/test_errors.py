"""Every colibri-stream error is defined in errors.py, derives from StreamError and carries the
exit code the command line gives it (exit_status.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import colibri_stream
from colibri_int4 import ChecksumError, ContainerError
from colibri_stream import errors
from colibri_stream.exit_status import CheckFailed, InputError, click_error

SRC = Path(colibri_stream.__file__).parent


def test_every_error_class_is_defined_in_errors_py():
    elsewhere = sorted(
        f"{path.relative_to(SRC)}: {node.name}"
        for path in SRC.rglob("*.py") if path.name != "errors.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Error")
    )
    assert elsewhere == ["exit_status.py: InputError"]  # click's exception for the one-line message


def test_every_error_derives_from_stream_error_and_carries_its_exit_code():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__ and issubclass(c, Exception) and not issubclass(c, Warning)]
    assert len(classes) == 13
    for cls in classes:
        assert issubclass(cls, errors.StreamError), cls
        assert cls.exit_code == (1 if cls is errors.ExpertCorruptError else 2), cls


def test_the_two_errors_defined_beside_their_code_derive_from_stream_error_too():
    from colibri_stream.io.accounting import ProcIOUnavailable
    from colibri_stream.serve.errors import APIError

    assert issubclass(ProcIOUnavailable, errors.StreamError) and issubclass(ProcIOUnavailable, RuntimeError)
    assert issubclass(APIError, errors.StreamError)


def test_click_error_follows_the_exit_code():
    assert isinstance(click_error(errors.ExpertCorruptError("blob", 1, 2)), CheckFailed)
    assert isinstance(click_error(ChecksumError("crc")), CheckFailed)
    assert isinstance(click_error(ContainerError("bad")), InputError)
    assert isinstance(click_error(errors.TraceVersionError("v")), InputError)
    assert isinstance(click_error(ValueError("plain")), InputError)
