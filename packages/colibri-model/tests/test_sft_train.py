"""`colibri-model sft`: chat SFT from a checkpoint, assistant-only loss, one-line errors."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.cli import main
from colibri_model.corpus import chat_file
from colibri_model.tokenizer import default_tokenizer_json
from colibri_model.training import read_metrics, read_training_state

FLAGS = ["--steps", "3", "--seq-len", "64", "--batch-size", "4", "--micro-batch", "2", "--lr", "1e-3", "--warmup",
         "1", "--eval-every", "0", "--eval-batches", "1", "--save-every", "0", "--no-progress"]


def test_sft_from_checkpoint_on_bundled_chat(tmp_path):
    torch.manual_seed(0)
    base = tmp_path / "base"
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(base, tokenizer_json=default_tokenizer_json())
    runner = CliRunner()
    result = runner.invoke(main, ["sft", "--init", str(base), "--data", str(chat_file()), "--out",
                                  str(tmp_path / "sft"), *FLAGS])
    assert result.exit_code == 0, result.output
    records = read_metrics(tmp_path / "sft")
    assert [r.step for r in records] == [0, 1, 2, 3] and all(r.kind == "sft" for r in records)
    assert all(r.loss is not None and r.loss < 11.5 for r in records[1:]) and records[-1].val_loss is not None
    assert records[-1].loss < records[1].loss  # it learns
    state = read_training_state(tmp_path / "sft/checkpoints/step_00000003")
    assert state.kind == "sft" and state.data_fingerprint.startswith("sft:")
    # It started from --init's weights: 3 small AdamW steps move each weight by ~lr per step, far
    # less than the distance to a fresh random init (std 0.02).
    from safetensors.torch import load_file

    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(tmp_path / "sft/checkpoints/step_00000003/model.safetensors"))
    drift = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    assert 0 < drift < 0.01, drift
    assert (tmp_path / "sft/checkpoints/step_00000003/tokenizer.json").is_file()


def test_sft_errors_are_one_line(tmp_path):
    torch.manual_seed(0)
    base = tmp_path / "base"
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(base)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    runner = CliRunner()
    result = runner.invoke(main, ["sft", "--init", str(base), "--data", str(bad), "--out", str(tmp_path / "o"), *FLAGS])
    assert result.exit_code == 2 and "bad.jsonl:1: message 0 has role 'robot'" in result.output
    assert result.output.strip().count("\n") == 0
    not_ckpt = tmp_path / "empty"
    not_ckpt.mkdir()
    result = runner.invoke(main, ["sft", "--init", str(not_ckpt), "--data", str(chat_file()), "--out",
                                  str(tmp_path / "p"), *FLAGS])
    assert result.exit_code == 2 and "config.json: missing" in result.output
