"""`training_state.json`: everything besides weights and optimizer moments that resume needs.

Step and tokens seen, the schedule phase, the loader position, the RNG states (base64 of torch's
byte states; numpy's and Python's as JSON), the hash of the model config (a checkpoint of
another model is refused), the full TrainConfig, and the checkpoint's id and its parent's id
(legs of one run form a chain; a WSD decay branch names the stable checkpoint it left from),
and the compute environment that decides the bits of a step (torch build, CPU capability,
intra-op threads, device), so a resume that cannot be bit-identical says so (TRAINING.md,
"Exact resume"). JSON, never pickle; spec in TRAINING.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from colibri_spec import read_versioned_json
from pydantic import BaseModel, ConfigDict

from ..config import ColibriConfig
from ..data.loader import LoaderPosition
from ..errors import TrainingStateError
from .schedules import ScheduleState

TRAINING_STATE_FILE = "training_state.json"
TRAINING_STATE_VERSION = "1.1"  # 1.1: `environment` (absent in 1.0 files, which still load)


class ResumeNotBitIdenticalWarning(UserWarning):
    """A resume whose compute environment differs from the one that wrote the checkpoint.

    The state is restored exactly, but the next steps run other kernels (another torch build or
    CPU capability) or another reduction order (another thread count or world size), so they
    match a straight run only to rounding, not bit for bit.
    """


class ComputeEnvironment(BaseModel):
    """What, besides the state, decides the bits of a training step on this process.

    Measured on CPU (tests/test_train_resume.py): a resume with another intra-op
    thread count (1 vs 2) or another ATen CPU capability (avx2 vs avx512) drifts by 1 ulp
    within two steps; system load, scheduling and the checkpoint's file layout do not matter.
    """

    model_config = ConfigDict(extra="forbid")
    torch_version: str  # includes the build tag (e.g. 2.13.0+cpu)
    torch_git_version: str  # the exact source commit of the build, whose MKL/oneDNN come with it
    cpu_capability: str  # the kernels ATen dispatches to (ATEN_CPU_CAPABILITY overrides the probe)
    intra_op_threads: int  # torch.get_num_threads(): MKL and ATen split reductions by it
    device: str  # "cpu" or "cuda:<device name>"
    world_size: int


def current_environment(device: torch.device, world_size: int) -> ComputeEnvironment:
    name = "cpu"
    if device.type == "cuda":
        name = f"cuda:{torch.cuda.get_device_name(device)}"
    elif device.type != "cpu":
        name = device.type
    return ComputeEnvironment(
        torch_version=torch.__version__, torch_git_version=str(torch.version.git_version),
        cpu_capability=torch.backends.cpu.get_cpu_capability(), intra_op_threads=torch.get_num_threads(),
        device=name, world_size=world_size,
    )


def environment_differences(saved: ComputeEnvironment | None, current: ComputeEnvironment) -> list[str]:
    """`field: saved -> current` for every field that differs (none for a 1.0 file without a record)."""
    if saved is None:
        return []
    a, b = saved.model_dump(), current.model_dump()
    return [f"{key}: {a[key]} -> {b[key]}" for key in a if a[key] != b[key]]


class RngState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    torch_cpu: str
    torch_cuda: list[str] | None = None
    numpy: list
    python: list


class TrainingState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    training_state_version: str = TRAINING_STATE_VERSION
    kind: str = "pretrain"  # pretrain | sft
    checkpoint_id: str
    parent_checkpoint_id: str | None = None
    step: int
    tokens_seen: int
    skipped_steps: int = 0
    bad_steps_in_row: int = 0
    schedule: ScheduleState
    loader: LoaderPosition
    rng: RngState
    config_hash: str
    train_config: dict
    data_fingerprint: str
    world_size: int
    created_at: float
    environment: ComputeEnvironment | None = None  # since 1.1


def config_hash(config: ColibriConfig) -> str:
    """sha256 of the model config (every field but the display name)."""
    payload = config.to_dict()  # a config without 1.1 features hashes as it did under schema 1.0
    payload.pop("name", None)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> RngState:
    np_state = np.random.get_state()
    cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None
    py = random.getstate()
    return RngState(
        torch_cpu=_b64(torch.get_rng_state()),
        torch_cuda=cuda,
        numpy=[np_state[0], np_state[1].tolist(), *np_state[2:]],
        python=[py[0], list(py[1]), py[2]],
    )


def restore_rng(rng: RngState) -> None:
    torch.set_rng_state(_unb64(rng.torch_cpu))
    if rng.torch_cuda and torch.cuda.is_available() and len(rng.torch_cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in rng.torch_cuda])
    n = rng.numpy
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))
    p = rng.python
    random.setstate((p[0], tuple(p[1]), p[2]))


def read_training_state(directory: str | os.PathLike) -> TrainingState:
    return read_versioned_json(Path(directory) / TRAINING_STATE_FILE, TrainingState,
                               version_key="training_state_version", version=TRAINING_STATE_VERSION,
                               error=TrainingStateError, what="training state",
                               missing="a model checkpoint, but not a resumable training checkpoint", reader="colibri-model")


def write_training_state(directory: str | os.PathLike, state: TrainingState) -> None:
    (Path(directory) / TRAINING_STATE_FILE).write_text(state.model_dump_json(indent=2) + "\n")
