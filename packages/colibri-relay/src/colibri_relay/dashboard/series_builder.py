"""From per-leg metrics points to chart data: series over steps, aggregates per leg, the MoE views.

Series are downsampled for display to at most `MAX_POINTS` points each (every k-th point plus the
last, and always each leg's last point, so leg ends stay exact); `total_points` keeps the true
count. Trade-off: a spike between kept points can vanish from the chart; the JSON says how many
points were dropped, and the full data stays in the store's metrics files.
"""

from __future__ import annotations

from statistics import fmean

from ..ledger import LedgerEntry
from .metrics_reader import MetricsPoint
from .snapshot import LegAggregate, LegSpan, MoEView, Series

MAX_POINTS = 1200


def _thin(steps: list[float], values: list[float], keep: set[int]) -> tuple[list[float], list[float]]:
    if len(steps) <= MAX_POINTS:
        return steps, values
    stride = -(-len(steps) // MAX_POINTS)
    idx = sorted({*range(0, len(steps), stride), len(steps) - 1, *keep})
    return [steps[i] for i in idx], [values[i] for i in idx]


def _series(name: str, pairs: list[tuple[float, float, bool]]) -> Series:
    """`pairs`: (step, value, is_last_of_its_leg) in step order."""
    steps = [s for s, _, _ in pairs]
    values = [v for _, v, _ in pairs]
    keep = {i for i, (_, _, last) in enumerate(pairs) if last}
    thin_steps, thin_values = _thin(steps, values, keep)
    return Series(name=name, steps=thin_steps, values=thin_values, total_points=len(pairs))


def build_series(leg_points: list[tuple[LegSpan, list[MetricsPoint]]]) -> dict[str, Series]:
    """Every numeric field over steps, across all legs (in leg order, which is step order)."""
    pairs: dict[str, list[tuple[float, float, bool]]] = {}
    for _, points in leg_points:
        for i, point in enumerate(points):
            for key, value in point.values.items():
                pairs.setdefault(key, []).append((point.step, value, i == len(points) - 1))
    return {name: _series(name, rows) for name, rows in sorted(pairs.items())}


def _mean(points: list[MetricsPoint], key: str) -> float | None:
    # tokens/s is 0.0 on a trainer's step-0 record (nothing timed yet): not a measurement.
    values = [p.values[key] for p in points if key in p.values and p.values[key] > 0]
    return fmean(values) if values else None


def _last(points: list[MetricsPoint], key: str) -> float | None:
    for point in reversed(points):
        if key in point.values:
            return point.values[key]
    return None


def _first(points: list[MetricsPoint], key: str) -> float | None:
    for point in points:
        if key in point.values:
            return point.values[key]
    return None


def build_per_leg(leg_points: list[tuple[LegSpan, list[MetricsPoint]]], entries: list[LedgerEntry]) -> list[LegAggregate]:
    """One aggregate per leg: loss in/out from the ledger (or the metrics when the ledger lacks them)."""
    by_leg = {e.leg: e for e in entries}
    out = []
    for span, points in leg_points:
        entry = None if span.live else by_leg.get(span.leg)
        out.append(LegAggregate(
            leg=span.leg, label=span.label,
            loss_start=entry.loss_start if entry and entry.loss_start is not None else _first(points, "loss"),
            loss_end=entry.loss_end if entry and entry.loss_end is not None else _last(points, "loss"),
            val_loss=_last(points, "val_loss"), tokens_per_s=_mean(points, "tokens_per_s"), mfu=_mean(points, "mfu"),
            hours=entry.hours if entry else None, tokens=entry.tokens if entry else None,
        ))
    return out


def build_moe(leg_points: list[tuple[LegSpan, list[MetricsPoint]]]) -> MoEView | None:
    """The MoE views, or None when no metrics line carries router stats (e.g. a dense payload)."""
    routed: list[tuple[MetricsPoint, bool]] = []
    for _, points in leg_points:
        routed += [(p, i == len(points) - 1) for i, p in enumerate(points) if p.router]
    if not routed:
        return None
    latest = routed[-1][0]
    layers = sorted(latest.router, key=lambda r: r.layer)
    max_vio: dict[str, list[tuple[float, float, bool]]] = {}
    dead: list[tuple[float, float, bool]] = []
    for point, last in routed:
        for layer in point.router:
            if layer.max_vio is not None:
                max_vio.setdefault(f"L{layer.layer}", []).append((point.step, layer.max_vio, last))
        counts = [layer.dead_experts for layer in point.router if layer.dead_experts is not None]
        if counts:
            dead.append((point.step, float(sum(counts)), last))
    ordered = sorted(max_vio, key=lambda name: int(name[1:]))
    return MoEView(heatmap_step=latest.step, layers=[r.layer for r in layers],
                   load_share=[r.load for r in layers],
                   max_vio={name: _series(name, max_vio[name]) for name in ordered},
                   dead_experts=_series("dead_experts", dead))
