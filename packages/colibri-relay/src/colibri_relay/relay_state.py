"""RELAY.json: the lease, as a versioned pydantic schema (spec: RELAY.md).

The file lives at the repo root and is rewritten by every relay write (claim, heartbeat, push,
release). Readers refuse an unknown MAJOR `relay_version` with an error naming both versions, and
a file that does not parse or validate with one line naming the file, the revision and the problem.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import Literal

from colibri_spec import require_major
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import FileNotFoundInStore, NotInitialized, RelayFileCorrupt, SchemaVersionError
from .store import RelayStore

RELAY_FILE = "RELAY.json"
RELAY_VERSION = "1.0"  # sequential legs (the baton passes from one trainer to the next)
# Parallel rounds (ROUNDS.md): the same lease, plus a `rounds` section. A reader that knows only
# 1.x refuses it by its MAJOR, so an old client can never push a leg into a parallel run.
PARALLEL_RELAY_VERSION = "2.0"
SUPPORTED_RELAY_VERSIONS = (RELAY_VERSION, PARALLEL_RELAY_VERSION)


class PayloadFile(BaseModel):
    """One payload file: its checksum and size, checked on every pull."""

    model_config = ConfigDict(extra="forbid")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class RelayState(BaseModel):
    """The lease and the relay's position. `seq` grows by one per write, `epoch` by one per claim."""

    model_config = ConfigDict(extra="allow")
    relay_version: str = RELAY_VERSION
    status: Literal["free", "held"] = "free"
    epoch: int = Field(0, ge=0)
    seq: int = Field(0, ge=0)
    lease_id: str | None = None
    holder: str | None = None
    lease_duration_s: float = Field(1200.0, gt=0)
    heartbeat_s: float = Field(300.0, gt=0)
    nonce: str = ""
    leg: int = Field(0, ge=0, description="number of legs pushed so far; the next leg is leg + 1")
    leg_commit: str | None = Field(
        None, description="commit that pushed `leg`; null in that very commit (it cannot name itself)"
    )
    payload: dict[str, PayloadFile] = Field(default_factory=dict)
    updated_at: str = Field("", description="writer's wall clock, display only")

    def next_write(self, **changes) -> RelayState:
        """A copy for the next write: seq + 1, a fresh nonce, a fresh display time."""
        data = self.model_dump()
        data.update(changes)
        data["seq"] = self.seq + 1
        data["nonce"] = secrets.token_hex(8)
        data["updated_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return RelayState.model_validate(data)

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n").encode()


def check_major(found: object, supported: str | tuple[str, ...], what: str, where: str) -> None:
    """Refuse a version whose MAJOR is none of `supported`'s, naming both."""
    versions = (supported,) if isinstance(supported, str) else tuple(supported)
    if not isinstance(found, str) or not found.split(".")[0].isdigit():
        raise RelayFileCorrupt(f"{where}: {what} {found!r} is not a version string like {versions[0]!r}")
    if found.split(".")[0] in {v.split(".")[0] for v in versions}:
        return
    # one message shape for every version check (colibri-spec), naming all the majors read here
    require_major(found, versions[0], key=what, where=where, reader="colibri-relay", error=SchemaVersionError,
                  known_text=", ".join(versions))


def is_parallel(state: RelayState) -> bool:
    """Whether RELAY.json describes a run of parallel rounds (relay_version 2.x)."""
    return state.relay_version.split(".")[0] == PARALLEL_RELAY_VERSION.split(".")[0]


def parse_versioned_object(raw: bytes, where: str, model: type[BaseModel], key: str,
                           supported: str | tuple[str, ...]):
    """One JSON object of `model` whose `key` has a major of `supported`; one error naming `where`
    (and the field) otherwise."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RelayFileCorrupt(f"{where}: not valid JSON ({exc}); {len(raw)} bytes, possibly truncated") from None
    if not isinstance(data, dict):
        raise RelayFileCorrupt(f"{where}: expected a JSON object, got {type(data).__name__}")
    check_major(data.get(key), supported, key, where)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise RelayFileCorrupt(f"{where}: field {loc!r}: {first['msg']}") from None


def parse_relay_state(raw: bytes, where: str) -> RelayState:
    """Parse RELAY.json bytes; `where` (e.g. 'hf://me/run@abc123 RELAY.json') goes into errors."""
    return parse_versioned_object(raw, where, RelayState, "relay_version", SUPPORTED_RELAY_VERSIONS)


def read_relay_state(store: RelayStore, revision: str) -> RelayState:
    """RELAY.json of `store` at `revision`; NotInitialized (naming `colibri-relay init`) when the tree
    has none."""
    try:
        raw = store.read_file(RELAY_FILE, revision)
    except FileNotFoundInStore:
        raise NotInitialized(f"{store.spec} has no {RELAY_FILE} at {revision[:12]}: run "
                             f"`colibri-relay init --store {store.spec}`") from None
    return parse_relay_state(raw, f"{store.spec}@{revision[:12]} {RELAY_FILE}")


def read_relay_status(store: RelayStore) -> tuple[str, RelayState]:
    """(head sha, RELAY.json at head)."""
    head = store.head()
    return head, read_relay_state(store, head)
