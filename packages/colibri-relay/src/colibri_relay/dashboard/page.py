"""Render a `Snapshot` as one self-contained HTML page (CSS inlined, charts as inline SVG, no script).

Templating is `string.Template` over `page.html`: the page has one layout and no loops in
markup (rows and charts are built here), so a template engine would add a dependency without
removing code. Every value from the store or the run goes through `html.escape` (holder names and
notes are free text written by other people). Auto-refresh is a `<meta http-equiv="refresh">`.
"""

from __future__ import annotations

from functools import cache
from html import escape
from importlib.resources import files
from string import Template

from .charts import Line, Region, heatmap, line_chart
from .snapshot import DASHBOARD_VERSION, LegSpan, Series, Snapshot

# Fixed charts over steps: (chart id, title, metrics fields drawn together).
STEP_CHARTS = [
    ("loss", "Loss (training and validation)", ["loss", "val_loss", "val_loss_infer"]),
    ("lr", "Learning rate", ["lr"]),
    ("tokens_per_s", "Throughput (tokens/s)", ["tokens_per_s"]),
    ("mfu", "MFU (model FLOPs utilisation)", ["mfu"]),
]


@cache
def _asset(name: str) -> str:
    return (files(__package__) / name).read_text(encoding="utf-8")


def _short(sha: str | None) -> str:
    return f"<code title=\"{escape(sha)}\">{escape(sha[:12])}</code>" if sha else "<span class=\"empty\">-</span>"


def _num(value: float | int | None, fmt: str = ".4g") -> str:
    return "" if value is None else format(value, fmt)


def format_duration(seconds: float) -> str:
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours} h {minutes:02d} min"
    return f"{sign}{minutes} min {secs:02d} s" if minutes else f"{sign}{secs} s"


def _regions(legs: list[LegSpan]) -> list[Region]:
    """Leg spans on the step axis; a leg starts where the previous one ended."""
    out, previous_end = [], None
    for span in legs:
        if span.last_step is None or span.first_step is None:
            continue
        start = previous_end if previous_end is not None else span.first_step
        out.append(Region(label=f"L{span.leg}" + (" live" if span.live else ""), start=start, end=span.last_step,
                          live=span.live))
        previous_end = span.last_step
    return out


def _line(series: Series | None, label: str) -> Line:
    return Line(label, series.steps, series.values) if series else Line(label, [], [])


def render_source(snap: Snapshot) -> str:
    src = snap.source
    parts = [f"store <code>{escape(src.store)}</code>"]
    if src.revision:
        when = f" committed {escape(src.revision_time)}" if src.revision_time else ""
        parts.append(f"pinned to revision <code id=\"revision\">{escape(src.revision)}</code>{when}")
    if src.metrics_path:
        parts.append(f"metrics <code>{escape(src.metrics_path)}</code>")
    if src.run_dir:
        parts.append(f"live run <code>{escape(src.run_dir)}</code>")
    parts.append(f"read {escape(src.read_at)}")
    return " &middot; ".join(parts)


def render_baton(snap: Snapshot) -> str:
    baton = snap.baton
    if baton is None:
        return ("<h2>Baton</h2><span class=\"status status-unknown\" id=\"baton-status\">UNKNOWN</span>"
                "<p class=\"empty\">RELAY.json could not be read: see what is missing.</p>")
    facts = [("holder", escape(baton.holder) if baton.holder else "<span class=\"empty\">nobody</span>"),
             ("epoch / seq", f"{baton.epoch} / {baton.seq}"),
             ("current leg", str(baton.current_leg) if baton.current_leg else "none (baton free)"),
             ("legs pushed", str(baton.legs_pushed))]
    if baton.status != "free":
        remaining = baton.lease_remaining_s_estimate
        if remaining is None:
            shown = "unknown (no renewal commit found)"
        elif remaining > 0:
            shown = f"&asymp; {format_duration(remaining)} <b>(estimate)</b>"
        else:
            shown = f"lapsed &asymp; {format_duration(-remaining)} ago <b>(estimate)</b>"
        facts.append(("lease remaining", f"<span id=\"lease-remaining\">{shown}</span>"))
        facts.append(("last renewal", f"{_short(baton.last_renewal_commit)} "
                                      f"{escape(baton.last_renewal_time or '')} (commit time)"))
    facts.append(("lease / heartbeat", f"{format_duration(baton.lease_duration_s)} / "
                                       f"{format_duration(baton.heartbeat_s)}"))
    facts.append(("RELAY.json written", f"{escape(baton.updated_at)} (writer's clock)"))
    rows = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
    note = f"<p class=\"estimate\">{escape(baton.estimate_note)}</p>" if baton.status != "free" else ""
    return (f"<h2>Baton</h2><span class=\"status status-{baton.status}\" id=\"baton-status\">"
            f"{baton.status.upper()}</span><dl class=\"facts\">{rows}</dl>{note}")


