"""TrainConfig: every knob of a training run, as a pydantic model saved in training_state.json.

The batch is specified GLOBALLY (`batch_size` sequences per optimizer step, over all processes
and micro-batches); the number of accumulation steps follows from the world size:
`grad_accum = batch_size / (micro_batch * world_size)`. So the same config gives the same
optimisation on 1 process or 8, and a leg may resume on a machine with a different GPU count.
"""

from __future__ import annotations

from typing import Literal

from colibri_spec import require_major
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import TrainConfigError

TRAIN_CONFIG_VERSION = "1.0"


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train_config_version: str = TRAIN_CONFIG_VERSION
    steps: int = Field(gt=0, description="total optimizer steps to reach (a resumed run continues to it)")
    seq_len: int = Field(256, gt=0)
    batch_size: int = Field(16, gt=0, description="global sequences per optimizer step")
    micro_batch: int = Field(16, gt=0, description="sequences per process per forward pass")

    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["wsd", "cosine"] = "wsd"
    decay_fraction: float = Field(0.0, ge=0, le=1, description="WSD: decay over the last fraction of `steps`")
    decay_start: int | None = Field(None, ge=0, description="WSD: explicit step where the decay starts")

    weight_decay: float = Field(0.1, ge=0)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")

    seed: int = 0
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(100, ge=0, description="0: only at the end")
    eval_batches: int = Field(8, gt=0, description="validation size in global batches of batch_size sequences")
    eval_both_top_k: bool = True
    save_every: int = Field(500, ge=0, description="0: only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    max_bad_steps: int = Field(5, gt=0, description="stop after this many non-finite steps in a row")

    device: str = "auto"
    parallelism: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: replicate (DDP) or shard (FSDP2)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False
    activation_checkpointing: bool = False
    peak_tflops: float | None = Field(None, gt=0, description="per-device peak for MFU; None: known GPUs only")
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        require_major(self.train_config_version, TRAIN_CONFIG_VERSION, key="train_config_version",
                      where="train config", reader="colibri-model", error=ValueError)
        if self.batch_size % self.micro_batch:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of micro_batch {self.micro_batch}")
        if self.decay_start is not None and self.decay_start >= self.steps:
            raise ValueError(f"decay_start {self.decay_start} must be below steps {self.steps}")
        return self

    def grad_accum(self, world_size: int) -> int:
        per_step = self.micro_batch * world_size
        if self.batch_size % per_step:
            raise TrainConfigError(
                f"batch_size {self.batch_size} is not divisible by micro_batch {self.micro_batch} x "
                f"{world_size} processes"
            )
        return self.batch_size // per_step
