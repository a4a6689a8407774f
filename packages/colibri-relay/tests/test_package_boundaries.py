"""colibri-relay must stay installable without torch and without other colibri packages than
colibri-spec (pydantic only: the schemas it reads, metrics.jsonl and the version check)."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "colibri_relay"
ALLOWED = {"huggingface_hub", "pydantic", "click", "filelock", "colibri_relay", "colibri_spec", "pytest"}


def test_imports_only_allowed_third_party_packages():
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top not in ALLOWED:
                    bad.append(f"{path.name}: {name}")
    assert bad == []


def test_importing_everything_loads_no_torch():
    code = ("import sys, colibri_relay, colibri_relay.cli, colibri_relay.hub, colibri_relay.testing;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') or (m.startswith('colibri') and "
            "not m.startswith(('colibri_relay', 'colibri_spec')))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
