"""Shared fixtures for colibri-model's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture()
def train_three_steps(tmp_path):
    """A callable: `(config) -> (metrics records, names of the parameters that moved)` after three
    optimizer steps of pretraining `config` on 60,000 characters of the bundled prose (the
    variant tests' proof that the trainer trains a shape, not only that it runs forward)."""
    from colibri_model.corpus import prose_files
    from colibri_model.data import prepare
    from colibri_model.training import TrainConfig, Trainer, read_metrics

    def run(config):
        (tmp_path / "prose.txt").write_text(prose_files()[0].read_text(encoding="utf-8-sig")[:60_000])
        prepare([str(tmp_path / "prose.txt")], tmp_path / "data", shard_tokens=100_000, val_fraction=0.05,
                progress=False)
        cfg = TrainConfig(steps=3, seq_len=32, batch_size=4, micro_batch=4, lr=3e-3, warmup_steps=1, eval_every=0,
                          eval_batches=1, save_every=0, progress=False)
        trainer = Trainer.for_pretraining(tmp_path / "run", tmp_path / "data", config, cfg)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        trainer.close()
        moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), start[n])}
        return read_metrics(tmp_path / "run"), moved

    return run
