"""Exact resume: N steps straight == N/2 steps, save, a NEW process resumes, N/2 more (bit-identical)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from colibri_model.corpus import prose_files
from colibri_model.data import prepare
from safetensors.torch import load_file

ARGS = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2", "--lr", "3e-3",
        "--warmup", "2", "--eval-every", "0", "--eval-batches", "1", "--save-every", "0", "--no-progress"]


def _train(data, run, steps):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "colibri_model.cli", "train", "--data", str(data), "--out", str(run),
           "--steps", str(steps), *ARGS]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _losses(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["loss"] is not None}


def test_resume_in_new_process_is_bit_identical(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(prose_files()[-1].read_text()[:60_000])
    data = tmp_path / "data"
    prepare([str(text)], data, shard_tokens=4000, val_fraction=0.05, text_doc_chars=1000, progress=False)

    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(data, straight, 6)
    _train(data, split, 3)
    _train(data, split, 6)  # a new process: resumes from split/checkpoints/step_00000003

    a, b = _losses(straight), _losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b  # exact float equality, step by step
    for name in ("model.safetensors", "optimizer.safetensors"):
        wa = load_file(str(straight / "checkpoints/step_00000006" / name))
        wb = load_file(str(split / "checkpoints/step_00000006" / name))
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{name}:{key} differs after resume"
    state = json.loads((split / "checkpoints/step_00000006/training_state.json").read_text())
    first = json.loads((straight / "checkpoints/step_00000006/training_state.json").read_text())
    assert state["loader"] == first["loader"] and state["tokens_seen"] == first["tokens_seen"] == 6 * 4 * 32
    assert state["parent_checkpoint_id"] is not None  # the leg names the checkpoint it resumed
