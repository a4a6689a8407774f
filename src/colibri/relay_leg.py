"""One relay leg: claim the baton, pull the latest checkpoint, train, push, release.

    relay (Hub repo or LocalStore dir)
      claim ──> pull payload at our claim commit ──> Trainer(resume_from=payload)
        ──> train until the leg's step target (lease checked before every step)
        ──> push {checkpoint files + metrics.jsonl} + ledger entry in ONE commit ──> release

The payload of a Colibri relay is one training checkpoint (CHECKPOINT.md + optimizer.safetensors
+ training_state.json + tokenizer.json) and the run's whole `metrics.jsonl`, always in that
single-file format: an FSDP2 leg (`parallelism="fsdp"`) checkpoints in DCP shards, converted at
push (`dcp_to_safetensors`); at pull nothing is converted, since the FSDP2 trainer reads each
rank's rows straight out of the payload's safetensors files. Hyper-parameters
travel in training_state.json, so every leg continues the same run whoever trains it; a leg
only chooses how far to go (`leg_steps` / `leg_hours`) and whether to start the WSD decay.

Under torchrun only rank 0 talks to the relay (claim, heartbeat, pull, push). Before every step
rank 0's lease check is all-reduced, so all ranks stop together when the lease is lost, and
nobody pushes. Ranks share the work directory (one node, or a shared filesystem).
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from colibri_model import get_preset
from colibri_model.training import (
    TrainConfig,
    Trainer,
    init_distributed,
    is_dcp_checkpoint,
    read_training_state,
)
from colibri_relay import LeaseLost, LegSummary, Relay, RelayError, is_parallel

METRICS_FILE = "metrics.jsonl"
STATE_FILE = "training_state.json"


class LegError(RuntimeError):
    """A leg that cannot start (bad options, missing data, a relay in the wrong phase)."""


@dataclass
class LegOptions:
    relay: str
    work_dir: Path
    data_dir: Path | None = None  # prepared token shards (pretraining legs)
    chat_files: list[Path] = field(default_factory=list)  # SFT legs
    sft: bool = False
    preset: str | None = None  # model of an empty relay
    leg_steps: int | None = None
    leg_hours: float | None = None
    decay: bool = False  # this leg is the WSD decay (over leg_steps)
    parallelism: str | None = None  # "ddp" or "fsdp" under torchrun: this leg's machine, not the run's
    holder: str | None = None
    lease_duration_s: float = 1200.0
    heartbeat_s: float = 300.0
    claim_timeout_s: float | None = None
    # Hyper-parameters of a NEW run (a resumed run keeps the ones in its training_state.json).
    train_overrides: dict = field(default_factory=dict)
    # Model config fields of a NEW run, over the preset's (e.g. bias_update_gamma); a resumed run keeps its own.
    model_overrides: dict = field(default_factory=dict)
    progress: bool = True
    log: Callable[[str], None] = print


@dataclass
class LegOutcome:
    leg: int | None
    pushed: bool
    commit: str | None
    step_start: int
    step_end: int
    loss_start: float | None
    loss_end: float | None
    val_loss: float | None
    reason: str  # "steps done", "time limit" or "lease lost"
    rank: int = 0  # under torchrun only rank 0 pushes

    @property
    def ok(self) -> bool:
        """The leg was pushed (rank 0), or this rank finished its part of a pushed leg."""
        return self.pushed if self.rank == 0 else self.reason != "lease lost"


def hardware_description() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        return f"{world}x {torch.cuda.get_device_name(0)}"
    return f"{world}x CPU ({os.cpu_count()} cores, {platform.machine()})"


def _pulled_state(payload_dir: Path):
    return read_training_state(payload_dir) if (payload_dir / STATE_FILE).is_file() else None


def _train_config(opts: LegOptions, state) -> TrainConfig:
    """The leg's TrainConfig: the run's own hyper-parameters, with this leg's step target."""
    span = opts.leg_steps if opts.leg_steps is not None else 10_000_000  # hours-bounded leg
    continuing = state is not None and (state.kind == "sft") == opts.sft
    if continuing:
        base, start = dict(state.train_config), state.step
    else:  # a new run: a fresh relay, or the first SFT leg on top of a pretrained checkpoint
        base, start = dict(opts.train_overrides), 0
        base.setdefault("schedule", "wsd")
    base.update(progress=opts.progress, steps=start + span, save_every=0)
    if opts.parallelism is not None:  # a choice of this leg's machine, like its GPU count
        base["parallelism"] = opts.parallelism
    if opts.decay:
        if base.get("schedule", "wsd") != "wsd":
            raise LegError("--decay applies to the WSD schedule only")
        base.update(decay_start=start, decay_fraction=0.0)
    elif continuing and state.schedule.decay_start is not None and state.schedule.phase in ("decay", "done"):
        raise LegError(
            f"the run already decayed (phase {state.schedule.phase} at step {state.step}); "
            "a further leg would need --decay from an earlier stable checkpoint, or --sft"
        )
    else:
        base.pop("decay_start", None)
    return TrainConfig.model_validate(base)


