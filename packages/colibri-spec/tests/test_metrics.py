"""metrics.jsonl: the strict reader (a run's own metrics) and the tolerant one (displays)."""

from __future__ import annotations

import json

import pytest
from colibri_spec import (
    METRICS_FILE,
    MetricsFormatError,
    MetricsRecord,
    MetricsVersionError,
    VersionMismatchError,
    parse_metrics_text,
    read_metrics,
    scan_metrics_lines,
)

RECORD = dict(step=1, time=0.0, loss=2.5, lr=1e-3, phase="warmup", grad_norm=1.0, tokens_seen=64, tokens_per_s=10.0,
              mfu=None)


def _line(**changes) -> str:
    return MetricsRecord(**{**RECORD, **changes}).model_dump_json() + "\n"


def test_strict_reader_reads_a_run(tmp_path):
    (tmp_path / METRICS_FILE).write_text(_line(step=0, loss=None) + _line() + "\n")  # a blank line is skipped
    records = read_metrics(tmp_path)
    assert [(r.step, r.loss) for r in records] == [(0, None), (1, 2.5)]


@pytest.mark.parametrize(("text", "error", "message"), [
    ('{"step": 1\n', MetricsFormatError, r"m.jsonl:1: not valid JSON"),
    ("[1]\n", MetricsFormatError, r"m.jsonl:1: expected a JSON object"),
    (json.dumps({**RECORD, "metrics_version": "2.0"}) + "\n", MetricsVersionError,
     r"m.jsonl:1: metrics_version 2.0 is not supported \(this colibri-spec reads 1.0\)"),
    (json.dumps(RECORD) + "\n", MetricsVersionError, r"m.jsonl:1: metrics_version \(missing\) is not supported"),
    (json.dumps({**RECORD, "metrics_version": "1.0", "lossy": 1}) + "\n", MetricsFormatError,
     r"m.jsonl:1: invalid metrics record: .*lossy"),
])
def test_strict_reader_refuses_the_first_bad_line(text, error, message):
    with pytest.raises(error, match=message):
        parse_metrics_text(text, "m.jsonl")


def test_version_error_names_both_versions():
    with pytest.raises(VersionMismatchError) as caught:
        parse_metrics_text(json.dumps({**RECORD, "metrics_version": "2.1"}), "m.jsonl")
    assert (caught.value.key, caught.value.found, caught.value.known) == ("metrics_version", "2.1", "1.0")


def test_tolerant_reader_keeps_what_parses_and_reports_the_rest():
    text = (_line() + "{not json\n" + json.dumps({"metrics_version": "2.0", "step": 2}) + "\n" + "[1, 2]\n"
            + json.dumps({"step": 3, "reward": 1.0}) + "\n" + '{"step": 4, "lo')
    scanned = scan_metrics_lines(text, "m.jsonl", reader="dashboard")
    assert [(line.lineno, line.data["step"]) for line in scanned.lines] == [(1, 1), (5, 3)]
    assert scanned.incomplete_tail
    assert scanned.problems == [
        "m.jsonl line 2: not valid JSON (Expecting property name enclosed in double quotes); skipped",
        "m.jsonl line 3: metrics_version 2.0 is not supported (this dashboard reads 1.0); skipped",
        "m.jsonl line 4: not a JSON object; skipped",
    ]


def test_tolerant_reader_caps_its_problems_and_continues_line_numbers():
    scanned = scan_metrics_lines("x\n" * 5, "m.jsonl", first_lineno=11, max_problems=2)
    assert scanned.problems[0].startswith("m.jsonl line 11:") and scanned.problems[-1] == "m.jsonl: more problems not shown"
    assert len(scanned.problems) == 3 and not scanned.lines
