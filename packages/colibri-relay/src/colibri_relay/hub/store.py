"""`HubStore`: the RelayStore interface on a Hugging Face Hub model repo, via the unmodified client.

The store is a facade over two collaborators that share one `HfApi`:

- reader.py      `HubReader`: head, trees, verified downloads, the commit listing, tags
- cas_commit.py  `HubCasCommit`: prepare, the one CAS commit on a named parent, the nonce look-up
                 after an unknown outcome, the checks of what landed (the rules are listed there)
- commit.py      relay operations as huggingface_hub ones; the check of a landed tree
- errors.py      what the Hub's error answers mean (429 waits, typed read failures)

Reads: downloads are pinned to a full sha and verified (sha256 for LFS files, the git blob sha1
for regular files) before they replace anything in the destination.

The token goes to the client's requests only; it is never printed or logged, and no repr shows it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from ..errors import StoreError, TagExists
from ..store import CommitRecord, FileInfo, Operation, RelayStore
from .cas_commit import HubCasCommit
from .reader import HubReader


class HubStore(RelayStore):
    """A relay store in the Hub model repo `repo_id`.

    >>> store = HubStore("me/my-run", endpoint="http://127.0.0.1:8123")   # doctest: +SKIP
    >>> store.create(); store.head()                                       # doctest: +SKIP

    Attributes:
        repo_id: OWNER/REPO.
        spec: `hf://OWNER/REPO`.
        api: the huggingface_hub client every request goes through.
    """

    def __init__(self, repo_id: str, *, endpoint: str | None = None, token: str | None = None,
                 api: HfApi | None = None):
        self.repo_id = repo_id
        self.spec = f"hf://{repo_id}"
        self.api = api or HfApi(endpoint=endpoint, token=token)
        self._reader = HubReader(self.api, repo_id, token=token)
        self._writer = HubCasCommit(self.api, self._reader)

    def __repr__(self) -> str:  # never show the token
        return f"HubStore({self.repo_id!r}, endpoint={self.api.endpoint!r})"

    # --- reads ---------------------------------------------------------------------------------
    def create(self) -> str:
        try:
            self.api.create_repo(self.repo_id, repo_type="model", exist_ok=True)
        except HfHubHTTPError as exc:
            raise self._reader.error(exc, "create repo") from None
        return self.head()

    def head(self) -> str:
        return self._reader.head()

    def list_files(self, revision: str) -> dict[str, FileInfo]:
        return self._reader.list_files(revision)

    def read_file(self, path: str, revision: str) -> bytes:
        return self._reader.read_file(path, revision)

    def download(self, paths: list[str], revision: str, dest_dir: Path) -> dict[str, Path]:
        return self._reader.download(paths, revision, dest_dir)

    def history(self, revision: str | None = None, *, stop_at: str | None = None) -> list[CommitRecord]:
        return self._reader.history(revision, stop_at=stop_at)

    # --- writes (cas_commit.py) ----------------------------------------------------------------
    def prepare(self, operations: Sequence[Operation]) -> None:
        self._writer.prepare(operations)

    def inline_bytes(self, operations: Sequence[Operation]) -> int:
        return self._writer.inline_bytes(operations)

    def commit(self, operations: Sequence[Operation], *, parent: str, message: str, nonce: str) -> str:
        return self._writer.commit(operations, parent=parent, message=message, nonce=nonce)

    # --- tags ----------------------------------------------------------------------------------
    def create_tag(self, tag: str, revision: str) -> None:
        """Create `tag`; done if it already points at `revision`. The Hub answers 409 both for an
        existing tag and while its ref lock is busy, and tag listings may be stale, so a 409 is
        re-read and retried: only a tag seen pointing ELSEWHERE is TagExists."""
        for attempt in range(6):
            try:
                self.api.create_tag(self.repo_id, tag=tag, revision=revision)
                return
            except HfHubHTTPError as exc:
                if exc.response is None or exc.response.status_code != 409:
                    raise self._reader.error(exc, f"create tag {tag}") from None
            try:
                target = self.list_tags().get(tag)
            except StoreError:
                target = None
            if target == revision:
                return
            if target is not None:
                raise TagExists(tag, target)
            time.sleep(0.1 * (attempt + 1))
        raise StoreError(f"{self.spec}: tag {tag} answered 409 six times and is not listed; try again later")

    def list_tags(self) -> dict[str, str]:
        return self._reader.list_tags()


__all__ = ["HubStore"]
