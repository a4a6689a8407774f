"""`colibri --help`, `--version` and every command's --help start without torch.

Importing torch and the trainer costs about 2 s on a 2-vCPU box; `train` imports relay_leg inside
its body. The check runs in a fresh `python -c`, where sys.modules shows what was imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

NEVER_FOR_HELP = ("torch", "numpy", "colibri_model.model", "colibri_model.training", "colibri.relay_leg")

PROBE = """
import json, sys
from colibri.cli import main
for argv in [["--help"], ["--version"]] + [[name, "--help"] for name in main.commands]:
    try:
        main(argv, prog_name="colibri")
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
    assert {"train", "status", "demo"} <= set(result["commands"])
    assert result["imported"] == []
