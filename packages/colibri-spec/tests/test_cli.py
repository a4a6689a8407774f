"""`colibri-spec`: valid files print what they describe (exit 0); a bad file is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from colibri_spec import checkpoint_config_dict, get_preset
from colibri_spec.cli import main

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "max_position_embeddings": 256,
             "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "norm_topk_prob": True,
             "tie_word_embeddings": False}


def test_config_and_tensors_of_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config_dict(get_preset("tiny"))))
    assert main(["config", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["d_model"] == 128
    assert main(["tensors", str(tmp_path / "config.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "embed.weight\t[49152, 128]"


def test_a_hugging_face_config_is_mapped(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    assert main(["config", str(tmp_path / "config.json")]) == 0
    config = json.loads(capsys.readouterr().out)
    assert (config["n_experts"], config["router_score"], config["name"]) == (4, "softmax", "qwen3_moe")


def test_metrics_are_read_strictly(tmp_path, capsys):
    line = {"metrics_version": "1.0", "step": 3, "time": 0.0, "loss": 1.0, "lr": 0.1, "phase": "stable",
            "grad_norm": None, "tokens_seen": 9, "tokens_per_s": 1.0, "mfu": None}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    assert main(["metrics", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"records": 1, "last_step": 3}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({**line, "metrics_version": "2.0"}) + "\n")
    assert main(["metrics", str(tmp_path)]) == 2
    assert "metrics.jsonl:1: metrics_version 2.0 is not supported (this colibri-spec reads 1.0)" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    ('{"d_model": 1}', "invalid config: n_layers: Field required"),
    ("{", "not valid JSON"),
    (json.dumps({**QWEN3_MOE, "hidden_act": "gelu"}), "hidden_act='gelu' is not supported"),
])
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    (tmp_path / "c.json").write_text(content)
    assert main(["config", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_help_and_version_run_as_a_module():
    out = subprocess.run([sys.executable, "-m", "colibri_spec", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "config" in out.stdout and "metrics" in out.stdout
    out = subprocess.run([sys.executable, "-m", "colibri_spec", "bogus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice" in out.stderr
