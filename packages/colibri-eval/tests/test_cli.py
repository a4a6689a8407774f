"""The ``colibri-eval`` command: results, samples, gates, baseline, table, exit codes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from colibri_eval.cli import main
from colibri_eval.results import read_results, write_results

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def first_run(tiny_hf_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("cli")
    out, samples = out_dir / "r.json", out_dir / "s.jsonl"
    result = CliRunner().invoke(main, [
        "run", "--model", f"hf:{tiny_hf_dir}", "--tasks", "piqa,lambada_openai", "--data-dir", "bundled",
        "--limit", "6", "--out", str(out), "--log-samples", str(samples), "--no-progress",
        "--bootstrap-iters", "1000"])
    return result, out, samples


def test_run_writes_results_and_samples(first_run):
    result, out, samples = first_run
    assert result.exit_code == 0, result.output
    results = read_results(out)
    assert results.results_version == "1.0" and results.model_kind == "hf"
    assert set(results.tasks) == {"piqa", "lambada_openai"} and results.tasks["piqa"].n == 6
    assert results.tasks["lambada_openai"].metrics["perplexity"].stderr > 0
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 12
    piqa = [s for s in lines if s["task"] == "piqa"][0]
    assert {"doc_id", "loglikelihoods", "pred", "target", "metrics"} <= set(piqa)
    assert len(piqa["loglikelihoods"]) == 2
    assert "piqa             acc" in result.output


def _run(tiny_hf_dir, tmp_path, *extra):
    return CliRunner().invoke(main, [
        "run", "--model", f"hf:{tiny_hf_dir}", "--tasks", "piqa,lambada_openai", "--data-dir", "bundled",
        "--limit", "6", "--out", str(tmp_path / "new.json"), "--no-progress", "--bootstrap-iters", "100", *extra])


def test_min_bars_gate_the_exit_code(tiny_hf_dir, tmp_path, first_run):
    results = read_results(first_run[1])
    acc = results.tasks["piqa"].metrics["acc"].value
    ppl = results.tasks["lambada_openai"].metrics["perplexity"].value
    ok = _run(tiny_hf_dir, tmp_path, "--min", f"piqa.acc={acc - 0.01}", "--min", f"lambada_openai.perplexity<={ppl * 1.01}")
    assert ok.exit_code == 0, ok.output
    assert "PASS piqa.acc >=" in ok.output
    bad = _run(tiny_hf_dir, tmp_path, "--min", f"piqa.acc={acc + 0.01}")
    assert bad.exit_code == 1 and "FAIL piqa.acc >=" in bad.output


def test_baseline_regression_noise_and_ok(tiny_hf_dir, tmp_path, first_run):
    results = read_results(first_run[1])
    same = _run(tiny_hf_dir, tmp_path, "--baseline", str(first_run[1]), "--max-drop", "0.02")
    assert same.exit_code == 0 and "ok         piqa.acc" in same.output
    better = results.model_copy(deep=True)
    better.tasks["piqa"].metrics["acc"].value += 0.10  # a 10-point drop, but 6 items: inside 2 se
    write_results(better, tmp_path / "noisy.json")
    noisy = _run(tiny_hf_dir, tmp_path, "--baseline", str(tmp_path / "noisy.json"))
    assert noisy.exit_code == 0 and "noise      piqa.acc" in noisy.output
    better.tasks["piqa"].metrics["acc"].value += 0.80
    better.tasks["piqa"].metrics["acc"].stderr = 0.001
    write_results(better, tmp_path / "regressed.json")
    regressed = _run(tiny_hf_dir, tmp_path, "--baseline", str(tmp_path / "regressed.json"))
    assert regressed.exit_code == 1 and "REGRESSION piqa.acc" in regressed.output


@pytest.mark.parametrize("args, message", [
    (["--tasks", "piqa,mmlu"], "unknown task 'mmlu'"),
    (["--min", "piqa.acc>0.5"], "bad --min 'piqa.acc>0.5'"),
    (["--min", "hellaswag.acc=0.5"], "task 'hellaswag' is not in --tasks"),
    (["--model", "gguf:/x"], "expected hf:PATH, colibri:PATH or int4:PATH"),
    (["--out", "/nonexistent/dir/o.json"], "--out /nonexistent/dir/o.json: no such directory"),  # before the run
])
def test_bad_usage_exits_2_with_one_line(tmp_path, args, message):
    base = ["run", "--model", "hf:/nonexistent", "--tasks", "piqa", "--data-dir", "bundled", "--out", str(tmp_path / "o.json")]
    result = CliRunner().invoke(main, base + args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_bad_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "piqa.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n{"goal": \n')
    result = CliRunner().invoke(main, ["run", "--model", "hf:/nonexistent", "--tasks", "piqa", "--data-dir",
                                       str(tmp_path), "--out", str(tmp_path / "o.json")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'piqa.jsonl'}:2: malformed JSON" in result.output


def test_table_and_unknown_results_version(first_run, tmp_path):
    result = CliRunner().invoke(main, ["table", str(first_run[1]), str(first_run[1])])
    assert result.exit_code == 0
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("| model | lambada_openai (acc) | lambada_openai (ppl) | piqa (acc) |")
    assert len(lines) == 4
    data = json.loads(first_run[1].read_text())
    data["results_version"] = "2.0"
    (tmp_path / "future.json").write_text(json.dumps(data))
    bad = CliRunner().invoke(main, ["table", str(tmp_path / "future.json")])
    assert bad.exit_code == 2 and "results_version 2.0 is not supported (this colibri-eval reads 1.0)" in bad.output
