"""pytest fixtures: `fake_hub` (a running FakeHub, faults reset per test) and `hub_store` (a fresh
HubStore repo on it). Installing colibri-relay registers this module as a pytest plugin (a
`pytest11` entry point named after the module); with plugin autoloading off
(PYTEST_DISABLE_PLUGIN_AUTOLOAD), enable it with `-p colibri_relay.testing.pytest_plugin`."""

from __future__ import annotations

import itertools

import pytest

from . import FakeHub, disable_xet

_repo_counter = itertools.count()


@pytest.fixture(scope="session")
def _fake_hub_session(tmp_path_factory):
    disable_xet()
    hub = FakeHub(data_dir=tmp_path_factory.mktemp("fake-hub"), lfs_threshold=64 * 1024).start()
    yield hub
    hub.stop()


@pytest.fixture
def fake_hub(_fake_hub_session, monkeypatch):
    """A FakeHub on 127.0.0.1 (shared by the session; fault knobs reset for every test).
    HF_ENDPOINT points at it for the duration of the test."""
    from .faults import FaultKnobs

    _fake_hub_session.faults = FaultKnobs(seed=0)
    monkeypatch.setenv("HF_ENDPOINT", _fake_hub_session.endpoint)
    yield _fake_hub_session
    _fake_hub_session.faults = FaultKnobs(seed=0)


@pytest.fixture
def hub_store(fake_hub):
    """A HubStore on a new, created repo of the fake Hub."""
    from ..hub import HubStore

    store = HubStore(f"tester/repo-{next(_repo_counter)}", endpoint=fake_hub.endpoint, token="hf_fake_token")
    store.create()
    return store