def render_problems(snap: Snapshot) -> str:
    if not snap.problems:
        return "<h3>Data</h3><p class=\"ok\">Everything the dashboard looks for was found and read.</p>"
    items = "".join(f"<li>{escape(p)}</li>" for p in snap.problems)
    return f"<h3>What is missing or unreadable ({len(snap.problems)})</h3><ul>{items}</ul>"


def _figure(svg: str) -> str:
    return f"<figure>{svg}</figure>"


def render_step_charts(snap: Snapshot) -> str:
    regions = _regions(snap.legs)
    charts, used = [], set()
    for chart_id, title, fields in STEP_CHARTS:
        used.update(fields)
        present = [f for f in fields if f in snap.series]
        # Show the optional validation lines only when measured; always show the chart itself.
        shown = present or fields[:1]
        charts.append(_figure(line_chart(chart_id, title, [_line(snap.series.get(f), f) for f in shown],
                                         regions=regions)))
    for name, series in snap.series.items():
        if name not in used:
            charts.append(_figure(line_chart(f"field-{name}", name, [_line(series, name)], regions=regions)))
    return "".join(charts)


def render_leg_charts(snap: Snapshot) -> str:
    legs = snap.per_leg

    def over_legs(attr: str, label: str) -> Line:
        pairs = [(float(a.leg), getattr(a, attr)) for a in legs if getattr(a, attr) is not None]
        return Line(label, [p[0] for p in pairs], [p[1] for p in pairs])

    specs = [("legs-loss", "Loss per leg", [("loss_start", "loss at start"), ("loss_end", "loss at end"),
                                            ("val_loss", "last val loss")]),
             ("legs-tokens-per-s", "Mean tokens/s per leg", [("tokens_per_s", "tokens/s")]),
             ("legs-mfu", "Mean MFU per leg", [("mfu", "MFU")]),
             ("legs-hours", "Hours per leg (ledger)", [("hours", "hours")])]
    return "".join(_figure(line_chart(cid, title, [over_legs(a, lab) for a, lab in fields], x_label="leg",
                                      markers=True, integer_x=True)) for cid, title, fields in specs)


def render_moe(snap: Snapshot) -> str:
    moe = snap.moe
    if moe is None:
        return ""
    regions = _regions(snap.legs)
    heat = heatmap("moe-heatmap", f"Expert load share at step {moe.heatmap_step:g} (layers x experts)",
                   moe.layers, moe.load_share)
    vio = line_chart("moe-max-vio", "MaxVio per layer (max load / mean load - 1)",
                     [_line(s, name) for name, s in moe.max_vio.items()], regions=regions)
    dead = line_chart("moe-dead", "Dead experts (all layers)", [_line(moe.dead_experts, "dead experts")],
                      regions=regions)
    return (f"<section id=\"moe\"><h2>Expert balance</h2><div class=\"grid\">{_figure(heat)}{_figure(vio)}"
            f"{_figure(dead)}</div></section>")


def render_ledger(snap: Snapshot) -> str:
    if snap.rounds:
        from .rounds_view import render_rounds

        return render_rounds(snap)
    if not snap.ledger:
        return "<p class=\"empty\" id=\"ledger-empty\">No legs pushed yet.</p>"
    head = ("<tr><th class=\"num\">leg</th><th>holder</th><th>started (UTC)</th><th>finished (UTC)</th>"
            "<th class=\"num\">steps</th><th class=\"num\">tokens</th><th class=\"num\">hours</th><th>hardware</th>"
            "<th class=\"num\">loss in</th><th class=\"num\">loss out</th><th>commit</th><th>notes</th></tr>")
    rows = "".join(
        f"<tr class=\"ledger-row\" data-leg=\"{r.leg}\"><td class=\"num\">{r.leg}</td><td>{escape(r.holder)}</td>"
        f"<td>{escape(r.started_at)}</td><td>{escape(r.finished_at)}</td><td class=\"num\">{r.steps:,}</td>"
        f"<td class=\"num\">{r.tokens:,}</td><td class=\"num\">{r.hours:.3f}</td><td>{escape(r.hardware)}</td>"
        f"<td class=\"num\">{_num(r.loss_start)}</td><td class=\"num\">{_num(r.loss_end)}</td>"
        f"<td>{_short(r.commit) if r.commit else 'untagged'}</td><td>{escape(r.notes)}</td></tr>"
        for r in snap.ledger)
    return f"<table><thead>{head}</thead><tbody>{rows}</tbody></table>"


def render_page(snap: Snapshot, *, refresh_s: int) -> str:
    """The whole page for one snapshot."""
    error = f"<div class=\"error-banner\" id=\"error\">{escape(snap.error)}</div>" if snap.error else ""
    status = snap.baton.status if snap.baton else "unknown"
    return Template(_asset("page.html")).substitute(
        title=escape(f"{status} - relay {snap.source.store}"), css=_asset("dashboard.css"), refresh_s=int(refresh_s),
        source=render_source(snap), error=error, baton=render_baton(snap), problems=render_problems(snap),
        step_charts=render_step_charts(snap), leg_charts=render_leg_charts(snap), moe=render_moe(snap),
        ledger=render_ledger(snap), version=DASHBOARD_VERSION,
    )
