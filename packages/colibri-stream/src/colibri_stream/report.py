"""The versioned JSON that crosses the package boundary: `colibri-stream generate --json`.

`GenerateReport` (pydantic) is what the CLI prints and what benchmarks and other packages read
back; `StatsReport` is its `stats` member (the engine's `StreamStats.to_dict()`), built from
the declaration in stats.py rather than written out again. Both carry a version;
`read_generate_report` refuses an unknown major version naming both. STATS.md beside this file
specifies every field.
"""

from __future__ import annotations

import json
import types

from colibri_spec import require_major
from pydantic import BaseModel, ConfigDict, create_model, model_validator

from .errors import ReportVersionError
from .stats import STATS_VERSION, StreamStats, report_fields

REPORT_VERSION = "1.1"


def _check_major(kind: str, found: str, known: str) -> None:
    require_major(None if found == "?" else found, known, key=f"{kind}_version", where=f"{kind}", reader="colibri-stream",
                  error=ReportVersionError)


def _stats_fields() -> dict:
    """The reader's fields, from the writer's declaration (stats.py `report_fields`): a key
    the first stats version had is required; one a later minor added defaults to empty (None
    where the key may be null), so an older report still reads."""
    spec = {"stats_version": (str, ...)}
    for f in report_fields(StreamStats):
        if f.optional:
            default = None
        elif f.since == "1.0":
            default = ...
        else:
            default = None if isinstance(f.kind, types.UnionType) else f.kind()
        spec[f.key] = (f.kind, default)
    return spec


def _check_stats_version(cls, data):
    if isinstance(data, dict):
        _check_major("stats", data.get("stats_version", "?"), STATS_VERSION)
    return data


# `per_layer` entries read back as `LayerCounters` (pydantic validates the dataclass's fields
# and recomputes its reported properties), so they carry the same names as the live counters.
StatsReport = create_model(
    "StatsReport",
    __config__=ConfigDict(extra="allow"),  # minor versions may add fields
    __doc__="`StreamStats.to_dict()` read back (fields: STATS.md).",
    __validators__={"_version": model_validator(mode="before")(classmethod(_check_stats_version))},
    **_stats_fields(),
)


class BudgetReport(BaseModel):
    model_config = ConfigDict(extra="allow")

    ram_budget: int
    resident_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    staging_bytes: int
    tokenizer_bytes: int = 0  # absent from reports written before it was reported
    heap_slack_bytes: int = 0  # likewise; freed C heap held between trims (io/heap.py)
    slot_bytes: int
    cache_slots: int
    total_experts: int
    expert_bytes_on_disk: int
    compute: str
    io_mode: str
    experts_per_token: int = 0  # since report 1.1; 0 in 1.0 reports


class GenerateReport(BaseModel):
    model_config = ConfigDict(extra="allow")

    report_version: str = REPORT_VERSION
    text: str
    token_ids: list[int]
    prompt_tokens: int
    new_tokens: int
    finish_reason: str
    ttft_s: float
    decode_s: float
    tokens_per_s: float
    stats: StatsReport
    budget: BudgetReport

    @model_validator(mode="before")
    @classmethod
    def _version(cls, data):
        if isinstance(data, dict):
            _check_major("report", data.get("report_version", "?"), REPORT_VERSION)
        return data


def read_generate_report(text: str) -> GenerateReport:
    """Parse `colibri-stream generate --json` output; `ReportVersionError` for an unknown major
    version (checked before the schema, so the error names the versions, not a missing field)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a generate report must be a JSON object")
    _check_major("report", data.get("report_version", "?"), REPORT_VERSION)
    stats = data.get("stats")
    if isinstance(stats, dict):
        _check_major("stats", stats.get("stats_version", "?"), STATS_VERSION)
    return GenerateReport.model_validate(data)
