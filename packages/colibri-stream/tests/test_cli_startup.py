"""`colibri-stream --help`, `--version` and every command's --help start without torch.

Importing torch costs about 2 s on a 2-vCPU box, ten times the rest of the start; the package's
public names are therefore imported on first use (colibri_stream/__init__.py) and the commands
import the engine inside their bodies. Each check runs in a fresh `python -c`, where sys.modules
shows what the help paths really imported.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

NEVER_FOR_HELP = ("torch", "numpy", "safetensors", "colibri_model.model", "colibri_int4.container")

PROBE = """
import json, sys
from colibri_stream.cli import main
for argv in [["--help"], ["--version"]] + [[name, "--help"] for name in main.commands]:
    try:
        main(argv, prog_name="colibri-stream")
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
never = {never!r}
print(json.dumps({{"commands": sorted(main.commands), "imported": [m for m in never if m in sys.modules]}}))
"""


def test_help_and_version_import_no_torch():
    out = subprocess.run([sys.executable, "-c", PROBE.format(never=NEVER_FOR_HELP)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert {"generate", "chat", "plan", "serve", "bench"} <= set(result["commands"])
    assert result["imported"] == []


def test_public_names_resolve_lazily_to_their_modules():
    import colibri_stream as package

    tree = ast.parse(Path(package.__file__).read_text())
    typed = {alias.name: node.module for block in tree.body if isinstance(block, ast.If)
             for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == package._MODULE_OF  # the TYPE_CHECKING imports say what __getattr__ does
    assert sorted(package.__all__) == sorted(package._MODULE_OF)
    for name, module in package._MODULE_OF.items():
        assert getattr(package, name) is getattr(importlib.import_module(f"colibri_stream.{module}"), name)
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        package.NoSuchName  # noqa: B018


def test_opening_an_engine_and_decoding_import_no_compiler(tiny):
    """torch._dynamo (about 2 s and 70 MB of anonymous memory: a tenth of a small cap) is never
    imported to open a container, prefill and decode."""
    probe = ("import sys\n"
             "from colibri_stream import Engine\n"
             f"with Engine.open({str(tiny[0])!r}, ram_budget='200MB', compute='native') as engine:\n"
             "    session = engine.session()\n"
             "    session.append(list(range(3, 20)))\n"
             "    session.append([5])\n"
             "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
