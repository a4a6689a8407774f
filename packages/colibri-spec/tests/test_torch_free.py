"""colibri-spec loads no torch and no numpy: the relay (which may not import torch) depends on it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_every_module_loads_neither_torch_nor_numpy():
    code = ("import sys, pkgutil, importlib, colibri_spec\n"
            "for m in pkgutil.walk_packages(colibri_spec.__path__, 'colibri_spec.'):\n"
            "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
            "colibri_spec.checkpoint_tensor_shapes(colibri_spec.get_preset('grande'))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
