"""The dashboard's HTTP server and CLI: GET-only routes, the JSON endpoint, loopback-only Host
check, stale snapshots on store errors, and the `colibri-relay dashboard` command end to end."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from colibri_relay import LocalStore
from colibri_relay.cli import main
from colibri_relay.dashboard import DASHBOARD_VERSION, DashboardReader, DashboardServer
from colibri_relay.dashboard.sample_relay import build_sample_relay


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return build_sample_relay(tmp_path_factory.mktemp("relay"), legs=2, steps_per_leg=10, live_steps=4)


@pytest.fixture
def server(sample):
    srv = DashboardServer(DashboardReader(LocalStore(sample.store_path), run_dir=sample.run_dir), port=0,
                          min_interval_s=0).start()
    yield srv
    srv.stop()


def request(server, method: str, path: str, host: str | None = None) -> tuple[int, dict, bytes]:
    h, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(h, port, timeout=10)
    headers = {"Host": host} if host else {}
    conn.request(method, path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


def test_page_and_json_endpoint_serve_the_same_snapshot(server, sample):
    status, headers, body = request(server, "GET", "/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src" not in headers["Content-Security-Policy"] and "default-src 'none'" in \
        headers["Content-Security-Policy"]
    assert '<meta http-equiv="refresh" content="30">' in page
    assert "carol@h200-node" in page and page.count('class="ledger-row"') == 2
    status, headers, body = request(server, "GET", "/api/snapshot.json")
    data = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert data["dashboard_version"] == DASHBOARD_VERSION
    assert data["baton"]["holder"] == "carol@h200-node" and data["source"]["revision"] in page
    assert [leg["label"] for leg in data["legs"]] == ["leg 1", "leg 2", "leg 3 (live)"]


def test_only_get_and_head_are_served_and_nothing_is_written(server, sample):
    head = LocalStore(sample.store_path).head()
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, _ = request(server, method, "/")
        assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert request(server, "HEAD", "/")[2] == b""
    assert request(server, "GET", "/claim")[0] == 404
    assert LocalStore(sample.store_path).head() == head


def test_a_loopback_server_refuses_foreign_host_names(server):
    assert request(server, "GET", "/", host="attacker.example:80")[0] == 421
    assert request(server, "GET", "/api/snapshot.json", host="localhost:1234")[0] == 200


def test_a_server_bound_beyond_loopback_answers_any_host_name(sample):
    srv = DashboardServer(DashboardReader(LocalStore(sample.store_path)), host="0.0.0.0", port=0).start()
    try:
        port = srv.httpd.server_address[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/snapshot.json", headers={"Host": f"trainbox.lan:{port}"})
        assert conn.getresponse().status == 200
    finally:
        srv.stop()


def test_a_store_error_keeps_the_last_snapshot_and_says_why(sample, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(sample.store_path, root)
    srv = DashboardServer(DashboardReader(LocalStore(root)), port=0, min_interval_s=0).start()
    try:
        assert json.loads(request(srv, "GET", "/api/snapshot.json")[2])["error"] is None
        (root / "refs" / "main").write_text("garbage")
        data = json.loads(request(srv, "GET", "/api/snapshot.json")[2])
        assert "refs/main is corrupt" in data["error"] and "showing the snapshot read at" in data["error"]
        assert data["baton"]["holder"] == "carol@h200-node"
        assert "error-banner" in request(srv, "GET", "/")[2].decode()
    finally:
        srv.stop()


def test_cli_refuses_bad_specs_and_missing_stores(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(main, ["dashboard", "--store", "s3://bucket/x"])
    assert bad.exit_code == 2 and "unknown store scheme" in bad.output
    missing = runner.invoke(main, ["dashboard", "--store", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "is not a relay store" in missing.output
    assert runner.invoke(main, ["dashboard", "--store", str(tmp_path), "--port", "70000"]).exit_code == 2
    assert "--run" in runner.invoke(main, ["dashboard", "--help"]).output


def test_cli_serves_until_terminated(sample):
    env = {**os.environ, "HF_TOKEN": "hf_secret_value_123"}
    # `-c` rather than `-m colibri_relay.cli`: cli.py's __main__ block runs before the dashboard is registered.
    proc = subprocess.Popen([sys.executable, "-c", "from colibri_relay.cli import main; main()", "dashboard", "--store", str(sample.store_path),
                             "--run", str(sample.run_dir), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        host, port = url[len("http://"):].rstrip("/").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/")
        body = conn.getresponse().read().decode()
        assert "carol@h200-node" in body and "hf_secret_value_123" not in body
    finally:
        proc.terminate()
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert "Traceback" not in proc.stderr.read()


def test_a_store_that_vanished_gives_an_error_page_not_a_traceback(tmp_path):
    from colibri_relay.dashboard.page import render_page
    from colibri_relay.dashboard.reader import read_snapshot_or_error

    store = LocalStore(tmp_path / "gone")
    snap = read_snapshot_or_error(DashboardReader(store))
    assert snap.baton is None and "is not a relay store" in snap.error
    page = render_page(snap, refresh_s=30)
    assert 'id="error"' in page and ">UNKNOWN<" in page
