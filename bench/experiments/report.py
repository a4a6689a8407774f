"""The experiments' output: a versioned results JSON (EXPERIMENT_JSON.md) and a PNG of its curves.

`write_result` stamps what a reader needs to trust the numbers (commit, machine, torch, the
command and the wall time) and checks the document against the schema before writing, so a
smoke test that reads it back checks the same schema the plots and RESULTS.md rely on.
matplotlib is an optional extra (`pip install -e '.[experiments]'`); it is imported only when
a figure is drawn.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

EXPERIMENT_VERSION = "1.0"
REQUIRED = {"experiment_version": str, "experiment": str, "finding": str, "created": str, "commit": str,
            "machine": dict, "command": str, "wall_s": float, "settings": dict, "runs": list, "summary": dict}


class ExperimentFormatError(ValueError):
    """A results document that does not follow EXPERIMENT_JSON.md."""


def machine() -> dict:
    model = platform.processor() or "unknown"
    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                      if line.startswith("model name")), model)
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    return {"cpu": model, "avx512": " avx512f" in flags, "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# The code a result came from is the checkout when the experiment STARTED (scripts import this
# module first thing); HEAD at the end may already hold later edits.
COMMIT_AT_START = commit()


def check_result(doc: dict, where: str = "result") -> dict:
    """Raise ExperimentFormatError naming the first missing or mistyped field."""
    if not isinstance(doc, dict):
        raise ExperimentFormatError(f"{where}: not a JSON object")
    version = str(doc.get("experiment_version", ""))
    if version.split(".")[0] != EXPERIMENT_VERSION.split(".")[0]:
        raise ExperimentFormatError(f"{where}: experiment_version {version or '(none)'} is not supported "
                                    f"(this reader knows {EXPERIMENT_VERSION})")
    for key, kind in REQUIRED.items():
        if key not in doc:
            raise ExperimentFormatError(f"{where}: missing field {key!r}")
        if not isinstance(doc[key], kind if kind is not float else (int, float)):
            raise ExperimentFormatError(f"{where}: field {key!r} is not a {kind.__name__}")
    for i, run in enumerate(doc["runs"]):
        for key in ("name", "curves", "final"):
            if key not in run:
                raise ExperimentFormatError(f"{where}: runs[{i}] has no {key!r}")
        for curve, values in run["curves"].items():
            steps = values.get("step")
            if steps is None or any(len(v) != len(steps) for v in values.values()):
                raise ExperimentFormatError(f"{where}: runs[{i}].curves.{curve}: series of unequal length")
    return doc


def write_result(out: Path, experiment: str, finding: str, settings: dict, runs: list[dict], summary: dict,
                 started: float) -> Path:
    doc = {"experiment_version": EXPERIMENT_VERSION, "experiment": experiment, "finding": finding,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": COMMIT_AT_START,
           "machine": machine(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "wall_s": round(time.time() - started, 1), "settings": settings, "runs": runs, "summary": summary}
    check_result(json.loads(json.dumps(doc)))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{experiment}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_result(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ExperimentFormatError(f"{path}: not JSON ({exc})") from None
    return check_result(doc, str(path))


def spread(values: list[float]) -> dict:
    """mean, min, max and sample standard deviation (0 for one value) of per-seed numbers."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def exceeds_spread(a: list[float], b: list[float]) -> bool | None:
    """True when the two sets of per-seed values do not overlap: every seed of one beats every
    seed of the other (with 2-3 seeds the only honest test of 'beyond seed-to-seed noise').
    None when either side has a single seed: there is no spread to compare with."""
    if len(a) < 2 or len(b) < 2:
        return None
    return max(a) < min(b) or max(b) < min(a)


def same_sign_every_seed(differences: list[float]) -> bool | None:
    """Paired view (same seed = same init and data order on both sides): True when the per-seed
    difference has the same sign for every seed. None with a single seed."""
    if len(differences) < 2:
        return None
    return all(d > 0 for d in differences) or all(d < 0 for d in differences)


def figure(rows: int, cols: int, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.1 * rows), squeeze=False)
    fig.suptitle(title, fontsize=10)
    return fig, axes


def save_figure(fig, out: Path, experiment: str) -> Path:
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / f"{experiment}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
