"""Parallel rounds (DiLoCo) for Colibri: the trainer's inner steps on each worker, the outer step in
the merger, colibri-relay's rounds (ROUNDS.md) in between.

    worker slot i, round r:  pull base r ──> Trainer(resume: base weights + OWN AdamW state)
      ──> H inner steps on windows [(r*K + i)*H*B, (r*K + i + 1)*H*B) of the run's data order
      ──> post pseudograd.safetensors (int8, error feedback) + router.safetensors, once
    merger (whoever holds the lease): close r ──> mean ──> Nesterov SGD ──> commit base r+1

The data slice is fixed by (run, round, slot): every slot of every round reads its own windows of
the one shuffled order the run's seed gives (the loader's `position_at`), so slices are disjoint
and anyone can recompute who read what. Each worker keeps its AdamW moments and its error-feedback
residuals locally across rounds (DiLoCo's inner state never travels); a worker that restarts
without them starts from the base's fresh optimizer state and an empty residual.

The base payload is a trainer checkpoint (config.json, model.safetensors, optimizer.safetensors
(a fresh AdamW state), training_state.json at step r*H, tokenizer.json) plus
outer_momentum.safetensors from round 1 on.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from colibri_model import get_preset
from colibri_model.training import TrainConfig, Trainer, read_metrics, read_training_state
from colibri_relay import (
    MergeInput,
    MergeOutput,
    ModeMismatch,
    Relay,
    RoundRelay,
    RoundsConfig,
    RoundWorker,
    is_parallel,
    plan_rounds,
    rounds_of,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .outer_step import COUNTS_SUFFIX, balance_report, mean_pseudograd, merged_biases, nesterov_step
from .pseudograd import (
    PSEUDOGRAD_FILE,
    ROUTER_FILE,
    ErrorFeedback,
    PseudogradError,
    is_router_state,
    read_pseudograd,
    write_pseudograd,
)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "training_state.json"
MOMENTUM_FILE = "outer_momentum.safetensors"


class ParallelError(RuntimeError):
    """Parallel options that cannot work (bad slot, missing data, a run set up otherwise)."""


@dataclass
class ParallelOptions:
    relay: str
    work_dir: Path
    data_dir: Path
    slot: int
    rounds: int  # work until the run has merged this many rounds
    companion: str | None = None  # a new run's companion repo (default: RELAY + "-contributions")
    preset: str | None = None  # a new run's model
    workers: int | None = None  # a new run's slots
    inner_steps: int | None = None  # a new run's H
    round_s: float = 1800.0  # a new run's deadline per round
    min_round_s: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    holder: str | None = None
    lease_duration_s: float = 1200.0
    heartbeat_s: float = 300.0
    poll_s: float = 10.0
    check_plan: bool = True  # refuse plans over the Hub's limits (off for test hubs with scaled quotas)
    train_overrides: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    progress: bool = False
    log: Callable[[str], None] = print


def default_companion(spec: str) -> str:
    return spec.rstrip("/") + "-contributions"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save_canonical(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None) -> None:
    """save_file, then the header's JSON rewritten with sorted keys: safetensors writes its metadata
    map in a random order, so the same merge would give other bytes each time, and a merged base
    rebuilt by the next merger (ROUNDS.md) must have the checksums of the one it replaces. The
    rewrite keeps the header's length (same characters, other order; padding as written)."""
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = f.read(size)
        canonical = json.dumps(json.loads(header), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(canonical) > size:  # never: the same characters in another order
            raise ValueError(f"{path}: canonical safetensors header is longer than the one written")
        f.seek(8)
        f.write(canonical + b" " * (size - len(canonical)))


def _float_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(path)).items() if v.is_floating_point()}


