"""`colibri-eval` and `colibri-lm-eval` print --help and --version without importing torch.

Importing torch (and transformers, lm-eval's model registry) costs seconds; the help paths need
none of it. Each check runs in a fresh `python -c`, where sys.modules shows what was imported.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

NEVER_FOR_HELP = ("torch", "transformers", "colibri_model.model", "colibri_stream.engine")

PROBE = """
import json, sys
{run}
never = {never!r}
print(json.dumps([m for m in never if m in sys.modules]))
"""

EVAL_HELP = """
from colibri_eval.cli import main
for argv in [["--help"], ["--version"]] + [[name, "--help"] for name in main.commands]:
    try:
        main(argv, prog_name="colibri-eval")
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
"""

LM_EVAL_HELP = """
from colibri_eval import lm_eval
for argv in [["--help"], ["--version"], [], ["run"], ["run", "--help"], ["ls", "-h"]]:
    sys.argv = ["colibri-lm-eval", *argv]
    try:
        lm_eval.main()
    except SystemExit as exit:
        assert exit.code in (0, None), (argv, exit.code)
"""


def _imported(run: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(run=run, never=NEVER_FOR_HELP)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_colibri_eval_help_imports_no_torch():
    assert _imported(EVAL_HELP) == []


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")
def test_colibri_lm_eval_help_imports_no_torch():
    assert _imported(LM_EVAL_HELP) == []


@pytest.mark.parametrize(("args", "expected"), [
    ([], True), (["run"], True), (["--help"], True), (["run", "-h", "--model", "hf"], True),
    (["run", "--model", "hf"], False), (["ls", "tasks"], False), (["run", "--", "--help"], False),
])
def test_which_arguments_only_ask_for_help(args, expected):
    from colibri_eval.lm_eval import _asks_for_help

    assert _asks_for_help(args) is expected
