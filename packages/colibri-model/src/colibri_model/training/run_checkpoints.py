"""The Trainer's checkpoints: resume checks and restore, save, export (mixed into trainer.Trainer,
whose attributes it uses).

Only rank 0 writes single-file checkpoints; under FSDP2 every rank writes its own DCP shards
(dcp_checkpoint.py) and rank 0 the JSON beside them. Resume restores weights, AdamW moments,
loader position, RNG and schedule, so on CPU N straight steps and N/2 + resume + N/2 give
bit-identical weights, given the same torch build, CPU capability, intra-op thread count and
world size (recorded in training_state.json; a resume under others warns with
`ResumeNotBitIdenticalWarning`). TRAINING.md, "Exact resume"; tests/test_train_resume.py.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
import warnings
from pathlib import Path

from ..checkpoint import CheckpointFormatError, read_config
from ..config import ColibriConfig
from ..errors import CheckpointMismatchError
from .checkpointing import is_dcp_checkpoint, write_checkpoint
from .optimizer_io import OPTIMIZER_FILE, load_optimizer, optimizer_payload
from .schedules import ScheduleState, check_resume, decay_start_of, lr_at
from .state import (
    ResumeNotBitIdenticalWarning,
    TrainingState,
    capture_rng,
    config_hash,
    current_environment,
    environment_differences,
    read_training_state,
    restore_rng,
)


class RunCheckpoints:
    """Reading a run's checkpoint to resume it, and writing the run's checkpoints."""

    def _read_resume_state(self, source: Path, model_config: ColibriConfig | None) -> TrainingState:
        try:
            saved_config = read_config(source)
        except CheckpointFormatError:
            raise
        state = read_training_state(source)
        if model_config is not None and config_hash(model_config) != config_hash(saved_config):
            raise CheckpointMismatchError(
                f"{source}: checkpoint is of another model config ({saved_config.name}, hash "
                f"{state.config_hash[:12]}) than the one requested ({model_config.name}, "
                f"hash {config_hash(model_config)[:12]}); use another --out"
            )
        if self.data_fingerprint and state.data_fingerprint and state.data_fingerprint != self.data_fingerprint:
            raise CheckpointMismatchError(
                f"{source}: checkpoint was trained on other data ({state.data_fingerprint[:40]}), "
                f"so its loader position does not apply; use another --out"
            )
        check_resume(state.schedule, self.cfg)
        return state

    def _restore_from(self, state: TrainingState, source: Path) -> None:
        """AdamW moments and RNG of the checkpoint `state` was read from (after the model is built)."""
        if self.sharded or is_dcp_checkpoint(source):
            from .dcp_checkpoint import load_optimizer_state

            load_optimizer_state(self.model, self.optimizer, source)  # each rank reads its rows
        else:
            load_optimizer(source / OPTIMIZER_FILE, self.model, self.optimizer)
        restore_rng(state.rng)
        changed = environment_differences(state.environment, current_environment(self.device, self.ctx.world_size))
        if changed and self.ctx.is_main:
            warnings.warn(ResumeNotBitIdenticalWarning(
                f"{source}: resuming in another compute environment ({'; '.join(changed)}); the state is "
                f"restored exactly, but the next steps match an uninterrupted run only to rounding"),
                stacklevel=3)  # the caller of Trainer(...)

    def training_state(self, checkpoint_id: str | None = None) -> TrainingState:
        lr, phase = lr_at(self.step, self.cfg)
        return TrainingState(
            kind=self.kind, checkpoint_id=checkpoint_id or uuid.uuid4().hex, parent_checkpoint_id=self.parent_id,
            step=self.step, tokens_seen=self.tokens_seen, skipped_steps=self.skipped_steps,
            bad_steps_in_row=self.bad_in_row,
            schedule=ScheduleState(name=self.cfg.schedule, phase=phase, lr=lr,
                                   decay_start=decay_start_of(self.cfg), total_steps=self.cfg.steps),
            loader=self.loader.position, rng=capture_rng(), config_hash=config_hash(self.config),
            train_config=self.cfg.model_dump(), data_fingerprint=self.data_fingerprint,
            world_size=self.ctx.world_size, created_at=time.time(),
            environment=current_environment(self.device, self.ctx.world_size),
        )

    def save_checkpoint(self) -> Path | None:
        """Write a complete checkpoint of the current step; returns its directory (rank 0; FSDP2: all).

        One process and DDP write the single-file format (rank 0): a model checkpoint
        (CHECKPOINT.md) plus optimizer.safetensors and training_state.json, pushable as it is.
        FSDP2 writes a DCP directory (dcp_checkpoint.py), every rank its own shards, nothing
        gathered: convert it with `dcp_to_safetensors` before pushing. Either resumes with
        `resume_from`, at any world size.
        """
        path = state = None
        if self.sharded:
            from .dcp_checkpoint import write_dcp_checkpoint

            path, state = write_dcp_checkpoint(self.run_dir, self.step, self.config, self.model, self.optimizer,
                                               self.training_state, self.tokenizer_json, self.cfg.keep_checkpoints,
                                               self.ctx)
        elif self.ctx.is_main:
            model_state = {n: t.detach().cpu() for n, t in self.model.state_dict().items()}
            state = self.training_state()
            path = write_checkpoint(self.run_dir, self.config, model_state,
                                    optimizer_payload(self.model, self.optimizer), state, self.tokenizer_json,
                                    self.cfg.keep_checkpoints)
        if path is not None:
            if state is not None and path.name != getattr(self.last_checkpoint, "name", None):
                self.parent_id = state.checkpoint_id
            self.last_checkpoint = path
        if not self.sharded:
            self.ctx.barrier()
        return path

    def export_weights(self, directory: str | os.PathLike) -> Path:
        """Copy only the model files (config, weights, tokenizer) of the latest checkpoint (rank 0).

        From a DCP checkpoint (FSDP2) they are converted, and `directory` must be new or empty.
        """
        source = self.last_checkpoint or self.save_checkpoint()
        directory = Path(directory)
        if is_dcp_checkpoint(source):
            from .checkpoint_convert import dcp_to_safetensors

            return dcp_to_safetensors(source, directory, weights_only=True)
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            if (source / name).exists():
                shutil.copy2(source / name, directory / name)
        return directory
