"""bench/gpu_check.sh runs here, on CPU, in its smoke mode: the same driver, planner, trainer,
measurement and summary that the one GPU run relies on; and it fails clearly without pydantic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _run(tmp_path, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), **env})


def test_cpu_smoke_gives_every_figure(tmp_path):
    done = _run(tmp_path, "--cpu-smoke", PYTHON=sys.executable)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("== gpu_check summary =="):]
    for line in ("throughput", "peak memory", "activations", "host syncs    not countable (CPU)", "loss"):
        assert line in summary, line
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["preset"] == "tiny" and report["micro_batch"] == 4 and report["steps"] == 12
    assert report["loss_went_down"] and report["loss_last"] < report["loss_first"]
    assert report["tokens_per_s"] > 0 and report["mfu"] is None  # no peak on CPU
    memory = report["memory"]
    assert 0.9 <= memory["activations_planned_over_measured"] <= 1.1, memory
    assert (tmp_path / "gpu_check.log").read_text().count("step") >= 12


def test_missing_pydantic_without_wheels_is_a_setup_error(tmp_path):
    python = tmp_path / "python-without-site"  # an interpreter that sees no site-packages: no pydantic
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    done = _run(tmp_path, "--cpu-smoke", PYTHON=str(python), COLIBRI_WHEELS=str(empty))
    assert done.returncode == 2
    assert "has no pydantic" in done.stderr and "make gpu-wheels" in done.stderr
