"""Test helpers for relays, shipped with the package (the way moto ships for AWS).

* `FakeHub` - a loopback Hub server for the unmodified huggingface_hub client (HF_HUB_DISABLE_XET=1);
* `FaultKnobs` - its fault injection (dropped replies, 500/409/429, stale head reads, latency);
* `disable_xet()` - make an already-imported huggingface_hub use the legacy LFS path;
* pytest fixtures `fake_hub` and `hub_store` in `colibri_relay.testing.pytest_plugin`
  (a pytest plugin that installing colibri-relay registers: nothing to add to conftest.py).
"""

from __future__ import annotations

import os

from .fake_hub import FakeHub
from .faults import FaultKnobs


def disable_xet() -> None:
    """The fake Hub speaks LFS only: switch Xet off, also if huggingface_hub is already imported."""
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from huggingface_hub import constants

        constants.HF_HUB_DISABLE_XET = True
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        pass


__all__ = ["FakeHub", "FaultKnobs", "disable_xet"]
