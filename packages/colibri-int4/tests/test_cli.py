"""The `colibri-int4` command line: export, inspect, verify, dequantize, estimate."""

import json

import numpy as np
from click.testing import CliRunner
from colibri_int4.cli import main
from safetensors.numpy import load_file


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_export_inspect_verify_dequantize(make_checkpoint, tmp_path):
    ckpt, config, tensors = make_checkpoint()
    out = tmp_path / "m.coli"
    result = run("export", ckpt, out, "--group", "32", "--asym", "--resident-dtype", "int4", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "MB/s" in result.output and "bits/weight" in result.output

    result = run("inspect", out, "--json")
    assert result.exit_code == 0
    summary = json.loads(result.output)
    assert summary["quantization"]["group_size"] == 32 and summary["quantization"]["symmetric"] is False
    assert summary["resident_bytes"] + summary["expert_bytes"] < summary["file_size"]
    assert len(summary["experts"]) == 2 * 4 and all(e["offset"] % 4096 == 0 for e in summary["experts"])
    assert summary["bits_per_weight"] >= 5.0
    assert "bits/weight" in run("inspect", out).output

    assert run("verify", out, "--no-progress").exit_code == 0

    back = tmp_path / "back"
    assert run("dequantize", out, back, "--dtype", "bf16", "--no-progress").exit_code == 0
    assert set(json.loads((back / "config.json").read_text())) == set(config)
    assert (back / "model.safetensors").stat().st_size > 0

    result = run("estimate", ckpt / "config.json", "--group", "32", "--asym", "--resident-dtype", "int4", "--json")
    assert json.loads(result.output)["file_size"] == out.stat().st_size


def test_verify_fails_on_corruption_and_reports_where(tiny_container, tmp_path):
    data = bytearray(tiny_container[0].read_bytes())
    data[-100] ^= 1  # inside the last expert blob's padding-free payload or padding: covered by its CRC
    path = tmp_path / "bad.coli"
    path.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["verify", str(path), "--no-progress"])
    assert result.exit_code == 1
    assert "FAILED: expert (layer 2, expert 3)" in result.output


def test_user_errors_are_one_line_without_traceback(tmp_path, make_checkpoint):
    bad = tmp_path / "x.coli"
    bad.write_bytes(b"not a container at all, just text" * 10)
    for command in (["inspect", bad], ["dequantize", bad, tmp_path / "o"]):
        result = CliRunner().invoke(main, [str(a) for a in command])
        assert result.exit_code == 2  # bad input; only `verify` reports it as a failed check (1)
        assert "not a colibri-int4 container" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["verify", str(bad)])
    assert result.exit_code == 1 and "FAILED: not a colibri-int4 container" in result.output
    ckpt, _, _ = make_checkpoint(expert_dim=48)
    result = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "y.coli"), "--no-progress"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "not a multiple of 32" in result.output


def test_bad_usage_exits_2(make_checkpoint, tmp_path):
    ckpt, _, _ = make_checkpoint()
    assert CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "a.coli"), "--group", "48"]).exit_code == 2
    assert CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "a.coli"), "--resident-dtype", "fp8"]).exit_code == 2
    assert CliRunner().invoke(main, ["inspect", str(tmp_path / "missing.coli")]).exit_code == 2
    assert "export" in CliRunner().invoke(main, ["--help"]).output


def test_dequantized_checkpoint_reexports_to_the_same_experts(make_checkpoint, tmp_path):
    """dequantize -> export is a fixed point for the routed experts (int4 grid is stable)."""
    ckpt, _, _ = make_checkpoint()
    first, back, second = tmp_path / "1.coli", tmp_path / "back", tmp_path / "2.coli"
    assert run("export", ckpt, first, "--no-progress").exit_code == 0
    assert run("dequantize", first, back, "--no-progress").exit_code == 0
    assert run("export", back, second, "--no-progress").exit_code == 0
    a = load_file(str(back / "model.safetensors"))
    assert run("dequantize", second, tmp_path / "back2", "--no-progress").exit_code == 0
    b = load_file(str(tmp_path / "back2" / "model.safetensors"))
    np.testing.assert_allclose(a["layers.1.moe.experts.up_proj"], b["layers.1.moe.experts.up_proj"], rtol=1e-2, atol=1e-4)


def test_unwritable_destinations_are_one_line_errors(make_checkpoint, tmp_path):
    ckpt, _, _ = make_checkpoint()
    result = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "no" / "dir" / "a.coli"), "--no-progress"],
                                catch_exceptions=False)
    assert result.exit_code == 2 and "No such file or directory" in result.output and "Traceback" not in result.output
    assert run("export", ckpt, tmp_path / "a.coli", "--no-progress").exit_code == 0
    (tmp_path / "blocker").write_text("a file where a directory should be")
    result = CliRunner().invoke(main, ["dequantize", str(tmp_path / "a.coli"), str(tmp_path / "blocker"), "--no-progress"],
                                catch_exceptions=False)
    assert result.exit_code == 2 and "Error:" in result.output and "Traceback" not in result.output


def test_version_and_exit_status_in_help():
    from importlib.metadata import version

    import colibri_int4

    result = run("--version")
    assert result.exit_code == 0 and result.output == f"colibri-int4, version {version('colibri-int4')}\n"
    assert colibri_int4.__version__ == version("colibri-int4")
    assert "Exit status: 0 ok, 1 a check failed" in run("--help").output


def test_estimate_counts_the_tokenizer_beside_config_json(make_checkpoint, tmp_path):
    # a tokenizer.json of the real one's size (SmolLM2's is 1.56 MB): estimate was short by it
    ckpt, _, _ = make_checkpoint(tokenizer=json.dumps({"model": {"vocab": {f"t{i}": i for i in range(90_000)}}}))
    assert (ckpt / "tokenizer.json").stat().st_size > 1_500_000
    out = tmp_path / "m.coli"
    assert run("export", ckpt, out, "--no-progress").exit_code == 0
    estimate = json.loads(run("estimate", ckpt / "config.json", "--json").output)
    assert estimate["file_size"] == out.stat().st_size
    assert estimate["tokenizer_bytes"] == (ckpt / "tokenizer.json").stat().st_size
    # a config.json elsewhere: the tokenizer is named explicitly, or not counted (and the text says so)
    lone = tmp_path / "lone.json"
    lone.write_text((ckpt / "config.json").read_text())
    named = json.loads(run("estimate", lone, "--tokenizer", ckpt / "tokenizer.json", "--json").output)
    assert named["file_size"] == out.stat().st_size
    assert "no tokenizer" in run("estimate", lone).output


def test_verify_progress_total_is_what_it_reads(tiny_container, monkeypatch):
    import colibri_int4.cli as cli

    bars = []

    class RecordingBar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.disable = total, 0, kwargs.get("disable")
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(cli, "tqdm", RecordingBar)
    assert run("verify", tiny_container[0], "--progress").exit_code == 0
    (bar,) = bars
    assert bar.disable is False and bar.total == bar.n > 0
    run("verify", tiny_container[0])  # not a terminal (CliRunner): no bar unless --progress
    assert bars[1].disable is True


def test_a_checksum_failure_is_a_failed_check_everywhere(tiny_container, tmp_path):
    from colibri_int4 import Container

    with Container.open(tiny_container[0]) as c:
        tensor = c.header.tensors[0]
    data = bytearray(tiny_container[0].read_bytes())
    data[tensor.offset] ^= 0xFF
    bad = tmp_path / "bad.coli"
    bad.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["dequantize", str(bad), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 1 and "checksum mismatch" in result.output and result.output.count("\n") == 1
