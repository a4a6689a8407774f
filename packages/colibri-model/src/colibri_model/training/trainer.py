"""The Trainer: one loop for pretraining and SFT, on one process or under torchrun (DDP/FSDP2).

- trainer.py          construction (model, optimizer, loader, DDP), validation and the loop:
                      log metrics, validate every `eval_every`, checkpoint every `save_every`
- optimizer_step.py   one optimizer step: micro-batches, accumulation, the divergence guard
- run_checkpoints.py  resume checks and restore, save_checkpoint, export_weights

Host syncs: none inside a micro-batch's forward and backward, one device-to-host read per
step (optimizer_step.py), one per validation run (validation.py); the router statistics are
copied to the host only for steps that are logged. `--compile` compiles each block with
fullgraph=True (model.compile_blocks). Only rank 0 writes metrics.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..balancing import ExpertBiasBalancer
from ..checkpoint import read_config
from ..config import ColibriConfig
from ..data.loader import PackedLoader, TokenSource
from ..errors import TrainingDivergedError
from ..grouped_mm import warn_if_slow_grouped_mm
from ..model import ColibriForCausalLM
from .checkpointing import is_dcp_checkpoint, latest_checkpoint, remove_partial_checkpoints
from .config import TrainConfig
from .distributed import DistributedContext, init_distributed
from .metrics import MetricsRecord, MetricsWriter, flops_per_token, peak_flops
from .model_init import initialise, materialise, meta_model
from .optimizer_io import build_optimizer
from .optimizer_step import OptimizerStep
from .run_checkpoints import CheckpointMismatchError, RunCheckpoints
from .state import TrainingState, config_hash
from .validation import build_val_batches, validation_loss

__all__ = ["CheckpointMismatchError", "TrainResult", "Trainer", "TrainingDivergedError"]


@dataclass
class TrainResult:
    step: int
    tokens_seen: int
    stopped: bool  # True when should_stop ended the run early
    checkpoint: Path | None
    last_loss: float | None
    val_loss: float | None


class Trainer(OptimizerStep, RunCheckpoints):
    """Train a Colibri model into `run_dir` (resuming from its latest checkpoint if any).

    Example:
        >>> from colibri_model import get_preset
        >>> from colibri_model.training import Trainer, TrainConfig
        >>> trainer = Trainer.for_pretraining("runs/tiny", "data/prose", get_preset("tiny"),
        ...                                   TrainConfig(steps=200, seq_len=128, batch_size=8, micro_batch=8))
        >>> result = trainer.train(should_stop=lambda: lease_lost())   # checked before every step
        >>> result.checkpoint                                         # RUN/checkpoints/step_00000200
    """
    def __init__(self, run_dir: str | os.PathLike, train_config: TrainConfig, train_source: TokenSource,
                 val_source: TokenSource, model_config: ColibriConfig | None = None, *,
                 data_fingerprint: str = "", kind: str = "pretrain", tokenizer_json: str | None = None,
                 resume_from: str | os.PathLike | None = None, init_from: str | os.PathLike | None = None):
        self.cfg = train_config
        self.run_dir = Path(run_dir)
        self.kind = kind
        self.tokenizer_json = tokenizer_json
        self.data_fingerprint = data_fingerprint
        self.ctx: DistributedContext = init_distributed(train_config.device)
        self.device = self.ctx.device
        self.grad_accum = train_config.grad_accum(self.ctx.world_size)
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_partial_checkpoints(self.run_dir)
        self.ctx.barrier()

        self.sharded = self.ctx.enabled and train_config.parallelism == "fsdp"
        precision = train_config.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.autocast = precision == "bf16"

        source = Path(resume_from) if resume_from else latest_checkpoint(self.run_dir)
        self.parent_id: str | None = None
        state: TrainingState | None = None
        pretrained: ColibriForCausalLM | None = None
        if source is not None:
            state = self._read_resume_state(source, model_config)
            model_config = read_config(source)
            self.parent_id = state.checkpoint_id
        else:
            if model_config is None and init_from is None:
                raise CheckpointMismatchError(f"{self.run_dir}: no checkpoint to resume and no model config given")
            torch.manual_seed(train_config.seed)
            if init_from is not None:
                # unsharded: loaded whole (a Hub repo id works too); FSDP2: each rank reads its rows later
                pretrained = None if self.sharded else ColibriForCausalLM.from_pretrained(init_from)
                init_config = pretrained.config if pretrained is not None else read_config(init_from)
                if model_config is not None and config_hash(init_config) != config_hash(model_config):
                    raise CheckpointMismatchError(f"{init_from}: checkpoint config differs from the requested model")
                model_config = init_config
        self.config: ColibriConfig = model_config
        if train_config.seq_len > model_config.max_seq_len:
            raise CheckpointMismatchError(
                f"seq_len {train_config.seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}")
        self.model = pretrained.to(self.device) if pretrained is not None else self._build_model(source or init_from)
        self.model.activation_checkpointing = train_config.activation_checkpointing
        self.model.train()

        self.optimizer = build_optimizer(self.model, train_config, self.device)
        self.balancer = ExpertBiasBalancer(self.model)
        self.balancer.attach(self.optimizer)
        self.loader = PackedLoader(train_source, train_config.seq_len, seed=train_config.seed,
                                   position=state.loader if state else None)
        self.val_batches = build_val_batches(val_source, train_config.seq_len, train_config.micro_batch,
                                             train_config.eval_batches * train_config.batch_size, self.ctx)
        self.step = state.step if state else 0
        self.tokens_seen = state.tokens_seen if state else 0
        self.skipped_steps = state.skipped_steps if state else 0
        self.bad_in_row = state.bad_steps_in_row if state else 0
        if state is not None:
            self._restore_from(state, source)

        self.forward_model: torch.nn.Module = self.model
        if self.ctx.enabled and not self.sharded:
            # broadcast_buffers=False: the routers' token counters are per-rank buffers that the
            # balancer all-reduces itself; DDP's default would overwrite them with rank 0's.
            self.forward_model = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        if train_config.compile:
            self.model.compile_blocks()  # each block fullgraph; FSDP/DDP wrappers stay outside
        warn_if_slow_grouped_mm(self.device, torch.bfloat16 if self.autocast else torch.float32)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.ctx.is_main)
        self.metrics.truncate_after(self.step)
        self.flops_per_token = flops_per_token(self.config, train_config.seq_len)
        self.peak_flops = peak_flops(self.device, train_config.peak_tflops)
        self.last_checkpoint: Path | None = source if state is not None and source.parent == (
            self.run_dir / "checkpoints") else None

    # --- construction helpers --------------------------------------------------------------
    def _build_model(self, weights: Path | str | None) -> ColibriForCausalLM:
        """The model on this rank's device: sharded under FSDP2, weights from `weights` or the seed.

        Built on the meta device, then (FSDP2) sharded, then materialised: no rank ever holds
        more than its shard. Fresh weights follow one recipe in every mode (model_init.py), so
        a seed gives the same model on one process, under DDP or sharded. A single-file
        checkpoint without sharding loads as it always has (`from_pretrained`).
        """
        if weights is not None and not self.sharded and not is_dcp_checkpoint(weights):
            return ColibriForCausalLM.from_pretrained(weights).to(self.device)
        model = meta_model(self.config)
        if self.sharded:
            from .sharding import shard_model

            # before AdamW sees the parameters; fp32 router units break a fullgraph block compile
            shard_model(model, bf16=self.autocast, fp32_routers=not self.cfg.compile)
        materialise(model, self.device)
        if weights is None:
            initialise(model, self.cfg.seed)
        else:
            from .dcp_checkpoint import load_model_state  # NOTE: imports DCP (~0.5 s) only when used

            load_model_state(model, weights)
        return model

    @classmethod
    def for_pretraining(cls, run_dir, data_dir, model_config: ColibriConfig | None,
                        train_config: TrainConfig, **kwargs) -> Trainer:
        """A trainer over a directory made by `prepare` (see data/manifest.py)."""
        from ..data.manifest import open_data_dir
        from ..data.prepare import tokenizer_info

        vocab = model_config.vocab_size if model_config else None
        train, val, manifest = open_data_dir(data_dir, vocab_size=vocab)
        fingerprint = "pretrain:" + ",".join(s.sha256[:16] for s in manifest.train_shards)
        if "tokenizer_json" not in kwargs:
            source = None if manifest.tokenizer.source == "default" else manifest.tokenizer.source
            with contextlib.suppress(Exception):
                kwargs["tokenizer_json"] = tokenizer_info(source)[0].to_str()
        return cls(run_dir, train_config, train, val, model_config, data_fingerprint=fingerprint, **kwargs)

    @classmethod
    def for_sft(cls, run_dir, chat_files: list, train_config: TrainConfig, *, init_from=None,
                val_fraction: float = 0.05, tokenizer: str | None = None, **kwargs) -> Trainer:
        """A trainer for chat SFT on JSONL `messages` files, starting from `init_from` weights."""
        import hashlib

        from ..data.sft import load_chat_sources
        from ..tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer if tokenizer is not None else init_from)
        train, val = load_chat_sources(chat_files, tok, val_fraction=val_fraction)
        fingerprint = "sft:" + hashlib.sha256(train.tokens[0].tobytes()).hexdigest()[:32]
        return cls(run_dir, train_config, train, val, kwargs.pop("model_config", None), kind="sft",
                   data_fingerprint=fingerprint, tokenizer_json=tok.to_str(), init_from=init_from, **kwargs)

    # --- validation ------------------------------------------------------------------------
    def evaluate(self, top_k: int | None = None) -> float:
        """Mean validation loss over the fixed validation set (eval mode; top_k pinned if given)."""
        return validation_loss(self.model, self.val_batches, self.device, self.autocast, self.ctx, top_k=top_k)

    # --- the loop --------------------------------------------------------------------------
    def train(self, until_step: int | None = None, should_stop: Callable[[], bool] | None = None) -> TrainResult:
        """Run optimizer steps up to `until_step` (default: the config's `steps`).

        `should_stop()` is called before every step (e.g. a relay lease check); when it returns
        True the trainer saves a checkpoint and returns with `stopped=True`.
        """
        cfg, ctx = self.cfg, self.ctx
        target = min(until_step or cfg.steps, cfg.steps)
        bar = tqdm(total=target, initial=self.step, desc=self.kind, unit="step",
                   disable=not (cfg.progress and ctx.is_main), dynamic_ncols=True)
        stopped = False
        last_loss = val_loss = None
        tick, tokens_at_tick = time.perf_counter(), self.tokens_seen
        if self.step == 0 and self.step < target:
            val_loss = self.evaluate()
            self.metrics.write(MetricsRecord(step=0, time=time.time(), kind=self.kind, loss=None, lr=0.0,
                                             phase="start", grad_norm=None, tokens_seen=0, tokens_per_s=0.0,
                                             mfu=None, val_loss=val_loss))
            tick = time.perf_counter()
        while self.step < target:
            if should_stop is not None and should_stop():
                stopped = True
                break
            record = self.train_step(router_stats=False)
            if record.skipped and self.bad_in_row >= cfg.max_bad_steps:
                self.metrics.write(record)
                raise TrainingDivergedError(
                    f"{self.bad_in_row} non-finite steps in a row (last at step {self.step}: {record.skip_reason}); "
                    f"stopping. Lower --lr or resume from an earlier checkpoint in {self.run_dir / 'checkpoints'}"
                )
            last_loss = record.loss if record.loss is not None else last_loss
            is_last = self.step == target
            if cfg.eval_every and self.step % cfg.eval_every == 0 or is_last:
                record.val_loss = val_loss = self.evaluate(self.config.top_k_train)
                if cfg.eval_both_top_k and self.config.top_k_infer != self.config.top_k_train:
                    record.val_loss_infer = self.evaluate()
            if self.step % cfg.log_every == 0 or is_last or record.skipped or record.val_loss is not None:
                now = time.perf_counter()
                record.tokens_per_s = (self.tokens_seen - tokens_at_tick) / max(now - tick, 1e-9)
                if self.peak_flops:
                    record.mfu = record.tokens_per_s * self.flops_per_token / (self.peak_flops * ctx.world_size)
                tick, tokens_at_tick = now, self.tokens_seen
                if not record.skipped:
                    record.router = self._router_metrics()
                self.metrics.write(record)
                bar.set_postfix(loss=f"{last_loss:.3f}" if last_loss is not None else "-",
                                tok_s=f"{record.tokens_per_s:,.0f}")
            bar.update(1)
            if cfg.save_every and self.step % cfg.save_every == 0 and not is_last:
                self.save_checkpoint()
        bar.close()
        checkpoint = self.save_checkpoint() if (self.step > 0 or stopped) else None
        return TrainResult(step=self.step, tokens_seen=self.tokens_seen, stopped=stopped,
                           checkpoint=checkpoint or self.last_checkpoint, last_loss=last_loss, val_loss=val_loss)

    def close(self) -> None:
        self.balancer.detach()
        self.ctx.close()
