"""`DashboardReader`: reads a relay (and optionally a live run) into a `Snapshot`, read-only.

One read pins the store's head sha first and reads everything else at that sha, so the baton,
the ledger and the metrics always agree with each other. It calls only the store's read methods
(`head`, `read_file`, `list_files`, `history`, `list_tags`): nothing here can write, claim or
release. Costs per refresh on the Hub: about six API calls, plus one download per leg whose
metrics were not read before (leg commits are immutable, so their parsed metrics are cached by
sha: a relay of 100 legs costs 100 downloads once, then nothing).

Where the metrics come from: leg N's are the metrics file in the payload at the commit tagged
`leg-N` (the latest leg may be read at the pinned revision if its tag is missing); its steps are
those after the previous leg's last step (steps count on across legs, as a resumed trainer's
do); a leg whose metrics restart from a low step with a different first line is a new history,
drawn after the previous leg and flagged. The live run's metrics.jsonl adds the steps after the last pushed leg.
Missing pieces become `problems` (shown on the page), never exceptions, except an unreachable
store, which raises its StoreError for the server to report.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from ..errors import FileNotFoundInStore, RelayError, RelayFileCorrupt, StoreError
from ..ledger import LEDGER_JSONL, LedgerEntry
from ..relay_state import RELAY_FILE, RelayState, check_major, is_parallel, parse_relay_state
from ..store import RelayStore
from .metrics_reader import METRICS_FILE, MetricsPoint, MetricsTail, ParsedMetrics, parse_metrics
from .series_builder import build_moe, build_per_leg, build_series
from .snapshot import BatonInfo, LedgerRow, LegSpan, Snapshot, SourceInfo

LEDGER_VERSION_SUPPORTED = "1.0"


def parse_time(stamp: str | None) -> datetime | None:
    """ISO 8601 (with 'Z' or an offset) -> aware datetime; None when absent or unreadable."""
    if not stamp:
        return None
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def parse_ledger_tolerant(raw: bytes, where: str) -> tuple[list[LedgerEntry], list[str]]:
    """Every valid LEDGER.jsonl line, plus one problem per line that is not (the relay's own parser
    stops at the first bad line; a dashboard should still show the rest)."""
    entries, problems = [], []
    for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise RelayFileCorrupt(f"{where} line {lineno}: not a JSON object")
            check_major(data.get("ledger_version"), LEDGER_VERSION_SUPPORTED, "ledger_version", f"{where} line {lineno}")
            entries.append(LedgerEntry.model_validate(data))
        except json.JSONDecodeError as exc:
            problems.append(f"{where} line {lineno}: not valid JSON ({exc.msg}); row not shown")
        except ValidationError as exc:
            first = exc.errors()[0]
            problems.append(f"{where} line {lineno}: field {'.'.join(map(str, first['loc']))!r}: {first['msg']}; "
                            "row not shown")
        except RelayFileCorrupt as exc:
            problems.append(f"{exc}; row not shown")
    return entries, problems


def signature(point: MetricsPoint) -> tuple:
    """What identifies a metrics history: its first line (step and numeric values)."""
    return point.step, tuple(sorted(point.values.items()))


def new_points_of_leg(points: list[MetricsPoint], after: float | None, prev_first: tuple | None,
                      label: str) -> tuple[list[MetricsPoint], list[str]]:
    """The points a leg adds, and notes for the page.

    Normally a leg's file holds the steps after `after` (the previous leg's last step), alone or
    after a copy of the earlier history (a cumulative file). A file with no step after `after`
    whose first line differs from the previous leg's is a NEW history (e.g. a trainer that counts
    steps from 0 in every leg, or a fresh SFT run): it is drawn after `after`, shifted, and the
    page says so. A file identical in its first line adds nothing (a leg pushed without training)."""
    if after is None or not points:
        return points, []
    new = [p for p in points if p.step > after]
    if new:
        return new, []
    if prev_first is not None and signature(points[0]) != prev_first:
        shift = after + 1 - points[0].step
        shifted = [MetricsPoint(step=p.step + shift, values=p.values, router=p.router, kind=p.kind) for p in points]
        return shifted, [f"{label}: its metrics restart at step {points[0].step:g} (a new run); drawn from step "
                         f"{after + 1:g} on"]
    return [], [f"{label}: its metrics add no step after step {after:g}" + (" yet" if label == "live run" else "")]


class DashboardReader:
    """Reads snapshots of one relay. `clock` (unix seconds) is injectable for tests.

    >>> reader = DashboardReader(open_store("/tmp/my-relay"), run_dir=None)   # doctest: +SKIP
    >>> reader.read().baton.status                                            # doctest: +SKIP
    'held'
    """

    def __init__(self, store: RelayStore, *, run_dir: Path | str | None = None, metrics_path: str | None = None,
                 clock=time.time):
        self.store = store
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.metrics_path = metrics_path
        self.clock = clock
        # (commit, path, after step, previous first line) -> (points, problems, first line), None if absent.
        self._leg_metrics: dict[tuple, tuple[list[MetricsPoint], list[str], tuple | None] | None] = {}
        self._tail: MetricsTail | None = None

    # --- pieces ------------------------------------------------------------------------------------
    def _read_state(self, revision: str, problems: list[str]) -> RelayState | None:
        where = f"{self.store.spec}@{revision[:12]} {RELAY_FILE}"
        try:
            return parse_relay_state(self.store.read_file(RELAY_FILE, revision), where)
        except FileNotFoundInStore:
            problems.append(f"{where} does not exist: the relay is not initialised "
                            f"(`colibri-relay init --store {self.store.spec}`)")
        except RelayFileCorrupt as exc:
            problems.append(f"baton unknown: {exc}")
        return None

    def _read_ledger(self, revision: str, problems: list[str]) -> list[LedgerEntry]:
        where = f"{self.store.spec}@{revision[:12]} {LEDGER_JSONL}"
        try:
            raw = self.store.read_file(LEDGER_JSONL, revision)
        except FileNotFoundInStore:
            problems.append(f"{where} does not exist: no ledger to show")
            return []
        entries, bad = parse_ledger_tolerant(raw, where)
        problems.extend(bad)
        return entries

    def _renewal(self, revision: str, state: RelayState, problems: list[str]) -> tuple[str | None, datetime | None]:
        """The commit that wrote the current RELAY.json (found by its nonce) and its timestamp."""
        try:
            records = self.store.history(revision, stop_at=revision)
            if not records or records[0].nonce != state.nonce:
                # The head is not a relay write (e.g. a README edit on the Hub): look further back.
                records = [r for r in self.store.history(revision) if r.nonce == state.nonce]
        except StoreError as exc:
            problems.append(f"commit history unreadable, lease time unknown: {exc}")
            return None, None
        if not records or records[0].nonce != state.nonce:
            problems.append(f"no commit carries RELAY.json's nonce {state.nonce}: lease time unknown")
            return None, None
        return records[0].sha, parse_time(records[0].timestamp)

    def _baton(self, revision: str, state: RelayState, problems: list[str]) -> BatonInfo:
        info = BatonInfo(status="free", holder=state.holder, epoch=state.epoch, seq=state.seq,
                         legs_pushed=state.leg, lease_duration_s=state.lease_duration_s,
                         heartbeat_s=state.heartbeat_s, updated_at=state.updated_at)
        if state.status != "held":
            return info
        info.status = "held"
        info.current_leg = state.leg + 1
        commit, when = self._renewal(revision, state, problems)
        info.last_renewal_commit = commit
        if when is not None:
            info.last_renewal_time = when.isoformat(timespec="seconds")
            remaining = state.lease_duration_s - (self.clock() - when.timestamp())
            info.lease_remaining_s_estimate = round(remaining, 1)
            if remaining <= 0:
                info.status = "lapsed"
        return info

    def _find_metrics_path(self, revision: str, problems: list[str]) -> str | None:
        if self.metrics_path:
            return self.metrics_path
        try:
            files = self.store.list_files(revision)
        except StoreError as exc:
            problems.append(f"cannot list the payload at {revision[:12]}: {exc}")
            return None
        found = sorted((p for p in files if PurePosixPath(p).name == METRICS_FILE),
                       key=lambda p: (p.count("/"), p))
        if len(found) > 1:
            problems.append(f"several metrics files in the payload ({', '.join(found)}); showing {found[0]} "
                            "(choose another with --metrics-path)")
        return found[0] if found else None

    def _leg_points(self, commit: str, path: str, leg: int, after: float | None, prev_first: tuple | None,
                    problems: list[str]) -> tuple[list[MetricsPoint], tuple | None]:
        """Leg `leg`'s new points (see `new_points_of_leg`) and its file's first-line signature.
        Cached per (commit, path, after, prev_first): a leg commit never changes, and a cumulative
        metrics file holds every earlier leg's steps too, of which only the new ones are kept."""
        key = (commit, path, after, prev_first)
        if key not in self._leg_metrics:
            where = f"leg {leg} {path}@{commit[:12]}"
            try:
                parsed = parse_metrics(self.store.read_file(path, commit), where)
            except FileNotFoundInStore:
                self._leg_metrics[key] = None
            except StoreError as exc:  # transient: do not cache, try again next refresh
                problems.append(f"leg {leg}: metrics unreadable this time ({exc})")
                return [], prev_first
            else:
                points, notes = new_points_of_leg(parsed.points, after, prev_first, f"leg {leg}")
                first = signature(parsed.points[0]) if parsed.points else prev_first
                self._leg_metrics[key] = (points, list(parsed.problems) + notes, first)
        cached = self._leg_metrics[key]
        if cached is None:
            problems.append(f"leg {leg}: no {path} in its payload ({commit[:12]})")
            return [], prev_first
        problems.extend(cached[1])
        return cached[0], cached[2]

    def _run_points(self, problems: list[str]) -> ParsedMetrics | None:
        assert self.run_dir is not None
        path = self.run_dir / METRICS_FILE
        if self._tail is None:
            self._tail = MetricsTail(path, f"live run {path}")
        try:
            parsed = self._tail.read()
        except FileNotFoundError:
            problems.append(f"live run: {path} does not exist yet")
            return None
        except OSError as exc:
            problems.append(f"live run: cannot read {path}: {exc.strerror}")
            return None
        problems.extend(parsed.problems)
        if parsed.incomplete_tail:
            problems.append(f"live run {path}: the last line is still being written; shown from the next refresh")
        return parsed

    # --- the whole snapshot ----------------------------------------------------------------------
    def read(self) -> Snapshot:
        """Read one snapshot. Raises StoreError (incl. StoreNotFound) if the store cannot be read."""
        problems: list[str] = []
        revision = self.store.head()
        source = SourceInfo(store=self.store.spec, store_kind="hub" if self.store.spec.startswith("hf://") else "local",
                            revision=revision, read_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            run_dir=str(self.run_dir) if self.run_dir else None)
        try:
            head_records = self.store.history(revision, stop_at=revision)
            source.revision_time = head_records[0].timestamp if head_records else None
        except StoreError:
            pass  # reported by _renewal when it matters
        state = self._read_state(revision, problems)
        if state is not None and is_parallel(state):  # rounds, not legs: its ledger has round entries
            from .rounds_view import read_round_rows

            rounds = read_round_rows(self.store, revision, problems)
            return Snapshot(source=source, baton=self._baton(revision, state, problems), rounds=rounds,
                            problems=problems)
        entries = self._read_ledger(revision, problems)
        baton = self._baton(revision, state, problems) if state else None
        try:
            tags = self.store.list_tags()
        except StoreError as exc:
            problems.append(f"tags unreadable, leg commits unknown: {exc}")
            tags = {}
        legs_pushed = state.leg if state else len(entries)
        if state and len(entries) != state.leg:
            problems.append(f"{LEDGER_JSONL} shows {len(entries)} legs but {RELAY_FILE} says {state.leg}")
        if legs_pushed == 0:
            problems.append("no legs pushed yet: nothing to chart from the store")

        source.metrics_path = self._find_metrics_path(revision, problems) if legs_pushed or self.metrics_path else None
        if legs_pushed and source.metrics_path is None:
            problems.append(f"no {METRICS_FILE} in the payload at {revision[:12]}: no charts from the store "
                            "(a payload without metrics is fine; pass --metrics-path if it is named differently)")
        leg_points: list[tuple[LegSpan, list[MetricsPoint]]] = []
        last_step: float | None = None
        prev_first: tuple | None = None
        for leg in range(1, legs_pushed + 1):
            commit = tags.get(f"leg-{leg}") or (revision if leg == legs_pushed else None)
            span = LegSpan(leg=leg, label=f"leg {leg}", commit=tags.get(f"leg-{leg}"))
            points: list[MetricsPoint] = []
            if commit is None:
                problems.append(f"leg {leg} has no tag leg-{leg}: its metrics are not shown")
            elif source.metrics_path:
                points, prev_first = self._leg_points(commit, source.metrics_path, leg, last_step, prev_first,
                                                      problems)
            self._close_span(span, points)
            last_step = span.last_step if span.last_step is not None else last_step
            leg_points.append((span, points))

        if self.run_dir is not None:
            parsed = self._run_points(problems)
            if parsed is not None:
                live = LegSpan(leg=legs_pushed + 1, label=f"leg {legs_pushed + 1} (live)", live=True)
                points, notes = new_points_of_leg(parsed.points, last_step, prev_first, "live run")
                problems.extend(notes)
                self._close_span(live, points)
                leg_points.append((live, points))

        tag_of = {leg: tags.get(f"leg-{leg}") for leg in range(1, legs_pushed + 1)}
        ledger = [LedgerRow(leg=e.leg, holder=e.holder, started_at=e.started_at, finished_at=e.finished_at,
                            steps=e.steps, tokens=e.tokens, hours=e.hours, hardware=e.hardware,
                            loss_start=e.loss_start, loss_end=e.loss_end, commit=tag_of.get(e.leg),
                            base_commit=e.base_commit, notes=e.notes)
                  for e in sorted(entries, key=lambda e: e.leg, reverse=True)]
        return Snapshot(source=source, baton=baton, ledger=ledger, legs=[span for span, _ in leg_points],
                        series=build_series(leg_points), per_leg=build_per_leg(leg_points, entries),
                        moe=build_moe(leg_points), problems=problems)

    @staticmethod
    def _close_span(span: LegSpan, points: list[MetricsPoint]) -> None:
        span.points = len(points)
        if points:
            span.first_step, span.last_step = points[0].step, points[-1].step


def read_snapshot_or_error(reader: DashboardReader) -> Snapshot:
    """A snapshot, or an empty one whose `error` says why the store could not be read."""
    try:
        return reader.read()
    except RelayError as exc:
        return Snapshot(source=SourceInfo(store=reader.store.spec,
                                          store_kind="hub" if reader.store.spec.startswith("hf://") else "local",
                                          read_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                          run_dir=str(reader.run_dir) if reader.run_dir else None),
                        error=f"cannot read the store: {exc}")