class ColibriRounds:
    """The app's `train` and `merge` for `RoundWorker` (see the module docstring)."""

    def __init__(self, opts: ParallelOptions):
        self.opts = opts
        self.work = Path(opts.work_dir)
        self.inner = self.work / "inner"  # this worker's own AdamW state and error feedback

    # --- worker --------------------------------------------------------------------------------
    def train(self, view, base_dir: Path, out_dir: Path) -> dict:
        r, cfg_r = view.round, view.rounds
        h, k = cfg_r.inner_steps, cfg_r.workers
        resume, run = self.work / "resume", self.work / "run"
        for d in (resume, run):
            shutil.rmtree(d, ignore_errors=True)
        resume.mkdir(parents=True)
        for f in base_dir.iterdir():
            if f.is_file() and f.name not in (OPTIMIZER_FILE, MOMENTUM_FILE):
                _link_or_copy(f, resume / f.name)
        own = self.inner / OPTIMIZER_FILE
        _link_or_copy(own if own.is_file() else base_dir / OPTIMIZER_FILE, resume / OPTIMIZER_FILE)
        state = read_training_state(base_dir)
        cfg = TrainConfig.model_validate({**state.train_config, "progress": self.opts.progress, "save_every": 0})
        trainer = Trainer.for_pretraining(run, self.opts.data_dir, None, cfg, resume_from=resume)
        first = (r * k + self.opts.slot) * h * cfg.batch_size
        trainer.loader.position = trainer.loader.position_at(first)
        counts: dict[str, torch.Tensor] = {}
        names = {id(m): n for n, m in trainer.model.named_modules()}
        layers = {layer.layer_index: names[id(layer)] for layer in trainer.model.moe_layers()}
        slots_per_step = cfg.batch_size * cfg.seq_len * trainer.config.top_k_train

        def count_routes() -> bool:  # called before every step: add the last step's loads
            for stat in trainer.balancer.last_stats if trainer.step > r * h else []:
                key = f"{layers[stat.layer]}{COUNTS_SUFFIX}"
                load = torch.tensor(stat.load, dtype=torch.float32) * slots_per_step
                counts[key] = counts.get(key, torch.zeros_like(load)) + load
            return False

        t0 = time.monotonic()
        result = trainer.train(until_step=(r + 1) * h, should_stop=count_routes)
        count_routes()
        train_s = time.monotonic() - t0
        trainer.close()
        losses = [m.loss for m in read_metrics(run) if getattr(m, "step", 0) > r * h and m.loss is not None]
        local, base = load_file(str(result.checkpoint / MODEL_FILE)), _float_tensors(base_dir / MODEL_FILE)
        deltas = {n: base[n] - local[n].to(torch.float32) for n in base if not is_router_state(n)}
        feedback = ErrorFeedback(self.inner)
        size = write_pseudograd(out_dir / PSEUDOGRAD_FILE, deltas, feedback)
        router = {n: local[n].to(torch.float32) for n in base if is_router_state(n)} | counts
        save_file(router, str(out_dir / ROUTER_FILE))
        self.inner.mkdir(parents=True, exist_ok=True)
        shutil.copy2(result.checkpoint / OPTIMIZER_FILE, self.inner / (OPTIMIZER_FILE + ".tmp"))
        os.replace(self.inner / (OPTIMIZER_FILE + ".tmp"), own)
        feedback.save()
        return {"inner_steps": h, "tokens": h * cfg.batch_size * cfg.seq_len, "train_s": train_s,
                "loss_start": losses[0] if losses else None, "loss_end": losses[-1] if losses else None,
                "val_loss": result.val_loss, "bytes": size,
                "data_slice": {"order_seed": cfg.seed, "seq_len": cfg.seq_len, "first_window": first,
                               "windows": h * cfg.batch_size}}

    # --- merger --------------------------------------------------------------------------------
    def merge(self, job: MergeInput) -> MergeOutput:
        base_all = load_file(str(job.base_dir / MODEL_FILE))
        with safe_open(str(job.base_dir / MODEL_FILE), "pt") as f:
            metadata = f.metadata()
        params = {n: t for n, t in base_all.items() if t.is_floating_point() and not is_router_state(n)}
        expected = {n: tuple(t.shape) for n, t in params.items()}
        failed, deltas, routers = {}, [], []
        for meta, path in job.contributions:
            try:
                d = read_pseudograd(path / PSEUDOGRAD_FILE, expected)
                router = load_file(str(path / ROUTER_FILE))
                for name, t in router.items():
                    if not torch.isfinite(t).all():
                        raise PseudogradError(f"{path / ROUTER_FILE}: {name} is not finite")
                if any(not torch.isfinite(t).all() for t in d.values()):
                    raise PseudogradError(f"{path / PSEUDOGRAD_FILE}: non-finite values")
            except (PseudogradError, OSError, ValueError) as exc:
                failed[meta.slot] = str(exc)
                continue
            deltas.append(d)
            routers.append(router)
        out = job.out_dir
        for f in job.base_dir.iterdir():  # config, tokenizer, the fresh optimizer state
            if f.is_file() and f.name not in (MODEL_FILE, MOMENTUM_FILE, STATE_FILE) and not f.name.startswith("."):
                _link_or_copy(f, out / f.name)
        momentum = load_file(str(job.base_dir / MOMENTUM_FILE)) if (job.base_dir / MOMENTUM_FILE).is_file() else None
        if deltas:
            counts = [{k: v for k, v in r.items() if k.endswith(COUNTS_SUFFIX)} for r in routers]
            grads = mean_pseudograd(deltas, counts)
            new, buf = nesterov_step(params, grads, momentum, lr=job.rounds.outer_lr, mu=job.rounds.outer_momentum)
            biases = merged_biases([{k: v for k, v in r.items() if is_router_state(k)} for r in routers])
            stats = balance_report(counts) if counts and counts[0] else {}
        else:  # every contribution failed its check: the base carries over
            new, buf, biases, stats = {}, momentum or {}, {}, {}
        merged = {n: new.get(n, biases.get(n, t)) for n, t in base_all.items()}
        save_canonical(merged, out / MODEL_FILE, metadata)
        if buf:
            save_file(buf, str(out / MOMENTUM_FILE))
        state = read_training_state(job.base_dir)
        tokens = sum(int(m.summary.get("tokens", 0)) for m, _ in job.contributions if m.slot not in failed)
        state = state.model_copy(update={"step": (job.round + 1) * job.rounds.inner_steps,
                                         "tokens_seen": state.tokens_seen + tokens})
        (out / STATE_FILE).write_text(state.model_dump_json(indent=2) + "\n")
        return MergeOutput(failed=failed, stats=stats)


