"""Server-side SVG charts: line charts with leg boundaries, and the expert-load heatmap.

Why hand-written SVG: the page must work offline with no CDN, and the relay's dependency budget
(huggingface_hub, pydantic, click, filelock) has no plotting library; matplotlib would add ~40 MB
and numpy for two chart types. An SVG string is also trivially testable (it is in --dump-dom) and
needs no JavaScript. Trade-off: no zoom or hover crosshair; each line has a <title> tooltip and
each heatmap cell states its value in its own <title>.

Every text that reaches the SVG goes through `html.escape` (series names come from metrics files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
WIDTH, HEIGHT = 560, 230
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 30, 34


@dataclass
class Line:
    label: str
    xs: list[float]
    ys: list[float]


@dataclass
class Region:
    """A span of the x axis: a leg. `end` is its last step; the boundary is drawn there."""

    label: str
    start: float
    end: float
    live: bool = False


def _nice_step(span: float, target_ticks: int = 5) -> float:
    raw = span / max(target_ticks, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _ticks(lo: float, hi: float) -> list[float]:
    step = _nice_step(hi - lo)
    first = math.ceil(lo / step) * step
    ticks, value = [], first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _fmt(value: float) -> str:
    """Short tick labels: 41.6k, 1.5M, 3e-04 (a tick label has room for about six characters)."""
    magnitude = abs(value)
    for threshold, unit, suffix in ((1e12, 1e12, "T"), (1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if magnitude >= threshold:
            return f"{value / unit:.4g}{suffix}"
    if value != 0 and magnitude < 1e-3:
        return f"{value:.1e}"
    return f"{value:.4g}"


def _bounds(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if lo == hi:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def line_chart(chart_id: str, title: str, lines: list[Line], *, regions: list[Region] = (), x_label: str = "step",
               markers: bool = False, integer_x: bool = False) -> str:
    """An SVG line chart. `regions` mark legs: a dashed line at each leg's end, its label on top,
    and a shaded band for a live leg. Lines with no points are listed in the legend as '(no data)'."""
    drawn = [line for line in lines if line.xs]
    head = (f'<svg class="chart" data-chart="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
            f'<text class="chart-title" x="{LEFT}" y="16">{escape(title)}</text>')
    if not drawn:
        return head + (f'<text class="chart-empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                       f'no data yet</text></svg>')
    xs = [x for line in drawn for x in line.xs] + [r.start for r in regions] + [r.end for r in regions]
    ys = [y for line in drawn for y in line.ys]
    x_lo, x_hi = (min(xs), max(xs)) if min(xs) != max(xs) else (min(xs) - 1, max(xs) + 1)
    if markers:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    y_lo, y_hi = _bounds(ys)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return round(LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w, 1)

    def py(y: float) -> float:
        return round(TOP + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h, 1)

    parts = [head]
    for region in regions:  # shaded live band under everything else
        if region.live:
            x0, x1 = px(region.start), px(max(region.end, region.start))
            parts.append(f'<rect class="live-band" x="{x0}" y="{TOP}" width="{max(x1 - x0, 2)}" height="{plot_h}">'
                         f'<title>{escape(region.label)}</title></rect>')
    for tick in _ticks(y_lo, y_hi):
        parts.append(f'<line class="gridline" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(tick)}" y2="{py(tick)}"/>'
                     f'<text class="tick" x="{LEFT - 4}" y="{py(tick) + 3}" text-anchor="end">{_fmt(tick)}</text>')
    x_ticks = _ticks(x_lo, x_hi)
    if integer_x:
        x_ticks = [t for t in x_ticks if float(t).is_integer()]
    for tick in x_ticks:
        parts.append(f'<text class="tick" x="{px(tick)}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">'
                     f'{_fmt(tick)}</text>')
    parts.append(f'<text class="axis-label" x="{WIDTH - RIGHT}" y="{HEIGHT - 4}" text-anchor="end">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>')
    for region in regions:
        if not region.live:
            parts.append(f'<line class="leg-boundary" x1="{px(region.end)}" x2="{px(region.end)}" y1="{TOP}" '
                         f'y2="{TOP + plot_h}"><title>end of {escape(region.label)} at {x_label} '
                         f'{_fmt(region.end)}</title></line>')
        mid = px((region.start + region.end) / 2)
        parts.append(f'<text class="leg-label" x="{mid}" y="{TOP + 10}" text-anchor="middle">'
                     f'{escape(region.label)}</text>')
    for i, line in enumerate(drawn):
        color = PALETTE[i % len(PALETTE)]
        points = " ".join(f"{px(x)},{py(y)}" for x, y in zip(line.xs, line.ys, strict=True))
        last = f"{line.label}: last {_fmt(line.ys[-1])} at {x_label} {_fmt(line.xs[-1])}"
        if len(line.xs) > 1:
            parts.append(f'<polyline class="series" data-series="{escape(line.label)}" fill="none" '
                         f'stroke="{color}" points="{points}"><title>{escape(last)}</title></polyline>')
        if markers or len(line.xs) == 1:
            parts += [f'<circle cx="{px(x)}" cy="{py(y)}" r="3" fill="{color}"><title>{escape(line.label)}: '
                      f'{_fmt(y)} at {x_label} {_fmt(x)}</title></circle>' for x, y in zip(line.xs, line.ys, strict=True)]
    legend_x = WIDTH - RIGHT
    shown = lines if len(lines) <= 8 else [*lines[:7], Line(f"+{len(lines) - 7} more", [], [])]
    for line in reversed(shown):
        label = line.label if line.xs or line.label.startswith("+") else f"{line.label} (no data)"
        color = PALETTE[drawn.index(line) % len(PALETTE)] if line.xs else "#999"
        parts.append(f'<text class="legend" x="{legend_x}" y="16" text-anchor="end" fill="{color}">'
                     f'{escape(label)}</text>')
        legend_x -= 7 * len(label) + 14
    parts.append("</svg>")
    return "".join(parts)


def _heat_color(share: float, uniform: float) -> str:
    """Diverging: blue below the uniform share, white at it, red above; near-black for a dead expert."""
    if share <= 0:
        return "#222"
    t = max(-1.0, min(1.0, math.log2(share / uniform) / 2))  # +-1 at 4x / 0.25x the uniform share
    if t >= 0:
        r, g, b = 255, round(255 * (1 - t * 0.85)), round(255 * (1 - t * 0.9))
    else:
        r, g, b = round(255 * (1 + t * 0.85)), round(255 * (1 + t * 0.6)), 255
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(chart_id: str, title: str, layers: list[int], rows: list[list[float]]) -> str:
    """Layers (rows) x experts (columns) of load share, colored against the uniform share 1/E."""
    n_experts = max((len(r) for r in rows), default=0)
    if not rows or n_experts == 0:
        return line_chart(chart_id, title, [])
    # A fixed-width viewBox keeps text the same size as the line charts' whatever the expert count.
    cell_w = (WIDTH - LEFT - RIGHT) / n_experts
    cell_h = max(6.0, min(26.0, 280 / len(rows)))
    width = WIDTH
    height = TOP + cell_h * len(rows) + 46
    uniform = 1.0 / n_experts
    parts = [f'<svg class="chart heatmap" data-chart="{escape(chart_id)}" viewBox="0 0 {width:.0f} {height:.0f}" '
             f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
             f'<text class="chart-title" x="{LEFT}" y="16">{escape(title)}</text>']
    for r, (layer, shares) in enumerate(zip(layers, rows, strict=True)):
        y = TOP + r * cell_h
        parts.append(f'<text class="tick" x="{LEFT - 4}" y="{y + cell_h / 2 + 3:.1f}" text-anchor="end">L{layer}</text>')
        for e, share in enumerate(shares):
            parts.append(f'<rect class="cell" x="{LEFT + e * cell_w:.1f}" y="{y:.1f}" width="{cell_w:.1f}" '
                         f'height="{cell_h:.1f}" fill="{_heat_color(share, uniform)}"><title>layer {layer}, expert '
                         f'{e}: share {share:.4f} ({share / uniform:.2f}x uniform)</title></rect>')
    axis_y = TOP + cell_h * len(rows) + 14
    for e in range(0, n_experts, max(1, n_experts // 8)):
        parts.append(f'<text class="tick" x="{LEFT + (e + 0.5) * cell_w:.1f}" y="{axis_y:.1f}" '
                     f'text-anchor="middle">{e}</text>')
    key_y = axis_y + 10
    for i, (label, ratio) in enumerate([("dead", 0), ("0.25x", 0.25), ("1x uniform", 1), ("4x", 4)]):
        x = LEFT + i * 92
        parts.append(f'<rect x="{x}" y="{key_y}" width="12" height="10" fill="{_heat_color(ratio * uniform, uniform)}" '
                     f'stroke="#999"/><text class="tick" x="{x + 16}" y="{key_y + 9}">{label}</text>')
    parts.append(f'<text class="axis-label" x="{width - RIGHT:.0f}" y="{key_y + 9:.1f}" text-anchor="end">'
                 f'columns: experts</text>')
    parts.append("</svg>")
    return "".join(parts)
