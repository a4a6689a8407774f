"""Shared fixtures: the fake Hub plugin, and `store` parametrized over both store kinds."""

import os

os.environ["HF_HUB_DISABLE_XET"] = "1"  # before huggingface_hub is imported anywhere
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import colibri_relay.testing.pytest_plugin as fake_hub_plugin  # noqa: E402
import pytest  # noqa: E402
from colibri_relay import LocalStore  # noqa: E402


@pytest.fixture(params=["local", "hub"])
def store(request, tmp_path):
    """A fresh, created RelayStore of each kind: the store tests run against both."""
    if request.param == "local":
        s = LocalStore(tmp_path / "store", lock_timeout_s=2.0)
        s.create()
        return s
    return request.getfixturevalue("hub_store")


def pytest_configure(config):
    # `fake_hub` and `hub_store` come from the pytest11 entry point that installing colibri-relay
    # registers (editable or wheel). Load the plugin here only when autoloading is off
    # (PYTEST_DISABLE_PLUGIN_AUTOLOAD): registering it twice is an error, and `pytest_plugins = [...]`
    # is refused in a conftest that is not top-level, as this one is under `make test`.
    if not config.pluginmanager.is_registered(fake_hub_plugin):
        config.pluginmanager.register(fake_hub_plugin, fake_hub_plugin.__name__)
    # The unmodified huggingface_hub client streams LFS uploads with a call httpx2 deprecates.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:httpx2")
