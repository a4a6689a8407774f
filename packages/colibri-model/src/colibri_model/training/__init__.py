"""Training: the Trainer (pretraining and SFT, single process or torchrun DDP/FSDP2) and its parts.

- config.py        TrainConfig (global batch, schedule, eval/save cadence, precision)
- schedules.py     WSD (1-sqrt decay, on command) and cosine learning rates
- trainer.py       the Trainer: construction, validation, the loop (metrics, eval and save cadence)
- optimizer_step.py  one step: accumulation, clipping, skip of non-finite steps (a Trainer base)
- run_checkpoints.py the Trainer's resume checks and restore, save and export (a Trainer base)
- state.py         training_state.json (step, loader, RNG, schedule, config hash, parent id,
                   compute environment)
- optimizer_io.py  AdamW and its state in safetensors
- checkpointing.py atomic checkpoint directories under RUN/checkpoints/
- metrics.py       metrics.jsonl schema (metrics_version) and MFU
- validation.py    the fixed validation set and its loss at either top_k
- distributed.py   torchrun environment, gloo/NCCL process group
- model_init.py    meta-device build, materialisation, the seeded init (same weights sharded or not)
- sharding.py      FSDP2 (`parallelism="fsdp"`): units, MixedPrecisionPolicy, fp32 routers
- dcp_checkpoint.py  DCP checkpoints of sharded runs: every rank saves/loads only its rows
- checkpoint_convert.py  DCP <-> single-file conversion (the relay carries the single file)
"""

from .checkpointing import is_dcp_checkpoint, latest_checkpoint, list_checkpoints
from .config import TrainConfig, TrainConfigError
from .distributed import DistributedContext, init_distributed
from .metrics import METRICS_VERSION, MetricsRecord, read_metrics
from .optimizer_io import OptimizerStateError
from .schedules import ScheduleError, lr_at
from .state import ResumeNotBitIdenticalWarning, TrainingState, TrainingStateError, read_training_state
from .trainer import CheckpointMismatchError, Trainer, TrainingDivergedError, TrainResult

__all__ = [
    "METRICS_VERSION",
    "CheckpointMismatchError",
    "DistributedContext",
    "MetricsRecord",
    "OptimizerStateError",
    "ResumeNotBitIdenticalWarning",
    "ScheduleError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "Trainer",
    "TrainingDivergedError",
    "TrainingState",
    "TrainingStateError",
    "dcp_to_safetensors",
    "init_distributed",
    "is_dcp_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "lr_at",
    "read_metrics",
    "read_training_state",
    "safetensors_to_dcp",
]


def __getattr__(name: str):
    # NOTE: the converters need torch.distributed.checkpoint, ~0.5 s to import; only when used.
    if name in ("dcp_to_safetensors", "safetensors_to_dcp"):
        from . import checkpoint_convert

        return getattr(checkpoint_convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
