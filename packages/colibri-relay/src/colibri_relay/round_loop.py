"""The loop every parallel worker runs: train a round, post once, and merge when holding the lease.

    worker = RoundWorker(RoundRelay(relay), slot=0, train=my_train, merge=my_merge, work_dir="w/")
    worker.run(until_round=100)

Each pass: read round R (the merger reads its own lease commit; others read the head, which may
lag), pull the base, `train(view, base_dir, out_dir)` -> summary, post it once. Then try the lease
without waiting (`claim(wait=False)`: the watch of a silent holder adds up across passes, so a dead
merger is taken over after its lease + margin, as for legs). The holder merges: it waits until every
slot has contributed or until `round_s` after it first saw the round (its own monotonic clock),
closes the round in the companion repo (after which nothing can land for it), fetches what the
close names, rejects what does not verify or was trained on another base, calls `merge(...)` for
the new base and commits it (rounds.py). The others poll until the round moves on.

The relay stays tensor-free: `train` and `merge` are the caller's (the app's torch code, or the
chaos test's integers); contributions and bases are opaque directories of files here.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .contribution import Ack, ClosedRound, ContributionMeta, close_round, fetch_contribution, read_slots
from .errors import (
    ChecksumMismatch,
    FileNotFoundInStore,
    LeaseHeld,
    LeaseLost,
    RelayError,
    RelayFileCorrupt,
    RoundClosed,
    SlotTaken,
    StoreError,
)
from .lease import log
from .payload import pull_payload
from .relay import Leg
from .round_state import ContributionRecord, Rejection, RoundEntry, RoundsConfig
from .rounds import RoundRelay, RoundView, payload_digest


@dataclass
class MergeInput:
    """What `merge` gets: the base, the verified contributions on it (slot order), where to write."""

    round: int
    rounds: RoundsConfig
    base_dir: Path
    contributions: list[tuple[ContributionMeta, Path]]  # slot order
    out_dir: Path


@dataclass
class MergeOutput:
    """`merge`'s answer: slots it refused (slot -> why: "failed check") and a report for the ledger."""

    failed: dict[int, str] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


TrainFn = Callable[[RoundView, Path, Path], dict]  # (view, base_dir, out_dir) -> summary
MergeFn = Callable[[MergeInput], MergeOutput]


@dataclass
class WorkerReport:
    acks: list[Ack] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    merged: list[int] = field(default_factory=list)  # rounds this worker merged
    train_s: float = 0.0


