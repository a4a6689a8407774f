"""The package's public names are imported on first use (colibri_int4/__init__.py), so that
`from colibri_int4 import Int4Error` (colibri-stream's CLI) costs no numpy; each still resolves
to its module's object, and the TYPE_CHECKING imports list the same names."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_public_names_resolve_lazily_to_their_modules():
    import colibri_int4 as package

    tree = ast.parse(Path(package.__file__).read_text())
    typed = {alias.name: node.module for block in tree.body if isinstance(block, ast.If)
             for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == package._MODULE_OF
    assert sorted(package.__all__) == sorted(package._MODULE_OF)
    for name, module in package._MODULE_OF.items():
        assert getattr(package, name) is getattr(importlib.import_module(f"colibri_int4.{module}"), name)
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        package.NoSuchName  # noqa: B018


def test_the_error_types_import_without_numpy_and_help_without_torch():
    code = ("import json, sys\nfrom colibri_int4 import Int4Error\nlight = 'numpy' not in sys.modules\n"
            "from colibri_int4.cli import main\n"
            "for argv in [['--help'], ['--version']] + [[name, '--help'] for name in main.commands]:\n"
            "    try:\n        main(argv, prog_name='colibri-int4')\n"
            "    except SystemExit as exit:\n        assert exit.code == 0, (argv, exit.code)\n"
            "print(json.dumps([light, 'torch' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [True, False]