def _build_trainer(opts: LegOptions, payload: Path, run_dir: Path, state) -> Trainer:
    cfg = _train_config(opts, state)
    continuing = state is not None and (state.kind == "sft") == opts.sft
    if opts.sft:  # options were checked before the claim (check_options); state is what we pulled
        if state is None:
            raise LegError("an SFT leg needs a pretrained checkpoint on the relay; push a pretraining leg first")
        if continuing:
            return Trainer.for_sft(run_dir, opts.chat_files, cfg, resume_from=payload, tokenizer=str(payload))
        return Trainer.for_sft(run_dir, opts.chat_files, cfg, init_from=payload)
    if state is None:
        if not opts.preset:
            raise LegError("the relay is empty: give --preset NAME for the model to start")
        return Trainer.for_pretraining(run_dir, opts.data_dir, get_preset(opts.preset, **opts.model_overrides), cfg)
    return Trainer.for_pretraining(run_dir, opts.data_dir, None, cfg, resume_from=payload)


def _carry_metrics(payload: Path, run_dir: Path, state, sft: bool) -> None:
    """Metrics continue across legs: the run's metrics.jsonl is copied into the leg's run dir, where
    the trainer appends to it. A new run on top of the payload (the first SFT leg, whose steps
    restart at 0) archives the previous run's file as metrics_<kind>.jsonl instead."""
    for archived in payload.glob("metrics_*.jsonl"):
        shutil.copy2(archived, run_dir / archived.name)
    current = payload / METRICS_FILE
    if not current.is_file():
        return
    if state is not None and (state.kind == "sft") != sft:
        shutil.copy2(current, run_dir / f"metrics_{state.kind}.jsonl")
    else:
        shutil.copy2(current, run_dir / METRICS_FILE)


def _stage_push(checkpoint: Path, run_dir: Path, push_dir: Path) -> Path:
    """The payload: the checkpoint's files + the run's metrics files, hard-linked if possible.

    A DCP checkpoint (an FSDP2 leg) is first converted to the single-file format the relay carries.
    """
    if push_dir.exists():
        shutil.rmtree(push_dir)
    if is_dcp_checkpoint(checkpoint):
        from colibri_model.training import dcp_to_safetensors  # imports torch's DCP: only when used

        dcp_to_safetensors(checkpoint, push_dir)
        sources = sorted(run_dir.glob("metrics*.jsonl"))
    else:
        push_dir.mkdir(parents=True)
        sources = [p for p in checkpoint.iterdir() if p.is_file()] + sorted(run_dir.glob("metrics*.jsonl"))
    for src in sources:
        if src.is_file():
            try:
                os.link(src, push_dir / src.name)
            except OSError:
                shutil.copy2(src, push_dir / src.name)
    return push_dir


class _StopVote:
    """should_stop for the trainer: rank 0's lease check (and leg deadline), agreed by all ranks."""

    def __init__(self, leg, deadline: float | None, distributed: bool):
        self.leg, self.deadline, self.distributed = leg, deadline, distributed
        self.lost: LeaseLost | None = None
        self.timed_out = False

    def __call__(self) -> bool:
        flags = torch.zeros(2)
        if self.leg is not None:
            try:
                self.leg.check()
            except LeaseLost as exc:
                self.lost = exc
                flags[0] = 1
            if self.deadline is not None and time.monotonic() > self.deadline:
                flags[1] = 1
        if self.distributed:
            dist.all_reduce(flags)  # rank 0 decides; everyone learns the same answer
        if flags[0] > 0:
            raise LeaseLost(str(self.lost) if self.lost else "rank 0 lost the lease")
        self.timed_out = bool(flags[1] > 0)
        return self.timed_out