class RoundWorker:
    """One worker slot of a parallel run (see the module docstring)."""

    def __init__(self, rounds: RoundRelay, *, slot: int, train: TrainFn, merge: MergeFn, work_dir: str | Path,
                 poll_s: float = 1.0, on_ack: Callable[[Ack], None] | None = None,
                 say: Callable[[str], None] | None = None):
        self.rounds, self.relay = rounds, rounds.relay
        self.slot, self.train, self.merge = slot, train, merge
        self.work = Path(work_dir)
        self.poll_s = poll_s
        self.on_ack = on_ack
        self.say = say or (lambda msg: log.info("%s", msg))
        self.leg: Leg | None = None
        self.first_seen: dict[int, float] = {}
        self.done: set[int] = set()
        self.verified_heads: set[str] = set()  # lease heads whose base tree verified
        self.report = WorkerReport()

    # --- the loop ------------------------------------------------------------------------------
    def run(self, until_round: int) -> WorkerReport:
        """Work until the run has merged rounds 0..until_round-1. Releases the lease at the end."""
        try:
            while True:
                view = self._view()
                if view.round >= until_round:
                    return self.report
                self.first_seen.setdefault(view.round, time.monotonic())
                if view.round not in self.done:
                    self._contribute(view)
                    continue  # read again: the merger may have moved on while we trained
                self._try_lease()
                if self.leg is not None:
                    self._merge_duty()
                else:
                    time.sleep(self.poll_s)
        finally:
            if self.leg is not None:
                try:
                    self.leg.release()
                except RelayError as exc:
                    log.warning("release failed (the lease will lapse by itself): %s", exc)

    def _view(self) -> RoundView:
        if self.leg is not None:
            try:
                self.leg.check()
                return self.rounds.lease_view(self.leg)
            except LeaseLost as exc:
                self.say(f"[{self.relay.holder}] merger lease lost: {exc}")
                self.leg = None
        return self.rounds.view()

    def _try_lease(self) -> None:
        if self.leg is not None:
            return
        try:
            self.leg = self.relay.claim(wait=False)
            self.say(f"[{self.relay.holder}] holds the merger lease (epoch {self.leg.state.epoch})")
        except LeaseHeld:
            pass
        except StoreError as exc:
            log.info("claim failed, trying again next pass: %s", exc)

    def _contribute(self, view: RoundView) -> None:
        r = view.round
        base, out = self.work / "base", self.work / f"out-{r}"
        try:
            self.rounds.pull_base(view, base)
        except (ChecksumMismatch, FileNotFoundInStore) as exc:
            # the base's merge landed without a file and its merger died before re-uploading it:
            # the lease holder rebuilds it (_heal_base); take the lease if it is free, else wait
            self.say(f"[{self.relay.holder}] round {r}'s base does not verify ({exc}); waiting for its repair")
            self._try_lease()
            if self.leg is not None:
                try:
                    self._heal_base(self.leg, self.rounds.lease_view(self.leg))
                except LeaseLost as lost:
                    self.say(f"[{self.relay.holder}] merger lease lost: {lost}")
                    self.leg = None
            else:
                time.sleep(self.poll_s)
            return
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t0 = time.monotonic()
        summary = dict(self.train(view, base, out))
        summary.setdefault("train_s", time.monotonic() - t0)
        self.report.train_s += summary["train_s"]
        try:
            ack = self.rounds.post(view, slot=self.slot, worker=self.relay.holder, src_dir=out, summary=summary)
        except SlotTaken as exc:
            if exc.worker != self.relay.holder:
                raise
            self.say(f"[{self.relay.holder}] round {r}: slot {self.slot} holds our earlier run's contribution")
        except RoundClosed:
            self.say(f"[{self.relay.holder}] round {r} closed before our contribution landed (late); next round")
            self.report.late.append(r)
        else:
            self.report.acks.append(ack)
            if self.on_ack is not None:
                self.on_ack(ack)
            self.say(f"[{self.relay.holder}] contributed to round {r} (slot {self.slot}, {ack.commit[:12]})")
        finally:
            shutil.rmtree(out, ignore_errors=True)
        self.done.add(r)

    # --- the merger ----------------------------------------------------------------------------
    def _merge_duty(self) -> None:
        leg = self.leg
        if leg is None:
            return
        try:
            view = self.rounds.lease_view(leg)
            r = view.round
            self._heal_base(leg, view)
            if r not in self.done:
                return  # the lease's round is newer than our last read: train it first
            companion = self.rounds.companion(view.rounds)
            seen = self.first_seen.setdefault(r, time.monotonic())
            deadline, earliest = seen + view.rounds.round_s, seen + view.rounds.min_round_s
            while time.monotonic() < deadline:
                leg.check()
                slots, is_closed, _ = read_slots(companion, r, companion.head())
                if is_closed or (len(slots) >= view.rounds.workers and time.monotonic() >= earliest):
                    break
                time.sleep(self.poll_s)
            leg.check()
            closed, close_commit = close_round(companion, r, self.relay.holder)
            entry = self._merge(leg, view, closed, close_commit)
            self.report.merged.append(r)
            self.say(f"[{self.relay.holder}] merged round {r}: {len(entry.contributions)} contributions, "
                     f"{len(entry.rejected)} rejected")
        except LeaseLost as exc:
            self.say(f"[{self.relay.holder}] merger lease lost: {exc}")
            self.leg = None

    def _heal_base(self, leg: Leg, view: RoundView) -> None:
        """A merge commit can land without one of its files (the Hub's dropped file); its merger
        uploads it again right after, but a merger killed in between leaves a base nobody can pull,
        and the run would stop there. The next lease holder rebuilds that merge from the ledger
        (the base before it, the contributions it names at their close) with the same merge
        function, and uploads what the tree lacks. Checked once per head."""
        if view.head in self.verified_heads or view.round == 0:
            return
        if self.rounds.base_problems(view):
            entry = self.rounds.ledger(view.head)[-1]
            self.say(f"[{self.relay.holder}] round {entry.round}'s base lacks files: rebuilding its merge")
            base, fetched, out = self.work / "heal-base", self.work / "heal-in", self.work / "heal-out"
            for d in (base, fetched, out):
                shutil.rmtree(d, ignore_errors=True)
            out.mkdir(parents=True)
            before = self.rounds.relay.read_state(entry.base_commit)
            pull_payload(self.rounds.relay.store, entry.base_commit, before.payload, base)
            companion = self.rounds.companion(view.rounds)
            accepted = [fetch_contribution(companion, entry.close_commit, entry.round, c.slot, fetched)
                        for c in entry.contributions]
            if accepted:
                self.merge(MergeInput(entry.round, view.rounds, base, accepted, out))
            else:
                shutil.rmtree(out)
                shutil.copytree(base, out, ignore=shutil.ignore_patterns(".*"))
            self.rounds.reupload_base(leg, out)
            for d in (base, fetched, out):
                shutil.rmtree(d, ignore_errors=True)
            view = self.rounds.lease_view(leg)
        self.verified_heads.add(view.head)

    def _merge(self, leg: Leg, view: RoundView, closed: ClosedRound, close_commit: str) -> RoundEntry:
        r = view.round
        companion = self.rounds.companion(view.rounds)
        base, fetched, out = self.work / "merge-base", self.work / "merge-in", self.work / "merge-out"
        for d in (fetched, out):
            shutil.rmtree(d, ignore_errors=True)
        out.mkdir(parents=True)
        self.rounds.pull_base(view, base)
        digest = payload_digest(view.state.payload)
        accepted: list[tuple[ContributionMeta, Path]] = []
        rejected: list[Rejection] = []
        for slot in closed.contributions:
            if slot.problem:
                rejected.append(Rejection(slot=slot.slot, reason="corrupt", detail=slot.problem[:300]))
                continue
            try:
                meta, path = fetch_contribution(companion, close_commit, r, slot.slot, fetched)
            except (RelayFileCorrupt, StoreError) as exc:
                rejected.append(Rejection(slot=slot.slot, worker=slot.worker, nonce=slot.nonce, reason="corrupt",
                                          detail=str(exc)[:300]))
                continue
            if meta.base_digest != digest:
                rejected.append(Rejection(slot=slot.slot, worker=meta.worker, nonce=meta.nonce, reason="stale base",
                                          detail=f"trained on {meta.base_commit[:12]} (digest {meta.base_digest[:12]}), "
                                                 f"round {r}'s base is {digest[:12]}"))
                continue
            accepted.append((meta, path))
        if accepted:
            result = self.merge(MergeInput(r, view.rounds, base, accepted, out))
        else:  # nothing to merge: the next round starts from the same base
            shutil.rmtree(out)
            shutil.copytree(base, out, ignore=shutil.ignore_patterns(".*"))
            result = MergeOutput(stats={"empty": True})
        merged = []
        for meta, _path in accepted:
            if meta.slot in result.failed:
                rejected.append(Rejection(slot=meta.slot, worker=meta.worker, nonce=meta.nonce, reason="failed check",
                                          detail=result.failed[meta.slot][:300]))
                continue
            s = meta.summary
            merged.append(ContributionRecord(
                slot=meta.slot, worker=meta.worker, nonce=meta.nonce, base_commit=meta.base_commit,
                data_slice=s.get("data_slice", {}), inner_steps=int(s.get("inner_steps", 0)),
                tokens=int(s.get("tokens", 0)), loss_start=s.get("loss_start"), loss_end=s.get("loss_end"),
                train_s=float(s.get("train_s", 0.0)), bytes=sum(f.size for f in meta.files.values())))
        round_s = time.monotonic() - self.first_seen[r]
        util = (sum(c.train_s for c in merged) / len(merged) / round_s) if merged and round_s > 0 else None
        entry = RoundEntry(round=r, merger=self.relay.holder, lease_id=str(leg.state.lease_id),
                           epoch=leg.state.epoch, base_commit=view.head, base_digest=digest, close_commit=close_commit,
                           contributions=merged, rejected=sorted(rejected, key=lambda x: x.slot),
                           tokens=sum(c.tokens for c in merged), round_s=round_s,
                           utilisation=None if util is None else min(util, 1.0), stats=result.stats)
        self.rounds.merge(leg, closed, entry, out)
        for d in (fetched, out):
            shutil.rmtree(d, ignore_errors=True)
        return entry


__all__ = ["MergeInput", "MergeOutput", "RoundWorker", "WorkerReport", "TrainFn", "MergeFn"]
