"""Checkpoints: atomic directories, optimizer state in safetensors, refusals, non-finite steps."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.training import (
    CheckpointMismatchError,
    TrainConfig,
    Trainer,
    TrainingDivergedError,
    TrainingStateError,
    latest_checkpoint,
    read_metrics,
    read_training_state,
)
from colibri_model.training.optimizer_io import OptimizerStateError, load_optimizer, save_optimizer

BASE = dict(seq_len=16, batch_size=2, micro_batch=1, lr=1e-3, warmup_steps=1, eval_every=0, eval_batches=1,
            save_every=2, progress=False)


def _source(seed, n=2000):
    rng = np.random.default_rng(seed)
    return TokenSource([rng.integers(100, 3000, size=n).astype(np.uint16)])


def _trainer(run, steps=2, config=None, **kwargs):
    cfg = TrainConfig(steps=steps, **{**BASE, **kwargs})
    return Trainer(run, cfg, _source(0), _source(1), config or get_preset("tiny"))


def test_checkpoint_layout_and_optimizer_round_trip(tmp_path):
    trainer = _trainer(tmp_path / "run", steps=2)
    result = trainer.train()
    files = sorted(p.name for p in result.checkpoint.iterdir())  # no tokenizer was given to this trainer
    assert files == ["config.json", "model.safetensors", "optimizer.safetensors", "training_state.json"]
    state = read_training_state(result.checkpoint)
    assert state.step == 2 and state.tokens_seen == 2 * 2 * 16 and state.loader.window_cursor == 4
    assert len(state.config_hash) == 64 and state.train_config["steps"] == 2
    # optimizer state: safetensors in, the same tensors out
    path = tmp_path / "opt.safetensors"
    save_optimizer(path, trainer.model, trainer.optimizer)
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in trainer.optimizer.state_dict()["state"].items()}
    fresh = _trainer(tmp_path / "other", steps=2)
    load_optimizer(path, fresh.model, fresh.optimizer)
    after = fresh.optimizer.state_dict()["state"]
    assert before.keys() == after.keys()
    for index in before:
        for name in before[index]:
            assert torch.equal(before[index][name], after[index][name])
    other = _trainer(tmp_path / "x", config=get_preset("tiny", n_experts=4))
    with pytest.raises(OptimizerStateError, match="shape"):
        load_optimizer(path, other.model, other.optimizer)
    trainer.close()


def test_crash_during_save_leaves_no_checkpoint_that_looks_whole(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "run", steps=4)
    checkpointing = importlib.import_module("colibri_model.training.checkpointing")
    real = checkpointing.write_optimizer
    calls = {"n": 0}

    def dies_on_second_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # a kill in the middle of writing step 4's checkpoint
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "write_optimizer", dies_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert latest_checkpoint(tmp_path / "run").name == "step_00000002"
    partial = list((tmp_path / "run/checkpoints").glob(".tmp-*"))
    assert len(partial) == 1 and partial[0].name.startswith(".tmp-step_00000004-")
    monkeypatch.setattr(checkpointing, "write_optimizer", real)
    resumed = _trainer(tmp_path / "run", steps=4)  # cleans the partial directory, resumes from step 2
    assert resumed.step == 2 and not list((tmp_path / "run/checkpoints").glob(".tmp-*"))
    assert [r.step for r in read_metrics(tmp_path / "run")] == [0, 1, 2]  # records after step 2 dropped
    resumed.train()
    assert latest_checkpoint(tmp_path / "run").name == "step_00000004"


def test_refuses_other_config_and_unknown_state_version(tmp_path):
    trainer = Trainer(tmp_path / "run", TrainConfig(steps=2, **BASE), _source(0), _source(1), get_preset("tiny"),
                      data_fingerprint="pretrain:one")
    checkpoint = trainer.train().checkpoint
    trainer.close()
    with pytest.raises(CheckpointMismatchError, match="another model config"):
        _trainer(tmp_path / "run", steps=4, config=get_preset("tiny", n_experts=4))
    with pytest.raises(CheckpointMismatchError, match="other data"):
        Trainer(tmp_path / "run", TrainConfig(steps=4, **BASE), _source(7), _source(1), get_preset("tiny"),
                data_fingerprint="pretrain:another")
    path = checkpoint / "training_state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "training_state_version": "2.0"}))
    with pytest.raises(TrainingStateError, match=r"training_state_version 2.0 is not supported \(this colibri-model reads 1.1\)"):
        _trainer(tmp_path / "run", steps=4)


def test_non_finite_step_is_skipped_and_training_goes_on(tmp_path):
    # One window holds token 49000, whose (untied) embedding row is NaN: exactly that step is
    # skipped, the run continues, and no NaN reaches the other weights.
    tokens = np.random.default_rng(0).integers(100, 3000, size=16 * 12 + 1).astype(np.uint16)
    tokens[16 * 5 + 7] = 49000
    cfg = TrainConfig(steps=6, **{**BASE, "save_every": 0})
    trainer = Trainer(tmp_path / "run", cfg, TokenSource([tokens]), _source(1), get_preset("tiny", tie_embeddings=False))
    with torch.no_grad():
        trainer.model.embed.weight[49000] = float("nan")
    trainer.train()
    records = [r for r in read_metrics(tmp_path / "run") if r.step > 0]
    skipped = [r for r in records if r.skipped]
    assert len(records) == 6 and len(skipped) == 1 and skipped[0].skip_reason == "non-finite loss"
    assert all(r.loss is not None and np.isfinite(r.loss) for r in records if not r.skipped)
    weights = {n: p for n, p in trainer.model.named_parameters() if n != "embed.weight"}
    assert all(torch.isfinite(p).all() for p in weights.values())
    assert torch.isfinite(torch.cat([trainer.model.embed.weight[:49000], trainer.model.embed.weight[49001:]])).all()


def test_stops_after_k_non_finite_steps_in_a_row(tmp_path):
    trainer = _trainer(tmp_path / "run", steps=10, max_bad_steps=3)
    with torch.no_grad():
        trainer.model.norm.weight.fill_(float("inf"))
    with pytest.raises(TrainingDivergedError, match="3 non-finite steps in a row"):
        trainer.train()
    assert [r.skipped for r in read_metrics(tmp_path / "run") if r.step > 0] == [True, True, True]


def test_should_stop_is_checked_every_step_and_saves(tmp_path):
    trainer = _trainer(tmp_path / "run", steps=10, save_every=0)
    calls = []

    def lease_lost() -> bool:  # what the relay passes: a check before every optimizer step
        calls.append(trainer.step)
        return len(calls) > 2

    result = trainer.train(should_stop=lease_lost)
    assert result.stopped and result.step == 2 and calls == [0, 1, 2]
    assert result.checkpoint == latest_checkpoint(tmp_path / "run") and result.checkpoint.name == "step_00000002"
    exported = trainer.export_weights(tmp_path / "weights")
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    assert trainer.train(until_step=3).step == 3  # the same trainer continues
