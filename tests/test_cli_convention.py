"""The command-line convention every Colibri command shares.

- exit status 0 ok, 1 a check failed, 2 bad usage or bad input; errors are one line, no traceback;
- one dtype spelling, `--dtype f32|bf16` (older spellings still accepted, not shown);
- the relay's store is `--store` / `$COLIBRI_RELAY_STORE` wherever a command takes one;
- a RAM budget string is parsed by colibri-stream's `parse_budget` alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

# (program, module, function): every console script of the app and its packages
PROGRAMS = [
    ("colibri", "colibri.cli", "main"),
    ("colibri-spec", "colibri_spec.cli", "main"),
    ("colibri-model", "colibri_model.cli", "main"),
    ("colibri-relay", "colibri_relay.cli", "main"),
    ("colibri-int4", "colibri_int4.cli", "main"),
    ("colibri-stream", "colibri_stream.cli", "main"),
    ("colibri-eval", "colibri_eval.cli", "main"),
]

RUN = "import sys; sys.argv = [{prog!r}, *{argv!r}]; from {module} import {func}; sys.exit({func}())"


def _run(prog: str, module: str, func: str, argv: list[str]) -> subprocess.CompletedProcess:
    code = RUN.format(prog=prog, argv=argv, module=module, func=func)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("prog", "module", "func"), PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_a_bad_flag_exits_2_with_one_error_line(prog, module, func):
    # argparse (colibri-spec) names a missing subcommand before an unknown flag
    before = ["config", "config.json"] if prog == "colibri-spec" else []
    out = _run(prog, module, func, [*before, "--no-such-flag"])
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--no-such-flag" in errors[0], out.stderr


@pytest.mark.parametrize(("prog", "module", "func"), PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_version_exits_0(prog, module, func):
    out = _run(prog, module, func, ["--version"])
    assert out.returncode == 0, out.stderr
    assert prog in out.stdout


def _click_commands():
    """(path, command) of every click command of the packages' CLIs."""
    import importlib

    out = []

    def walk(path, command):
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(f"{path} {name}", sub)
        else:
            out.append((path, command))

    for prog, module, func in PROGRAMS:
        entry = getattr(importlib.import_module(module), func)
        if isinstance(entry, click.Command):
            walk(prog, entry)
    return out


def test_every_dtype_option_is_spelled_f32_bf16():
    found = []
    for path, command in _click_commands():
        for param in command.params:
            if not isinstance(param, click.Option) or "--dtype" not in param.opts:
                continue
            found.append(path)
            ctx = click.Context(command)
            assert param.type.convert("f32", param, ctx) is not None, path
            assert param.type.convert("bf16", param, ctx) is not None, path
            shown = param.get_help_record(ctx)[0]
            assert "f32" in shown and "bf16" in shown, (path, shown)
            for old in ("fp32", "float32", "bfloat16"):
                assert old not in shown, (path, shown)
    for expected in ("colibri-model train", "colibri-model plan-memory", "colibri-int4 dequantize",
                     "colibri-stream generate", "colibri-eval run"):
        assert expected in found, (expected, found)


def test_old_dtype_spellings_are_hidden_aliases():
    from colibri_eval.cli import DtypeChoice as EvalDtype
    from colibri_model.cli.training import DtypeChoice as ModelDtype

    assert EvalDtype().convert("bfloat16", None, None) == "bf16"
    assert EvalDtype().convert("float32", None, None) == "f32"
    model = ModelDtype("auto", "f32", "bf16")
    assert model.convert("fp32", None, None) == model.convert("f32", None, None) == "fp32"  # the trainer's name
    assert model.convert("bf16", None, None) == "bf16"


@pytest.mark.parametrize("flags", [["--dtype", "f32"], ["--precision", "fp32"], ["--dtype", "float32"]])
def test_plan_memory_takes_dtype_and_its_old_name(flags):
    from colibri_model.cli import main

    argv = ["plan-memory", "--preset", "tiny", "--micro-batch", "1", "--seq", "64", "--gpu", "h100-sxm", "--json"]
    result = CliRunner().invoke(main, argv + flags)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["precision"] == "fp32"
    default = CliRunner().invoke(main, argv)
    assert json.loads(default.output)["precision"] == "bf16"
    help_text = CliRunner().invoke(main, ["plan-memory", "--help"]).output
    assert "--dtype" in help_text and "--precision" not in help_text


def test_app_takes_store_env_and_relay_alias(tmp_path, monkeypatch):
    from colibri.cli import main

    nowhere = str(tmp_path / "nowhere")
    runner = CliRunner()
    by_store = runner.invoke(main, ["status", "--store", nowhere])
    by_alias = runner.invoke(main, ["status", "--relay", nowhere])
    monkeypatch.setenv("COLIBRI_RELAY_STORE", nowhere)
    by_env = runner.invoke(main, ["status"])
    for result in (by_store, by_alias, by_env):
        assert result.exit_code == 2 and result.output.startswith("Error: relay:"), result.output
        assert result.output.count("\n") == 1
    assert by_store.output == by_alias.output == by_env.output


def test_the_budget_is_parsed_once():
    import colibri_stream
    from colibri_stream.cli.run import BUDGET
    from colibri_stream.sizes import budget_share

    assert colibri_stream.parse_budget("600MB") == 600_000_000
    assert colibri_stream.parse_budget(" AUTO ") == "auto"
    assert BUDGET.convert("1GiB", None, None) == 1 << 30 and BUDGET.convert("auto", None, None) == "auto"
    with pytest.raises(click.BadParameter):
        BUDGET.convert("12 parsecs", None, None)
    assert budget_share("25%") == 0.25 and budget_share("600MB") is None
    for bad in ("0%", "150%", "x%"):
        with pytest.raises(colibri_stream.SizeFormatError):
            budget_share(bad)


@pytest.mark.parametrize(("flags", "precision"), [([], "auto"), (["--dtype", "bf16"], "bf16"),
                                                  (["--dtype", "f32"], "fp32"), (["--precision", "fp32"], "fp32"),
                                                  (["--precision", "bf16"], "bf16")])
def test_train_takes_dtype_and_its_old_name(tmp_path, flags, precision):
    from colibri_model.cli import main

    train = main.commands["train"]
    ctx = train.make_context("train", ["--preset", "tiny", "--data", str(tmp_path), "--out", str(tmp_path / "run"),
                                       "--steps", "1", *flags])
    assert ctx.params["precision"] == precision
    assert "precision_alias" not in ctx.params
