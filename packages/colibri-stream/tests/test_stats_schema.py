"""The stats JSON is declared once (stats.py): writer, reader and STATS.md agree on every key."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
from colibri_stream import LayerCounters, StatsReport, StreamStats
from colibri_stream.stats import STATS_VERSION, report_fields
from colibri_stream.traces.events import TraceEvent

STATS_MD = Path(__file__).resolve().parents[1] / "src" / "colibri_stream" / "STATS.md"


def documented_keys(heading: str) -> set[str]:
    """The backticked names in the first column of the table right under `heading`."""
    text = STATS_MD.read_text()
    start = text.index(heading)
    section = text[start + len(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith(("| field", "|---")):
            rows.append(line.split("|")[1])
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}


def populated() -> StreamStats:
    stats = StreamStats(record_trace=True, resident_bytes=12_345_678, policy="lfu", io_mode="direct")
    stats.hits, stats.misses, stats.prefetch_actual, stats.prefetch_correct = 3, 1, 4, 3
    stats.io_seconds = 0.1234567
    stats.bytes_read_os, stats.io_agreement = 4096, "agree"
    layer = stats.layer(2)
    layer.hits, layer.misses, layer.prefetch_actual, layer.prefetch_correct = 3, 1, 4, 3
    stats.trace.append(TraceEvent(0, 2, (5, 7)))
    return stats


def test_every_declared_key_is_documented_in_stats_md_and_nothing_else():
    written = set(StreamStats().to_dict(include_trace=True))
    assert written == documented_keys("## `stats`")
    assert set(LayerCounters().to_dict()) == documented_keys("### `per_layer` entries")
    assert f'`"{STATS_VERSION}"`' in STATS_MD.read_text()


def test_writer_and_reader_have_the_same_keys():
    assert set(StreamStats().to_dict(include_trace=True)) == set(StatsReport.model_fields)
    assert set(StreamStats().to_dict()) == set(StatsReport.model_fields) - {"trace"}


@pytest.mark.parametrize("cls", [StreamStats, LayerCounters])
def test_every_reported_figure_computes_on_empty_and_filled_counters(cls):
    """What caught `LayerCounters.prefetch_accuracy` naming counters the class did not have:
    every declared key is computed, on fresh counters (0 / 0) and on filled ones."""
    filled = populated() if cls is StreamStats else populated().layer(2)
    for obj in (cls(), filled):
        for f in report_fields(cls):
            value = f.value(obj)
            may_be_null = f.optional or isinstance(f.kind, types.UnionType)  # e.g. bytes_read_os off Linux
            assert value is not None or may_be_null, f.key


def test_round_trip_keeps_every_figure_including_per_layer_prefetch():
    stats = populated()
    out = stats.to_dict(include_trace=True)
    read = StatsReport.model_validate(out)
    assert read.model_dump(exclude={"per_layer", "trace"}) == {k: v for k, v in out.items() if k not in ("per_layer", "trace")}
    layer = read.per_layer["2"]
    assert isinstance(layer, LayerCounters) and layer == stats.layer(2)
    assert out["per_layer"]["2"]["prefetch_accuracy"] == layer.prefetch_accuracy == 0.75
    assert out["resident_mb"] == 12.346 and out["io_seconds"] == 0.123457 and out["hit_rate"] == 0.75
    assert read.trace == [(0, 2, [5, 7])]


def test_a_stats_1_0_report_still_reads():
    old = StreamStats().to_dict()
    old["stats_version"] = "1.0"
    old["per_layer"] = {"1": {"hits": 2, "misses": 1}}  # 1.0 had no per-layer prefetch figures
    layer = StatsReport.model_validate(old).per_layer["1"]
    assert (layer.hits, layer.prefetch_actual, layer.prefetch_accuracy) == (2, 0, 0.0)


def test_reader_names_a_missing_key():
    out = StreamStats().to_dict()
    del out["bytes_read"]
    with pytest.raises(ValueError, match="bytes_read"):
        StatsReport.model_validate(out)


def test_reset_zeroes_counters_and_keeps_settings_and_memory():
    stats = populated()
    stats.reset()
    assert (stats.hits, stats.layers, stats.trace, stats.io_seconds) == (0, {}, [], 0.0)
    assert (stats.resident_bytes, stats.policy, stats.io_mode, stats.record_trace) == (12_345_678, "lfu", "direct", True)


def test_derived_figures_are_read_only():
    with pytest.raises(AttributeError, match="derived"):
        StreamStats().hit_rate = 1.0
