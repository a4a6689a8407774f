"""The dashboard's data: one `Snapshot` per read, served as JSON and rendered as HTML (schema: DASHBOARD.md).

A snapshot is a pydantic model with `dashboard_version`, because scripts may poll the JSON
endpoint; readers should refuse an unknown MAJOR version. Everything in it was read at ONE pinned
revision of the store (`source.revision`), plus the optional live run directory. It never holds a
token, a lease id or anything else that would let a reader act on the relay.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

DASHBOARD_VERSION = "1.1"

# The estimate note is part of the data (not only the page) so JSON consumers see it too.
LEASE_ESTIMATE_NOTE = (
    "Estimate: lease remaining = lease duration minus the time since the commit of the holder's last "
    "renewal, using the store's commit timestamp and this machine's clock. The holder does not share "
    "its clock; it fences itself earlier, and a claimant waits longer, on their own monotonic clocks."
)


class SourceInfo(BaseModel):
    store: str = Field(description="store spec: hf://OWNER/REPO or a LocalStore path")
    store_kind: Literal["hub", "local"]
    revision: str | None = Field(None, description="the full commit sha every store read was pinned to")
    revision_time: str | None = Field(None, description="commit timestamp of `revision` (store clock)")
    read_at: str = Field(description="when this snapshot was read (this machine's clock, UTC)")
    metrics_path: str | None = Field(None, description="path of the metrics file inside the payload")
    run_dir: str | None = Field(None, description="the live local run directory, when given")


class BatonInfo(BaseModel):
    status: Literal["free", "held", "lapsed"]
    holder: str | None
    epoch: int
    seq: int
    legs_pushed: int
    current_leg: int | None = Field(None, description="the leg being trained (legs_pushed + 1) while held")
    lease_duration_s: float
    heartbeat_s: float
    last_renewal_commit: str | None = None
    last_renewal_time: str | None = Field(None, description="commit timestamp of the holder's last write")
    lease_remaining_s_estimate: float | None = None
    estimate_note: str = LEASE_ESTIMATE_NOTE
    updated_at: str = Field("", description="the writer's own clock, from RELAY.json (display only)")


class LedgerRow(BaseModel):
    leg: int
    holder: str
    started_at: str
    finished_at: str
    steps: int
    tokens: int
    hours: float
    hardware: str
    loss_start: float | None
    loss_end: float | None
    commit: str | None = Field(None, description="the commit tagged leg-N (the leg's pushed payload)")
    base_commit: str
    notes: str = ""


class LegSpan(BaseModel):
    """Where a leg sits on the step axis: its metrics are the steps in (previous last_step, last_step]."""

    leg: int
    label: str
    first_step: float | None = None
    last_step: float | None = None
    points: int = 0
    commit: str | None = None
    live: bool = False


class Series(BaseModel):
    name: str
    steps: list[float]
    values: list[float]
    total_points: int = Field(description="points before downsampling for display")


class LegAggregate(BaseModel):
    """One leg on the leg axis: the ledger's numbers plus means/lasts over its metrics."""

    leg: int
    label: str
    loss_start: float | None = None
    loss_end: float | None = None
    val_loss: float | None = Field(None, description="last val_loss measured in the leg")
    tokens_per_s: float | None = Field(None, description="mean over the leg's logged steps")
    mfu: float | None = Field(None, description="mean over the leg's logged steps")
    hours: float | None = None
    tokens: int | None = None


class MoEView(BaseModel):
    heatmap_step: float = Field(description="the step whose router stats the heatmap shows (the latest)")
    layers: list[int]
    load_share: list[list[float]] = Field(description="layers x experts, share of routed slots (rows sum to 1)")
    max_vio: dict[str, Series] = Field(description="per layer ('L0', ...): max load / mean load - 1")
    dead_experts: Series = Field(description="dead experts summed over layers")


class RoundRow(BaseModel):
    """One merged round of a parallel run (ROUNDS.md's round ledger)."""

    round: int
    merger: str
    workers: int
    rejected: int
    tokens: int
    round_s: float
    utilisation: float | None = None
    loss_end: float | None = None
    max_vio: float | None = None
    dead_experts: int | None = None
    base_commit: str = ""
    finished_at: str = ""


class Snapshot(BaseModel):
    dashboard_version: str = DASHBOARD_VERSION
    source: SourceInfo
    baton: BatonInfo | None = None
    ledger: list[LedgerRow] = Field(default_factory=list, description="newest leg first")
    legs: list[LegSpan] = Field(default_factory=list, description="oldest first; the live leg last")
    series: dict[str, Series] = Field(default_factory=dict, description="every numeric metrics field over steps")
    per_leg: list[LegAggregate] = Field(default_factory=list)
    moe: MoEView | None = None
    rounds: list[RoundRow] = Field(default_factory=list, description="parallel runs: newest round first")
    problems: list[str] = Field(default_factory=list, description="what is missing or could not be read")
    error: str | None = Field(None, description="set when the store could not be read at all this time")
