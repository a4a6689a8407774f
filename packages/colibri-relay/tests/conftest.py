"""Shared fixtures: the fake Hub plugin, and `store` parametrized over both store kinds."""

import os

os.environ["HF_HUB_DISABLE_XET"] = "1"  # before huggingface_hub is imported anywhere
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
from colibri_relay import LocalStore  # noqa: E402

# Imported rather than `pytest_plugins = [...]`: pytest refuses pytest_plugins in a conftest that is
# not top-level, which this one is when `make test` collects every package at once.
from colibri_relay.testing.pytest_plugin import _fake_hub_session, fake_hub, hub_store  # noqa: E402, F401


@pytest.fixture(params=["local", "hub"])
def store(request, tmp_path):
    """A fresh, created RelayStore of each kind: the store tests run against both."""
    if request.param == "local":
        s = LocalStore(tmp_path / "store", lock_timeout_s=2.0)
        s.create()
        return s
    return request.getfixturevalue("hub_store")


def pytest_configure(config):
    # The unmodified huggingface_hub client streams LFS uploads with a call httpx2 deprecates.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:httpx2")
