"""Learning-rate schedules: WSD (warmup-stable-decay, 1-sqrt decay) and cosine.

WSD keeps the peak rate for as long as training goes on, so a run can continue leg after leg
and be decayed ONCE, when the team chooses, from any stable checkpoint: resume that checkpoint
with `decay_start` = its step (or `decay_fraction` of a new step target). The decay is
`lr = min + (peak - min) * (1 - sqrt(p))`, p going from 1/D to 1 over the D decay steps
(the 1-sqrt shape of Hägele et al. 2024, which matches cosine's final loss at equal compute).
Cosine (warmup, then half a cosine to min over the run) is there for comparison; unlike WSD it
fixes the end of the run up front.

`step` is the 0-based index of the optimizer step about to be taken.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from ..errors import ScheduleError
from .config import TrainConfig


class ScheduleState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    phase: str  # warmup | stable | decay | done (wsd) ; warmup | cosine | done
    lr: float
    decay_start: int | None
    total_steps: int


def decay_start_of(cfg: TrainConfig) -> int | None:
    if cfg.schedule != "wsd":
        return None
    if cfg.decay_start is not None:
        return cfg.decay_start
    if cfg.decay_fraction > 0:
        return cfg.steps - max(1, round(cfg.decay_fraction * cfg.steps))
    return None


def lr_at(step: int, cfg: TrainConfig) -> tuple[float, str]:
    """(learning rate, phase) for optimizer step `step`."""
    peak, low = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step >= cfg.steps:
        if cfg.schedule == "wsd" and decay_start_of(cfg) is None:
            return peak, "stable"  # a stable run can go on (a later leg, or a decay on command)
        return low, "done"
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps, "warmup"
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = (step - cfg.warmup_steps + 1) / span
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress)), "cosine"
    start = decay_start_of(cfg)
    if start is None or step < start:
        return peak, "stable"
    progress = (step - start + 1) / (cfg.steps - start)
    return low + (peak - low) * (1 - math.sqrt(progress)), "decay"


def check_resume(saved: ScheduleState, cfg: TrainConfig) -> None:
    """Refuse schedule changes that contradict the checkpoint's phase."""
    if saved.name != cfg.schedule:
        raise ScheduleError(f"checkpoint was trained with the {saved.name} schedule, not {cfg.schedule}")
    if saved.name == "wsd" and saved.phase in ("decay", "done") and saved.decay_start is not None:
        if decay_start_of(cfg) != saved.decay_start:
            raise ScheduleError(
                f"checkpoint is already decaying (decay started at step {saved.decay_start}); resume with "
                f"the same decay start, or decay again from an earlier stable checkpoint"
            )
