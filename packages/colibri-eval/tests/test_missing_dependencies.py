"""A plain `pip install colibri-eval` has no torch, transformers, colibri packages, datasets or
lm-eval: every path that needs one says, in one line and with exit code 2, which extra to
install. The imports are made to fail with `sys.modules[name] = None` (what Python does for a
module it cannot find), after forgetting the modules of ours that already imported them."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner
from colibri_eval.cli import main

OURS_THAT_IMPORT_TORCH = ("colibri_eval.runner", "colibri_eval.scoring_engine", "colibri_eval.lm_eval_model",
                          "colibri_eval.adapters.hf_causal_lm", "colibri_eval.adapters.colibri_checkpoint",
                          "colibri_eval.adapters.int4_stream")


def _uninstall(monkeypatch, *modules: str) -> None:
    for name in OURS_THAT_IMPORT_TORCH:
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def _run(tmp_path, *args):
    return CliRunner().invoke(main, ["run", "--tasks", "piqa", "--limit", "1", "--out", str(tmp_path / "r.json"),
                                     *args])


def _one_line(result, extra: str) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output and result.output.count("\n") == 1, result.output
    assert f"pip install 'colibri-eval[{extra}]'" in result.output, result.output
    return result.output


@pytest.mark.parametrize("kind, missing, extra, named", [
    ("hf", "torch", "hf", "torch"),  # was a traceback: the runner imported torch before the adapter
    ("hf", "transformers", "hf", "transformers"),
    ("colibri", "torch", "colibri", "torch"),
    ("colibri", "colibri_model", "colibri", "colibri-model"),
    ("int4", "colibri_stream", "colibri", "colibri-stream"),
])
def test_run_names_the_extra_of_the_model_kind(monkeypatch, tmp_path, kind, missing, extra, named):
    _uninstall(monkeypatch, missing)
    model = tmp_path / "model"
    model.mkdir()
    out = _one_line(_run(tmp_path, "--model", f"{kind}:{model}", "--data-dir", "bundled"), extra)
    assert f"a{'n' if kind != 'colibri' else ''} {kind}: model needs {named} (not installed)" in out
    assert not (tmp_path / "r.json").exists()


def test_hf_dataset_ids_without_datasets(monkeypatch, tmp_path):
    _uninstall(monkeypatch, "datasets")
    out = _one_line(_run(tmp_path, "--model", "hf:x"), "hub")  # no --data-dir: HF dataset ids
    assert "--data-dir bundled" in out


def test_colibri_lm_eval_without_lm_eval(monkeypatch, capsys):
    from colibri_eval import lm_eval

    monkeypatch.delitem(sys.modules, "colibri_eval.lm_eval_model", raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setattr(sys, "argv", ["colibri-lm-eval", "run", "--model", "colibri"])
    with pytest.raises(SystemExit) as info:
        lm_eval.main()
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err == "colibri-lm-eval: error: colibri-lm-eval needs lm-eval (not installed): " \
                  "pip install 'colibri-eval[lm-eval]'\n"


def test_versions(monkeypatch, capsys):
    from importlib.metadata import version

    import colibri_eval
    from colibri_eval import lm_eval

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"colibri-eval, version {version('colibri-eval')}\n"
    assert colibri_eval.__version__ == version("colibri-eval")
    assert "Exit status: 0 ok, 1 a check failed" in CliRunner().invoke(main, ["--help"]).output
    monkeypatch.setattr(sys, "argv", ["colibri-lm-eval", "--version"])
    lm_eval.main()
    assert capsys.readouterr().out.startswith(f"colibri-lm-eval (colibri-eval {version('colibri-eval')}), lm-eval ")
