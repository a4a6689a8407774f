"""The `colibri-stream` CLI: the command shapes others script against, and its errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from colibri_stream import ReportVersionError, read_generate_report
from colibri_stream.cli import main
from colibri_stream.stats import STATS_VERSION


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_generate_json_has_text_and_stats(tiny):
    result = run(
        "generate",
        tiny[0],
        "--prompt",
        "Hello there",
        "--ram-budget",
        "200MB",
        "--max-new-tokens",
        "8",
        "--json",
        "--trace",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["new_tokens"] == len(out["token_ids"]) <= 8 and isinstance(out["text"], str)
    stats = out["stats"]
    for key in (
        "hits",
        "misses",
        "bytes_read",
        "evictions",
        "prefetch_used",
        "prefetch_wasted",
        "per_layer_hit_rate",
        "io_seconds",
        "compute_seconds",
        "resident_mb",
        "cache_mb",
        "trace",
        "bytes_read_os",
        "io_agreement",
    ):
        assert key in stats
    assert stats["stats_version"] == STATS_VERSION and stats["misses"] > 0
    assert stats["io_agreement"] in ("agree", "served from page cache", "re-read under pressure", "unavailable")
    assert out["budget"]["ram_budget"] == 200_000_000
    report = read_generate_report(result.output)  # the versioned schema others read
    assert report.stats.misses == stats["misses"] and report.stats.trace is not None
    assert report.budget.heap_slack_bytes == out["budget"]["heap_slack_bytes"] > 0
    assert report.budget.tokenizer_bytes == out["budget"]["tokenizer_bytes"] > 0


def test_report_reader_refuses_unknown_major_version(tiny):
    result = run(
        "generate", tiny[0], "--prompt", "Hi", "--ram-budget", "200MB", "--max-new-tokens", "1", "--json"
    )
    out = json.loads(result.output)
    out["report_version"] = "2.0"
    with pytest.raises(ReportVersionError, match="2.0.*1.1"):
        read_generate_report(json.dumps(out))


def test_generate_streams_text_and_summary(tiny):
    result = run(
        "generate",
        tiny[0],
        "--prompt",
        "Hello",
        "--ram-budget",
        "0.2GB",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--compute",
        "dequant",
    )
    assert result.exit_code == 0, result.output
    assert "hits" in result.output and "tok/s" in result.output


def test_bad_size_is_a_usage_error(tiny):
    result = run("generate", tiny[0], "--prompt", "x", "--ram-budget", "12 parsecs", "--max-new-tokens", "1")
    assert result.exit_code == 2
    assert "--ram-budget" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_missing_budget_is_a_usage_error_naming_the_option(tiny, command):
    args = ["--prompt", "x", "--max-new-tokens", "1"] if command == "generate" else []
    result = run(command, tiny[0], *args)
    assert result.exit_code == 2
    assert "Missing option '--ram-budget'" in result.output and "Traceback" not in result.output


def test_plan_without_a_budget_states_the_minimum_and_full_budgets(tiny):
    result = run("plan", tiny[0])
    assert result.exit_code == 0, result.output
    assert "minimum budget" in result.output and "full budget" in result.output


def test_too_small_budget_names_the_minimum(tiny):
    result = run("generate", tiny[0], "--prompt", "x", "--ram-budget", "1MiB", "--max-new-tokens", "1")
    assert result.exit_code == 2
    assert "too small" in result.output and "minimum" in result.output


def test_corrupted_container_is_one_line_naming_the_expert(corrupted):
    path, (layer, expert), prompt = corrupted
    result = run("generate", path, "--prompt", prompt, "--ram-budget", "200MB", "--max-new-tokens", "2")
    assert result.exit_code == 1  # a check failed: the blob's CRC-32
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and f"layer {layer}, expert {expert}" in errors[0]
    assert "Traceback" not in result.output


def test_chat_reads_turns_from_stdin(tiny):
    result = run(
        "chat", tiny[0], "--ram-budget", "200MB", "--max-new-tokens", "4", input="Hi!\nHow are you?\n\n"
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("colibri> ") == 2


def test_plan_json(tiny):
    result = run("plan", tiny[0], "--ram-budget", "200MB", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["total_experts"] == 48 and plan["cache_slots"] >= 1


def test_help_reads_well():
    result = run("--help")
    assert result.exit_code == 0 and "generate" in result.output and "chat" in result.output
    assert "KiB" in run("generate", "--help").output


def test_version_and_exit_status_in_help():
    from importlib.metadata import version

    import colibri_stream

    result = run("--version")
    assert result.exit_code == 0 and result.output == f"colibri-stream, version {version('colibri-stream')}\n"
    assert colibri_stream.__version__ == version("colibri-stream")
    assert "Exit status: 0 ok, 1 a check failed" in run("--help").output


def test_a_file_that_is_no_container_is_bad_input(tmp_path):
    bad = tmp_path / "x.coli"
    bad.write_bytes(b"plain text, not a container" * 20)
    for command in ("generate", "plan"):
        args = [command, bad, "--ram-budget", "200MB"] + (["--prompt", "x"] if command == "generate" else [])
        result = run(*args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"Error: {bad}: not a colibri-int4 container") and "Traceback" not in result.output
        assert result.output.count("\n") == 1


def test_bench_exits_1_when_the_disk_honesty_check_fails(tiny, monkeypatch):
    import colibri_stream.studies.bench as bench

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {"points": [{"contaminated": True}]})
    result = CliRunner().invoke(main, ["bench", str(tiny[0]), "--budgets", "50%", "--json"])
    assert result.exit_code == 1 and "page cache" in result.output and "Traceback" not in result.output


def test_bench_reports_prefill_and_decode_apart_like_llama_bench(tiny):
    result = run("bench", tiny[0], "--budgets", "100%", "-p", "24", "-n", "4", "--runs", "1", "--bandwidth-mb", "1",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["bench_version"] == "2.1" and report["prompt_tokens"] == 24 and report["max_new_tokens"] == 4
    point = report["points"][0]
    assert point["prefill_tokens_per_s"] > 0 and point["tokens_per_s"] > 0
    assert point["prefill_tokens_per_s"] == pytest.approx(24 / point["ttft_s"], rel=1e-6)
    table = run("bench", tiny[0], "--budgets", "100%", "-p", "24", "-n", "4", "--runs", "1", "--bandwidth-mb", "1")
    assert "pp t/s" in table.output and "tg t/s" in table.output and "prefill of 24 tokens" in table.output
    both = run("bench", tiny[0], "--prompt", "hi", "-p", "8")
    assert both.exit_code == 2 and "not both" in both.output


def test_top_k_is_sampling_and_the_expert_count_has_its_own_name(tiny):
    """`--top-k 40` means what it means in every other tool: sample from the 40 likeliest tokens.
    It used to run 40 experts per token; the expert count is --experts-per-token, and a count
    above the trained top-k (2 here) is refused unless asked for."""
    sampled = run("generate", tiny[0], "--prompt", "Hello there", "--ram-budget", "200MB", "--max-new-tokens", "6",
                  "--temperature", "0.8", "--top-k", "40", "--seed", "3", "--json")
    assert sampled.exit_code == 0, sampled.output
    out = json.loads(sampled.output)
    assert out["budget"]["experts_per_token"] == 1  # the config's top_k_infer: one expert per token
    alias = run("generate", tiny[0], "--prompt", "Hello there", "--ram-budget", "200MB", "--max-new-tokens", "6",
                "--temperature", "0.8", "--sample-top-k", "40", "--seed", "3", "--json")
    assert json.loads(alias.output)["token_ids"] == out["token_ids"]
    two = run("generate", tiny[0], "--prompt", "Hi", "--ram-budget", "200MB", "--max-new-tokens", "2",
              "--experts-per-token", "2", "--json")
    assert two.exit_code == 0 and json.loads(two.output)["budget"]["experts_per_token"] == 2
    refused = run("generate", tiny[0], "--prompt", "Hi", "--ram-budget", "200MB", "--max-new-tokens", "2",
                  "--experts-per-token", "8")
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "8 experts per token exceeds the 2" in refused.output and "--allow-extra-experts" in refused.output
    forced = run("generate", tiny[0], "--prompt", "Hi", "--ram-budget", "200MB", "--max-new-tokens", "2",
                 "--experts-per-token", "8", "--allow-extra-experts", "--json")
    assert forced.exit_code == 0 and json.loads(forced.output)["budget"]["experts_per_token"] == 8