def start_base(opts: ParallelOptions, cfg_rounds: RoundsConfig, dest: Path) -> Path:
    """The round-0 base of a new run: a fresh model's checkpoint at step 0."""
    if not opts.preset:
        raise ParallelError("the relay is empty: give --preset NAME for the model of the new run")
    overrides = {"schedule": "wsd", **opts.train_overrides}
    cfg = TrainConfig.model_validate({**overrides, "steps": cfg_rounds.inner_steps * opts.rounds, "save_every": 0,
                                      "progress": False})
    run = dest.parent / "start-run"
    shutil.rmtree(run, ignore_errors=True)
    trainer = Trainer.for_pretraining(run, opts.data_dir, get_preset(opts.preset, **opts.model_overrides), cfg)
    checkpoint = trainer.save_checkpoint()
    trainer.close()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in checkpoint.iterdir():
        if f.is_file():
            _link_or_copy(f, dest / f.name)
    return dest


def join_or_start(opts: ParallelOptions, relay: Relay) -> RoundsConfig:
    """The run's rounds config: join a parallel run, or start one on an empty relay."""
    relay.init()  # idempotent
    _, state = relay.status()
    if not is_parallel(state):
        if state.leg > 0 or state.payload:
            raise ModeMismatch(f"{relay.store.spec} is a run of {state.leg} sequential legs: parallel rounds "
                               "start on an empty relay (a run cannot mix legs and rounds)")
        if opts.workers is None or opts.inner_steps is None:
            raise ParallelError("the relay is empty: a new parallel run needs --workers K and --inner-steps H")
        new = RoundsConfig(companion=opts.companion or default_companion(opts.relay), workers=opts.workers,
                           inner_steps=opts.inner_steps, round_s=opts.round_s, min_round_s=opts.min_round_s,
                           outer_lr=opts.outer_lr, outer_momentum=opts.outer_momentum)
        with relay.leg() as leg:
            if not is_parallel(leg.state):  # another worker may have started it while we waited
                base = start_base(opts, new, Path(opts.work_dir) / "start")
                RoundRelay(relay).start(leg, new, base)
                opts.log(f"[{relay.holder}] started parallel rounds: {new.workers} slots, H={new.inner_steps}")
        _, state = relay.status()
    rounds = rounds_of(state)
    for name, given in (("workers", opts.workers), ("inner_steps", opts.inner_steps)):
        if given is not None and given != getattr(rounds, name):
            raise ParallelError(f"this run has {name}={getattr(rounds, name)}; --{name.replace('_', '-')} {given} "
                                "applies to a new run only")
    if not 0 <= opts.slot < rounds.workers:
        raise ParallelError(f"--slot {opts.slot} is outside this run's slots 0..{rounds.workers - 1}")
    return rounds


def check_plan(opts: ParallelOptions, workers: int, shortest_round_s: float) -> None:
    """Refuse (RoundPlanError, one line) a plan over the Hub's commit and API limits."""
    plan_rounds(workers=workers, min_round_s=shortest_round_s, heartbeat_s=opts.heartbeat_s, poll_s=opts.poll_s).check()


def run_parallel(opts: ParallelOptions):
    """Join (or start) a parallel run and work until it has merged `opts.rounds` rounds."""
    if not Path(opts.data_dir).is_dir():
        raise ParallelError(f"--data {opts.data_dir}: not a directory (make one with `colibri-model prepare`)")
    relay = Relay(opts.relay, holder=opts.holder, lease_duration_s=opts.lease_duration_s, heartbeat_s=opts.heartbeat_s)
    if opts.check_plan and opts.workers is not None:  # before a new run is made of it
        check_plan(opts, opts.workers, opts.min_round_s or opts.round_s)
    rounds = join_or_start(opts, relay)
    if opts.check_plan:
        check_plan(opts, rounds.workers, rounds.min_round_s or rounds.round_s)
    app = ColibriRounds(opts)
    worker = RoundWorker(RoundRelay(relay), slot=opts.slot, train=app.train, merge=app.merge, work_dir=opts.work_dir,
                         poll_s=opts.poll_s, say=opts.log)
    report = worker.run(opts.rounds)
    opts.log(f"[{relay.holder}] done: {len(report.acks)} contributions, {len(report.late)} late, merged rounds "
             f"{report.merged}")
    return report


__all__ = ["ParallelOptions", "ParallelError", "ColibriRounds", "run_parallel", "default_companion"]
