"""The dashboard's view of a run of parallel rounds (ROUNDS.md): one row per merged round (workers,
rejections, tokens, round time, utilisation, MaxVio, dead experts) read from the round ledger, and
its HTML table. A parallel run has no legs: the legs' charts stay empty and say so."""

from __future__ import annotations

from html import escape

from ..errors import FileNotFoundInStore, RelayFileCorrupt
from ..ledger import LEDGER_JSONL
from ..round_state import parse_round_ledger
from ..store import RelayStore
from .snapshot import RoundRow, Snapshot


def read_round_rows(store: RelayStore, revision: str, problems: list[str]) -> list[RoundRow]:
    """Newest round first; a ledger that does not parse is one problem and no rows."""
    where = f"{store.spec}@{revision[:12]} {LEDGER_JSONL}"
    try:
        entries = parse_round_ledger(store.read_file(LEDGER_JSONL, revision), where)
    except FileNotFoundInStore:
        problems.append(f"{where} does not exist: no rounds to show")
        return []
    except RelayFileCorrupt as exc:
        problems.append(f"round ledger unreadable: {exc}")
        return []
    rows = []
    for e in reversed(entries):
        ends = [c.loss_end for c in e.contributions if c.loss_end is not None]
        rows.append(RoundRow(round=e.round, merger=e.merger, workers=len(e.contributions), rejected=len(e.rejected),
                             tokens=e.tokens, round_s=e.round_s, utilisation=e.utilisation,
                             loss_end=sum(ends) / len(ends) if ends else None, max_vio=e.stats.get("max_vio"),
                             dead_experts=e.stats.get("dead_experts"), base_commit=e.base_commit,
                             finished_at=e.finished_at))
    if not rows:
        problems.append("no round merged yet")
    return rows


def _num(x, fmt: str = "{:.4g}") -> str:
    return "" if x is None else fmt.format(x)


def render_rounds(snap: Snapshot) -> str:
    if not snap.rounds:
        return "<p class=\"empty\" id=\"rounds-empty\">No round merged yet.</p>"
    head = ("<tr><th class=\"num\">round</th><th>merger</th><th class=\"num\">workers</th>"
            "<th class=\"num\">rejected</th><th class=\"num\">tokens</th><th class=\"num\">round s</th>"
            "<th class=\"num\">utilisation</th><th class=\"num\">loss out (mean)</th><th class=\"num\">MaxVio</th>"
            "<th class=\"num\">dead experts</th><th>finished (UTC)</th></tr>")
    rows = "".join(
        f"<tr class=\"round-row\" data-round=\"{r.round}\"><td class=\"num\">{r.round}</td><td>{escape(r.merger)}</td>"
        f"<td class=\"num\">{r.workers}</td><td class=\"num\">{r.rejected}</td><td class=\"num\">{r.tokens:,}</td>"
        f"<td class=\"num\">{r.round_s:.1f}</td><td class=\"num\">{_num(r.utilisation, '{:.0%}')}</td>"
        f"<td class=\"num\">{_num(r.loss_end)}</td><td class=\"num\">{_num(r.max_vio)}</td>"
        f"<td class=\"num\">{_num(r.dead_experts, '{}')}</td><td>{escape(r.finished_at)}</td></tr>"
        for r in snap.rounds)
    return f"<h3>Rounds</h3><table id=\"rounds\"><thead>{head}</thead><tbody>{rows}</tbody></table>"
