"""WSD (1-sqrt decay, on command from a stable checkpoint) and cosine learning rates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.training import (
    ScheduleError,
    TrainConfig,
    Trainer,
    lr_at,
    read_metrics,
    read_training_state,
)


def test_wsd_shape():
    cfg = TrainConfig(steps=100, lr=1.0, min_lr_ratio=0.1, warmup_steps=10, decay_fraction=0.2)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert [round(lr, 6) for lr, _ in lrs[:3]] == [0.1, 0.2, 0.3] and lrs[9] == (1.0, "warmup")
    assert all(lr == 1.0 and phase == "stable" for lr, phase in lrs[10:80])
    for s in range(80, 100):
        p = (s - 80 + 1) / 20
        assert lrs[s] == (pytest.approx(0.1 + 0.9 * (1 - math.sqrt(p))), "decay")
    assert lrs[99][0] == pytest.approx(0.1)
    stable = TrainConfig(steps=100, lr=1.0, warmup_steps=0)  # no decay asked: stays at peak (leg mode)
    assert {lr_at(s, stable) for s in range(100)} == {(1.0, "stable")}


def test_cosine_shape():
    cfg = TrainConfig(steps=110, lr=1.0, min_lr_ratio=0.0, warmup_steps=10, schedule="cosine")
    assert lr_at(59, cfg)[0] == pytest.approx(0.5)
    assert lr_at(109, cfg)[0] == pytest.approx(0.0, abs=1e-12)
    values = [lr_at(s, cfg)[0] for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def _source(seed):
    rng = np.random.default_rng(seed)
    return TokenSource([rng.integers(100, 3000, size=4000).astype(np.uint16)])


def test_decay_on_command_from_a_stable_checkpoint(tmp_path):
    config = get_preset("tiny")
    base = dict(seq_len=16, batch_size=2, micro_batch=2, lr=1e-3, warmup_steps=1, eval_every=0, eval_batches=1,
                save_every=0, progress=False)
    stable = Trainer(tmp_path / "stable", TrainConfig(steps=3, **base), _source(0), _source(1), config)
    checkpoint = stable.train().checkpoint
    stable.close()
    assert read_training_state(checkpoint).schedule.phase == "stable"

    # decide later: decay over 4 steps starting at the stable checkpoint's step, in a new run dir
    decay_cfg = TrainConfig(steps=7, decay_start=3, **base)
    decay = Trainer(tmp_path / "decay", decay_cfg, _source(0), _source(1), config, resume_from=checkpoint)
    result = decay.train()
    decay.close()
    lrs = [r.lr for r in read_metrics(tmp_path / "decay") if r.step > 3]
    assert lrs == pytest.approx([1e-4 + 9e-4 * (1 - math.sqrt(k / 4)) for k in range(1, 5)])
    state = read_training_state(result.checkpoint)
    assert state.schedule.phase == "done" and state.schedule.decay_start == 3
    assert state.parent_checkpoint_id == read_training_state(checkpoint).checkpoint_id

    # a decaying checkpoint cannot silently change its decay
    mid = TrainConfig(steps=9, decay_start=5, **base)
    with pytest.raises(ScheduleError, match="already decaying"):
        Trainer(tmp_path / "decay", mid, _source(0), _source(1), config)
