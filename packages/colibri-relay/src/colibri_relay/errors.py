"""Typed errors of colibri-relay: every failure a caller may want to handle has its own class.

Store errors map the Hub's HTTP answers onto what they mean for a compare-and-swap protocol:
412 -> `CasLost` (the branch head is not the parent you named), 409 -> `CommitLockBusy`
(retry the SAME parent), 429 -> `RateLimited` (wait `retry_after_s`), 5xx / timeout on a write ->
`OutcomeUnknown` (the commit may have landed: look for your nonce before doing anything else).
A commit that landed without what was sent (the Hub drops .gitignore'd and "unchanged" files
silently) is `CommitNotVerified`, carrying the landed sha; paths a store would drop are refused
up front with `PathIgnored`.
"""

from __future__ import annotations

from colibri_spec import VersionMismatchError


class RelayError(Exception):
    """Base class of every error this package raises on purpose.

    Attributes:
        exit_code: what `colibri-relay` (and the `colibri` app) exit with for it: 1 when the
            operation failed or a check failed (the baton is held, the lease was lost, a commit
            lost its race, a file failed its checksum), 2 for bad input (a malformed store spec,
            a path or repo that holds no store or no relay, an unknown revision, a bad payload
            directory): the subclasses below that the user fixes by changing the command.
    """

    exit_code = 1


# --- store level -------------------------------------------------------------------------------


class StoreError(RelayError):
    """A store could not do what was asked (base class)."""


class StoreSpecError(StoreError):
    """A store spec string (`hf://OWNER/REPO` or a path) is malformed."""

    exit_code = 2


class StoreNotFound(StoreError):
    """The repo / directory does not exist or holds no relay store."""

    exit_code = 2


class RevisionNotFound(StoreError):
    """The revision (sha or tag) does not exist in the store."""

    exit_code = 2


class FileNotFoundInStore(StoreError):
    """The file does not exist at the requested revision."""

    def __init__(self, path: str, revision: str):
        super().__init__(f"{path} does not exist at revision {revision}")
        self.path = path
        self.revision = revision


class CasLost(StoreError):
    """The branch head was not the expected parent: someone else wrote first (HTTP 412)."""


class CommitLockBusy(StoreError):
    """The repo's commit lock is held by another commit (HTTP 409): retry with the same parent."""


class RateLimited(StoreError):
    """The server refused because of rate limits (HTTP 429); wait `retry_after_s` seconds.

    A claim raises it, naming the wait, when the server asks for longer than the claim's timeout
    leaves (the Hub's commit quota asks for up to an hour): the baton was not taken, and nobody
    is known to hold it because of this answer.
    """

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutcomeUnknown(StoreError):
    """A write got no clear answer (5xx, timeout, dropped connection): it may have landed."""


class CommitNotVerified(StoreError):
    """The commit landed (`sha` is now the head) but its tree does not hold what was sent: the server
    dropped or changed a file. The writer still owns `sha` and must repair it."""

    def __init__(self, message: str, sha: str, problems: list[str]):
        super().__init__(message)
        self.sha = sha
        self.problems = problems


class PathIgnored(StoreError):
    """The store would silently leave these paths out of a commit (the Hub repo's .gitignore)."""

    exit_code = 2  # bad input: rename the files or change the repo's .gitignore

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths


class TagExists(StoreError):
    """The tag already exists (a second push of the same leg is refused here)."""

    def __init__(self, tag: str, target: str | None):
        super().__init__(f"tag {tag} already exists (points at {target})")
        self.tag = tag
        self.target = target


class ChecksumMismatch(StoreError):
    """A downloaded or stored file does not match its recorded checksum (corrupt or truncated)."""

    def __init__(self, path: str, where: str, expected: str, actual: str, size: int | None = None, hint: str = ""):
        msg = f"{path} at {where}: checksum mismatch (expected {expected}, got {actual}"
        msg += f", {size} bytes)" if size is not None else ")"
        super().__init__(msg + (f"; {hint}" if hint else ""))
        self.path = path


# --- relay level -------------------------------------------------------------------------------


class RelayFileCorrupt(RelayError):
    """RELAY.json or LEDGER.jsonl cannot be parsed / validated. Nothing is written in that case."""


class SchemaVersionError(RelayFileCorrupt, VersionMismatchError):
    """A file declares a MAJOR schema version this reader does not know; the message and the
    `found` / `known` attributes name both versions."""


class LeaseHeld(RelayError):
    """The lease is held by someone else and has not (yet) expired from our point of view.

    Attributes (None when the baton was not watched, e.g. a forced release of another lease):
        holder: the holder RELAY.json names.
        lease_duration_s: the lease duration that holder declared.
        watched_s: how long this Relay has seen the holder's (epoch, seq) unchanged, over all its
            claims so far (a later claim on the same Relay continues the watch).
        takeover_after_s: how long it must stay unchanged for a takeover (lease + margin).
    """

    def __init__(self, message: str, *, holder: str | None = None, lease_duration_s: float | None = None,
                 watched_s: float | None = None, takeover_after_s: float | None = None):
        super().__init__(message)
        self.holder = holder
        self.lease_duration_s = lease_duration_s
        self.watched_s = watched_s
        self.takeover_after_s = takeover_after_s


class LeaseLost(RelayError):
    """We are fenced: our lease was taken over, or we could not renew it in time. Stop training."""


class NotInitialized(RelayError):
    """The store exists but holds no RELAY.json: run `colibri-relay init` first."""

    exit_code = 2


class PayloadError(RelayError):
    """The payload directory is unusable (reserved file name, not a directory, ignored by the store, ...)."""

    exit_code = 2


class PushNotVerified(RelayError):
    """Leg `leg`'s commit landed but did not hold the payload its manifest names; the relay's payload
    was rolled back to the last verified one (`restored_commit`). The lease is still held: push again."""

    def __init__(self, message: str, leg: int, commit: str, restored_commit: str | None):
        super().__init__(message)
        self.leg = leg
        self.commit = commit
        self.restored_commit = restored_commit


# --- parallel rounds (ROUNDS.md) ----------------------------------------------------------------


class ModeMismatch(RelayError):
    """A sequential leg on a run of parallel rounds, or a parallel worker on a sequential run: the two
    cannot mix in one run (RELAY.json's relay_version says which the run is)."""

    exit_code = 2


class RoundClosed(RelayError):
    """The round was closed (its CLOSED.json landed in the companion repo) before this contribution
    could land: it is late, nothing was written; train the next round from the new base.

    Attributes:
        round: the round that closed.
    """

    def __init__(self, message: str, round: int):
        super().__init__(message)
        self.round = round


class SlotTaken(RelayError):
    """Another contribution already landed for this (round, slot): two workers run with one slot, or
    an earlier run of this same worker posted it before it was stopped.

    Attributes:
        worker: the worker whose contribution holds the slot.
    """

    exit_code = 2

    def __init__(self, message: str, worker: str = ""):
        super().__init__(message)
        self.worker = worker


class RoundPlanError(RelayError):
    """A round configuration (workers, round length, heartbeat) would exceed the Hub's limits."""

    exit_code = 2
