"""colibri-relay: turn-based training on one Hub repo, with a compare-and-swap lease.

Public API: `Relay` (init/status/claim/leg), `Leg` (pull/check/push/release), `LegSummary`,
`open_store` / `RelayStore` / `HubStore` / `LocalStore`, the typed errors, and the file schemas
`RelayState` (RELAY.json) and `LedgerEntry` (LEDGER.jsonl). See RELAY.md for the protocol.
Parallel rounds (ROUNDS.md): `RoundRelay`, `RoundWorker` (with `MergeInput` / `MergeOutput`),
`RoundsConfig`, `rounds_of`, `plan_rounds`, `is_parallel`, `pull_payload`.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

from .errors import (
    CasLost,
    ChecksumMismatch,
    CommitLockBusy,
    CommitNotVerified,
    FileNotFoundInStore,
    LeaseHeld,
    LeaseLost,
    ModeMismatch,
    NotInitialized,
    OutcomeUnknown,
    PathIgnored,
    PayloadError,
    PushNotVerified,
    RateLimited,
    RelayError,
    RelayFileCorrupt,
    RevisionNotFound,
    SchemaVersionError,
    StoreError,
    StoreNotFound,
    StoreSpecError,
    TagExists,
)
from .ledger import LedgerEntry, LegSummary
from .local_store import LocalStore
from .payload import pull_payload
from .relay import Leg, PushResult, Relay
from .relay_state import PayloadFile, RelayState, is_parallel
from .round_loop import MergeInput, MergeOutput, RoundWorker
from .round_plan import plan_rounds
from .round_state import RoundsConfig, rounds_of
from .rounds import RoundRelay
from .store import CommitRecord, CopyFile, DeleteFile, FileInfo, PutFile, RelayStore
from .stores import open_store

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-relay")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name == "HubStore":  # lazy: importing huggingface_hub costs ~1 s
        from .hub import HubStore

        return HubStore
    raise AttributeError(name)


__all__ = [
    "Relay", "Leg", "PushResult", "LegSummary", "LedgerEntry", "RelayState", "PayloadFile",
    "RelayStore", "LocalStore", "HubStore", "open_store", "PutFile", "DeleteFile", "CopyFile", "FileInfo", "CommitRecord",
    "RelayError", "StoreError", "StoreSpecError", "StoreNotFound", "RevisionNotFound", "FileNotFoundInStore",
    "CasLost", "CommitLockBusy", "RateLimited", "OutcomeUnknown", "TagExists", "ChecksumMismatch",
    "RelayFileCorrupt", "SchemaVersionError", "LeaseHeld", "LeaseLost", "NotInitialized", "PayloadError",
    "CommitNotVerified", "PathIgnored", "PushNotVerified",
    # parallel rounds (ROUNDS.md)
    "RoundRelay", "RoundWorker", "MergeInput", "MergeOutput", "RoundsConfig", "rounds_of", "plan_rounds",
    "is_parallel", "ModeMismatch", "pull_payload",
]
