"""The Hub store: the RelayStore interface on a Hugging Face Hub model repo (huggingface_hub, unmodified).

    store.py       HubStore: the facade the relay uses (reads, writes, tags)
    reader.py      HubReader: head, trees, verified downloads, the commit listing, tags
    cas_commit.py  HubCasCommit: prepare, the one CAS commit on a named parent, the nonce look-up,
                   the checks of what landed
    commit.py      relay operations as huggingface_hub ones, prepared once; the check of a landed tree
    errors.py      the Hub's error answers read once: a 429's wait, typed read failures

Importing this package imports huggingface_hub (about a second); `colibri_relay` itself does so only
when a HubStore is first asked for.
"""

from .store import HubStore

__all__ = ["HubStore"]
