"""`open_store(spec)`: the store a spec names, `hf://OWNER/REPO` (HubStore) or a directory (LocalStore).

Kept apart from the interface (store.py), which both stores import: the interface knows no
implementation, and this module is the one place that knows them all. Each store is imported only
when its spec is opened (importing huggingface_hub costs about a second).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import StoreSpecError
from .store import RelayStore

_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def open_store(spec: str, *, token: str | None = None) -> RelayStore:
    """`hf://OWNER/REPO` (endpoint from HF_ENDPOINT) -> HubStore; anything else is a LocalStore path.

    >>> store = open_store("/tmp/my-relay")   # doctest: +SKIP
    """
    if not spec:
        raise StoreSpecError("empty store spec: use hf://OWNER/REPO or a directory path")
    if spec.startswith("hf://"):
        repo_id = spec[len("hf://"):].strip("/")
        if not _HUB_REPO_ID.match(repo_id):
            raise StoreSpecError(f"bad Hub store spec {spec!r}: expected hf://OWNER/REPO")
        from .hub import HubStore

        return HubStore(repo_id, endpoint=os.environ.get("HF_ENDPOINT"), token=token)
    if "://" in spec:
        raise StoreSpecError(f"unknown store scheme in {spec!r}: use hf://OWNER/REPO or a directory path")
    from .local_store import LocalStore

    return LocalStore(Path(spec))


__all__ = ["open_store"]
