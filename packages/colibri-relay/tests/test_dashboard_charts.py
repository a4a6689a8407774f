"""The SVG charts: tick labels, empty charts, leg boundaries, escaping, the load heatmap."""

from __future__ import annotations

import re
import xml.dom.minidom

from colibri_relay.dashboard.charts import Line, Region, _fmt, _ticks, heatmap, line_chart


def test_tick_labels_are_short_and_ticks_cover_the_range():
    assert [_fmt(v) for v in (0, 9999, 44000, 500000, 1.5e6, 3e-4, 0.003)] == [
        "0", "9999", "44k", "500k", "1.5M", "3.0e-04", "0.003"]
    ticks = _ticks(0.37, 4.2)
    assert ticks[0] >= 0.37 and ticks[-1] <= 4.2 and 3 <= len(ticks) <= 9


def test_line_chart_draws_lines_boundaries_and_a_live_band_as_valid_svg():
    svg = line_chart("loss", "Loss <&>", [Line("loss", [1, 2, 3, 4], [4.0, 3.0, 2.5, 2.2]), Line("val_loss", [], [])],
                     regions=[Region("L1", 1, 2), Region("L2", 2, 3), Region("L3 live", 3, 4, live=True)])
    xml.dom.minidom.parseString(svg)  # well-formed (escaping included)
    assert "Loss &lt;&amp;&gt;" in svg and svg.count('class="leg-boundary"') == 2 and 'class="live-band"' in svg
    assert 'data-series="loss"' in svg and "val_loss (no data)" in svg
    points = re.search(r'points="([^"]+)"', svg).group(1).split()
    ys = [float(p.split(",")[1]) for p in points]
    assert ys == sorted(ys)  # a falling loss is drawn going down the page (SVG y grows downwards)


def test_an_empty_chart_says_no_data_and_a_constant_series_still_draws():
    assert "no data yet" in line_chart("mfu", "MFU", [Line("mfu", [], [])])
    svg = line_chart("lr", "lr", [Line("lr", [5], [1e-3])])
    xml.dom.minidom.parseString(svg)
    assert "<circle" in svg


def test_heatmap_has_one_cell_per_layer_and_expert_and_marks_dead_experts():
    rows = [[0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]]
    svg = heatmap("moe", "load", [0, 1], rows)
    xml.dom.minidom.parseString(svg)
    assert svg.count('class="cell"') == 8
    assert 'fill="#ffffff"' in svg  # exactly uniform is white
    assert svg.count('fill="#222"') == 2 + 1  # two dead experts, plus the key's "dead" swatch
    assert "layer 1, expert 0: share 0.5000 (2.00x uniform)" in svg
