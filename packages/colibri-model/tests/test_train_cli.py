"""`colibri-model train`: readable --help, one-line errors with exit code 2 for user mistakes."""

from __future__ import annotations

import json

from click.testing import CliRunner
from colibri_model.cli import main
from colibri_model.data import prepare

FLAGS = ["--seq-len", "16", "--batch-size", "2", "--eval-every", "0", "--eval-batches", "1", "--warmup", "1",
         "--no-progress"]


def _one_line_error(result, code=2):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.output.strip().count("\n") == 0, result.output
    return result.output


def test_help_reads_well():
    runner = CliRunner()
    phrases = {"prepare": "Tokenize INPUT...", "train": "Pretrain a Colibri model", "sft": "assistant tokens only"}
    for command, phrase in phrases.items():
        result = runner.invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output and phrase in result.output
    assert "--decay-start" in runner.invoke(main, ["train", "--help"]).output


def test_train_then_user_mistakes(tmp_path):
    src = tmp_path / "in.jsonl"
    words = " ".join(f"word{i}" for i in range(300))
    src.write_text("".join(json.dumps({"text": f"{i} {words}"}) + "\n" for i in range(20)))
    prepare([str(src)], tmp_path / "data", shard_tokens=5000, val_fraction=0.2, progress=False)
    runner = CliRunner()
    run = str(tmp_path / "run")
    ok = runner.invoke(main, ["train", "--preset", "tiny", "--data", str(tmp_path / "data"), "--out", run,
                              "--steps", "2", *FLAGS])
    assert ok.exit_code == 0, ok.output
    assert "done at step 2" in ok.output

    err = _one_line_error(runner.invoke(main, ["train", "--preset", "tiny", "--data", str(tmp_path / "nope"),
                                               "--out", run, "--steps", "3", *FLAGS]))
    assert "no such data directory" in err
    err = _one_line_error(runner.invoke(main, ["train", "--preset", "huge", "--data", str(tmp_path / "data"),
                                               "--out", str(tmp_path / "r2"), "--steps", "3", *FLAGS]))
    assert err.startswith("Error: unknown preset 'huge'; choose one of tiny, nano")  # not "Error: None: ..."
    err = _one_line_error(runner.invoke(main, ["train", "--preset", "nano", "--data", str(tmp_path / "data"),
                                               "--out", run, "--steps", "3", *FLAGS]))
    assert "another model config" in err
    err = _one_line_error(runner.invoke(main, ["train", "--data", str(tmp_path / "data"), "--out", run,
                                               "--steps", "3", "--batch-size", "3", "--micro-batch", "2"]))
    assert "batch_size 3 is not a multiple of micro_batch 2" in err
    assert runner.invoke(main, ["train", "--data", str(tmp_path / "data"), "--out", run, "--steps", "0"]).exit_code == 2

    # an unknown checkpoint format version is named with both versions
    config = tmp_path / "run/checkpoints/step_00000002/config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "format_version": "7.0"}))
    err = _one_line_error(runner.invoke(main, ["train", "--data", str(tmp_path / "data"), "--out", run,
                                               "--steps", "3", *FLAGS]))
    assert "format_version 7.0 is not supported (this colibri-spec reads 1.0)" in err
    # a damaged shard
    shard = tmp_path / "data/train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    err = _one_line_error(runner.invoke(main, ["train", "--preset", "tiny", "--data", str(tmp_path / "data"),
                                               "--out", str(tmp_path / "r3"), "--steps", "1", *FLAGS]))
    assert "truncated" in err


def test_config_errors_name_the_file(tmp_path):
    runner = CliRunner()
    (tmp_path / "data").mkdir()
    args = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--steps", "1", *FLAGS]
    cases = {
        "notjson.json": ("{", "not a model config JSON"),
        "missing.json": (json.dumps({"d_model": 4}), "n_layers: Field required"),
        "badvalue.json": (json.dumps({"d_model": -4, "n_layers": 2, "n_heads": 1, "n_kv_heads": 1, "head_dim": 4,
                                      "dense_ffn_dim": 8, "n_experts": 2, "expert_dim": 4}), "d_model"),
        "checkpoint.json": (json.dumps({"format_version": "7.0", "d_model": 4}), "format_version 7.0"),
    }
    for name, (text, phrase) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        err = _one_line_error(runner.invoke(main, ["train", "--config", str(path), *args]))
        assert err.startswith(f"Error: {path}: ") and phrase in err, (name, err)


def test_version_exit_status_and_a_failed_run_exits_1(tmp_path, monkeypatch):
    from importlib.metadata import version

    import colibri_model
    from colibri_model.training import Trainer, TrainingDivergedError

    runner = CliRunner()
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"colibri-model, version {version('colibri-model')}\n"
    assert colibri_model.__version__ == version("colibri-model")
    assert "Exit status: 0 ok, 1 a check failed" in runner.invoke(main, ["--help"]).output

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i} " + "word " * 300}) + "\n" for i in range(20)))
    prepare([str(src)], tmp_path / "data", shard_tokens=5000, val_fraction=0.2, progress=False)

    def diverge(self, *args, **kwargs):
        raise TrainingDivergedError("5 non-finite steps in a row at step 1")

    monkeypatch.setattr(Trainer, "train", diverge)
    err = _one_line_error(runner.invoke(main, ["train", "--preset", "tiny", "--data", str(tmp_path / "data"),
                                               "--out", str(tmp_path / "run"), "--steps", "1", *FLAGS]), code=1)
    assert "non-finite steps in a row" in err