def check_options(opts: LegOptions, relay: Relay | None = None) -> None:
    """Refuse bad options BEFORE claiming: every claim and release is a commit (on the Hub, against
    its rate limits), so a typo must not cost two. With `relay`, also peek (a read, no claim) at
    whether an empty relay was given a model to start."""
    if opts.leg_steps is None and opts.leg_hours is None:
        raise LegError("give --leg-steps N or --leg-hours H (or both)")
    if opts.decay and opts.leg_steps is None:
        raise LegError("--decay needs --leg-steps: the decay's length")
    if opts.sft and not opts.chat_files:
        raise LegError("an SFT leg needs --chat-data FILE (JSONL with `messages`)")
    if not opts.sft and opts.data_dir is None:
        raise LegError("a pretraining leg needs --data DIR (made by `colibri-model prepare`)")
    if relay is not None:
        _, state = relay.status()
        if is_parallel(state):
            raise LegError(f"{relay.store.spec} runs parallel rounds (relay_version {state.relay_version}): join it "
                           "with `colibri train --parallel --slot I`, a sequential leg cannot mix into it")
        if not state.payload and opts.sft:
            raise LegError("an SFT leg needs a pretrained checkpoint on the relay; push a pretraining leg first")
        if not state.payload and not opts.preset:
            raise LegError("the relay is empty: give --preset NAME for the model to start")


def run_leg(opts: LegOptions) -> LegOutcome:
    """Run one leg end to end. Raises LegError for bad options; returns how the leg ended."""
    log = opts.log
    check_options(opts)
    ctx = init_distributed("auto")
    is_main = ctx.rank == 0
    work = Path(opts.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    relay = Relay(opts.relay, holder=opts.holder, lease_duration_s=opts.lease_duration_s,
                  heartbeat_s=opts.heartbeat_s) if is_main else None

    leg = None
    try:
        if is_main:
            check_options(opts, relay)
            leg = relay.claim(wait=True, timeout_s=opts.claim_timeout_s)
            log(f"[{relay.holder}] claimed the baton: leg {leg.number}, epoch {leg.state.epoch}")
        leg_dir = work / "leg"
        payload, run_dir = leg_dir / "payload", leg_dir / "run"
        if is_main:
            if leg_dir.exists():
                shutil.rmtree(leg_dir)
            got = leg.pull(payload)
            log(f"[{relay.holder}] pulled {len(got)} files at {leg.claim_commit[:12]}"
                if got else f"[{relay.holder}] empty relay: starting a new run")
            run_dir.mkdir(parents=True)
            _carry_metrics(payload, run_dir, _pulled_state(payload), opts.sft)
        ctx.barrier()
        state = _pulled_state(payload)
        trainer = _build_trainer(opts, payload, run_dir, state)
        step_start = trainer.step
        deadline = time.monotonic() + opts.leg_hours * 3600 if opts.leg_hours else None
        vote = _StopVote(leg, deadline, ctx.enabled)
        try:
            result = trainer.train(should_stop=vote)
        except LeaseLost as exc:
            trainer.close()
            if is_main:
                log(f"[{relay.holder}] LEASE LOST at step {trainer.step}: {exc}. Stopping without pushing.")
            return LegOutcome(None, False, None, step_start, trainer.step, None, None, None, "lease lost", ctx.rank)
        losses = _leg_losses(run_dir / METRICS_FILE, step_start) if is_main else (None, None)
        outcome = LegOutcome(None, False, None, step_start, result.step, losses[0], result.last_loss,
                             result.val_loss, "time limit" if vote.timed_out else "steps done", ctx.rank)
        if is_main:
            push_dir = _stage_push(result.checkpoint, run_dir, leg_dir / "push")
            summary = LegSummary(
                steps=result.step - step_start, tokens=result.tokens_seen - (state.tokens_seen if state and
                                                                             trainer.kind == state.kind else 0),
                loss_start=losses[0], loss_end=result.last_loss, hardware=hardware_description(),
                notes=f"{trainer.kind} steps {step_start}->{result.step}" + (" (decay)" if opts.decay else ""),
                kind=trainer.kind, step_end=result.step, val_loss=result.val_loss,
            )
            pushed = leg.push(push_dir, summary)
            outcome.leg, outcome.pushed, outcome.commit = pushed.leg, True, pushed.commit
            log(f"[{relay.holder}] pushed leg {pushed.leg} ({result.step - step_start} steps, loss "
                f"{_fmt(losses[0])} -> {_fmt(result.last_loss)}) as {pushed.commit[:12]}, tag {pushed.tag}")
        trainer.close()
        ctx.barrier()
        return outcome
    finally:
        if leg is not None:
            try:
                leg.release()  # a no-op when fenced
            except RelayError as exc:
                log(f"[{relay.holder}] release failed (the lease will lapse by itself): {exc}")
        ctx.close()


def _leg_losses(metrics: Path, step_start: int) -> tuple[float | None, float | None]:
    """First and last training loss of this leg, from metrics.jsonl."""
    from colibri_model.training import read_metrics

    if not metrics.is_file():
        return None, None
    records = [r for r in read_metrics(metrics.parent) if getattr(r, "step", 0) > step_start and r.loss is not None]
    if not records:
        return None, None
    return records[0].loss, records[-1].loss


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
