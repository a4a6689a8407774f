"""The Trainer: one loop for pretraining and SFT, on one process or under torchrun (DDP/FSDP2).

Per optimizer step:
  1. draw the GLOBAL batch from the packed loader; this rank takes its slice and splits it into
     `grad_accum` micro-batches;
  2. forward/backward each micro-batch (bf16 autocast on CUDA; DDP or FSDP2 syncs gradients
     only on the last one). Each micro loss is weighted by its share of the global count of
     target tokens, so the gradient is the token-weighted mean over the global batch whatever
     the world size or the SFT masks;
  3. all-reduce the loss; clip; if the loss or the gradient norm is not finite, skip the update
     (and log it), stopping with `TrainingDivergedError` after `max_bad_steps` in a row;
  4. set the scheduled lr and step AdamW. The expert-bias balancer runs as an optimizer
     pre-hook over the counts of the whole accumulated batch (balancing.py);
  5. log metrics, validate every `eval_every`, checkpoint every `save_every` and at the end.

Host syncs: none inside a micro-batch's forward and backward (the target counts are taken on the
host before the batch moves to the device); ONE device-to-host read per step, after the last
backward, carries the loss, aux loss and gradient norm the divergence guard needs; the router
statistics are copied to the host only for steps that are logged. `--compile` compiles each block
with fullgraph=True (model.compile_blocks).

Only rank 0 writes metrics and single-file checkpoints; under FSDP2 every rank writes its own
DCP shards (dcp_checkpoint.py) and rank 0 the JSON beside them. Resume restores weights, AdamW
moments, loader position, RNG and schedule, so on CPU N straight steps and N/2 + resume + N/2
give bit-identical weights, given the same torch build, CPU capability, intra-op thread count and
world size (recorded in training_state.json; a resume under others warns with
`ResumeNotBitIdenticalWarning`). TRAINING.md, "Exact resume"; tests/test_train_resume.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..balancing import ExpertBiasBalancer
from ..checkpoint import CheckpointFormatError, read_config
from ..config import ColibriConfig
from ..data.loader import IGNORE_INDEX, PackedLoader, TokenSource
from ..grouped_mm import warn_if_slow_grouped_mm
from ..model import ColibriForCausalLM
from .checkpointing import is_dcp_checkpoint, latest_checkpoint, remove_partial_checkpoints, write_checkpoint
from .config import TrainConfig
from .distributed import DistributedContext, init_distributed
from .metrics import MetricsRecord, MetricsWriter, RouterLayerMetrics, flops_per_token, peak_flops
from .model_init import initialise, materialise, meta_model
from .optimizer_io import OPTIMIZER_FILE, build_optimizer, load_optimizer, optimizer_payload
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
from .validation import build_val_batches, validation_loss


class TrainingDivergedError(RuntimeError):
    """Too many non-finite steps in a row."""


class CheckpointMismatchError(ValueError):
    """A checkpoint that belongs to another model config or another data set."""


@dataclass
class TrainResult:
    step: int
    tokens_seen: int
    stopped: bool  # True when should_stop ended the run early
    checkpoint: Path | None
    last_loss: float | None
    val_loss: float | None


class Trainer:
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
                    stacklevel=2)

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

    # --- one optimizer step ----------------------------------------------------------------
    def _reset_router_counts(self) -> None:
        for layer in self.model.moe_layers():
            layer.router.tokens_per_expert.zero_()

    def train_step(self, router_stats: bool = True) -> MetricsRecord:
        """One optimizer step. `router_stats=False` leaves `record.router` empty (train() fills it
        only for logged steps, sparing a host copy of the counts on the others)."""
        cfg, ctx = self.cfg, self.ctx
        windows = self.loader.next_windows(cfg.batch_size)
        per_rank = cfg.batch_size // ctx.world_size
        inputs, targets = self.loader.gather(windows[ctx.rank * per_rank:(ctx.rank + 1) * per_rank])
        # Target counts per sequence, read on the host before the batch moves to the device: no sync.
        valid = (targets != IGNORE_INDEX).sum(dim=1).tolist()
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        local_valid = float(sum(valid))
        global_valid = ctx.all_reduce_sum(torch.tensor(local_valid, dtype=torch.float64, device=self.device)
                                          ).item() if ctx.enabled else local_valid
        lr, phase = lr_at(self.step, cfg)

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        mb = cfg.micro_batch
        for micro in range(self.grad_accum):
            x, y = inputs[micro * mb:(micro + 1) * mb], targets[micro * mb:(micro + 1) * mb]
            n_valid = float(sum(valid[micro * mb:(micro + 1) * mb]))
            last = micro == self.grad_accum - 1
            if self.sharded:
                self.model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last or not ctx.enabled else self.forward_model.no_sync()
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
            with sync, autocast:
                out = self.forward_model(x, targets=y)
                weight = n_valid / global_valid * ctx.world_size if global_valid else 0.0
                # NOTE: a micro-batch with no target gives NaN mean loss; its weight is 0 and we
                # must not let 0 * NaN poison the gradient, hence the nan_to_num.
                lm = torch.nan_to_num(out.lm_loss, nan=0.0) if n_valid == 0 else out.lm_loss
                loss = lm * weight
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss / self.grad_accum
                    aux_sum += out.aux_loss.detach().double() / self.grad_accum
                loss.backward()
            loss_sum += lm.detach().double() * n_valid
        stats = ctx.all_reduce_sum(torch.stack([loss_sum, aux_sum]))
        # max_norm=inf measures without clipping; under FSDP2 the norm is a DTensor
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # The step's one host read: the divergence guard below needs these three numbers.
        loss_total, aux_total, grad_norm = torch.stack([stats[0], stats[1], norm.double()]).tolist()
        mean_loss = loss_total / global_valid if global_valid else float("nan")
        aux = aux_total / ctx.world_size if self.config.aux_loss_alpha > 0 else None
        skip_reason = None
        if global_valid == 0:
            skip_reason = "no target tokens in the batch"
        elif not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            skip_reason = f"non-finite {'loss' if not math.isfinite(mean_loss) else 'gradient norm'}"
        if skip_reason is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()  # the balancer's pre-hook updates the expert biases first
            self.bad_in_row = 0
        else:
            self._reset_router_counts()
            self.skipped_steps += 1
            if global_valid:
                self.bad_in_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.batch_size * cfg.seq_len
        router = [] if skip_reason or not router_stats else self._router_metrics()
        return MetricsRecord(step=self.step, time=time.time(), kind=self.kind,
                             loss=None if skip_reason else mean_loss, aux_loss=aux, lr=lr, phase=phase,
                             grad_norm=grad_norm if math.isfinite(grad_norm) else None,
                             tokens_seen=self.tokens_seen, tokens_per_s=0.0, mfu=None,
                             skipped=skip_reason is not None, skip_reason=skip_reason, router=router)

    def _router_metrics(self) -> list[RouterLayerMetrics]:
        return [RouterLayerMetrics.from_stats(s) for s in self.balancer.last_stats]

    # --- validation ------------------------------------------------------------------------
    def evaluate(self, top_k: int | None = None) -> float:
        """Mean validation loss over the fixed validation set (eval mode; top_k pinned if given)."""
        return validation_loss(self.model, self.val_batches, self.device, self.autocast, self.ctx, top_k=top_k)

    # --- checkpoints -----------------------------------------------------------------------
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
