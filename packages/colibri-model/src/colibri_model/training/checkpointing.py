"""Training checkpoints: atomic directories under RUN/checkpoints/.

    RUN/checkpoints/step_00001000/
        config.json, model.safetensors, tokenizer.json   the model checkpoint (CHECKPOINT.md)
        optimizer.safetensors                            AdamW moments (optimizer_io.py)
        training_state.json                              step, loader, RNG, schedule (state.py)

A checkpoint is written into `RUN/checkpoints/.tmp-step_00001000-<id>/`, every file flushed,
then the directory is renamed to its final name in one `rename(2)`. A crash mid-save leaves
only a `.tmp-*` directory, which readers never consider and the next run deletes; a directory
named `step_*` is therefore always complete. The newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..checkpoint import save_checkpoint
from .optimizer_io import OPTIMIZER_FILE, write_optimizer
from .state import TRAINING_STATE_FILE, TrainingState, write_training_state

CHECKPOINTS_DIR = "checkpoints"
DCP_FILE = "dcp.json"  # marks a DCP checkpoint (dcp_checkpoint.py); its absence, the single-file format
_NAME = re.compile(r"^step_(\d{8,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_dcp_checkpoint(directory: str | os.PathLike) -> bool:
    """A checkpoint in the DCP layout of sharded runs (dcp_checkpoint.py), not the single file."""
    return (Path(directory) / DCP_FILE).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / TRAINING_STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial_checkpoints(run_dir: str | os.PathLike) -> None:
    root = Path(run_dir) / CHECKPOINTS_DIR
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(directory: Path, files: bool = True) -> None:
    """Flush every file under `directory` (subdirectories too) and the directories themselves."""
    for path in sorted(directory.rglob("*"), reverse=True) if files else []:
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(directory)


class StateView:
    """What checkpoint.save_checkpoint needs of a model: its config and a state dict.

    NOTE: lets a rank-0 copy gathered from an FSDP2-sharded model be written by the one
    checkpoint writer of CHECKPOINT.md, without materialising a second model.
    """

    def __init__(self, config, state: dict):
        self.config, self._state = config, state

    def state_dict(self) -> dict:
        return self._state


def write_checkpoint(run_dir: str | os.PathLike, config, model_state: dict, optimizer_payload: tuple[dict, dict],
                     state: TrainingState, tokenizer_json: str | None, keep: int) -> Path:
    """Write one complete checkpoint atomically; returns its final path."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(state.step)
    if final.exists():  # a second save at the same step (e.g. end right after a periodic save)
        return final
    tmp = root / f".tmp-{final.name}-{state.checkpoint_id[:8]}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_checkpoint(StateView(config, model_state), tmp, tokenizer_json=tokenizer_json)
    write_optimizer(tmp / OPTIMIZER_FILE, optimizer_payload)
    write_training_state(tmp, state)
    fsync_tree(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
