"""The dashboard in a real browser: Debian's headless chromium loads the page served for a LocalStore
relay with three legs and a live run, and the rendered DOM must show the holder, the ledger rows and
the charts; a screenshot is saved (path printed). A metrics line appended to the live run shows up
on the next load.

chromium is installed with apt when missing and the tests run as root; otherwise the test is
skipped with the reason. Set COLIBRI_DASHBOARD_SCREENSHOT=PATH to also copy the screenshot there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from colibri_relay import LocalStore
from colibri_relay.dashboard import DashboardReader, DashboardServer
from colibri_relay.dashboard.sample_relay import build_sample_relay, metrics_line

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--mute-audio"]


def _find_chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    found = _find_chromium()
    if found is None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"], env=env,
                                 capture_output=True, text=True, timeout=900)
        if install.returncode != 0:  # the package lists may be stale: refresh once
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"], env=env,
                           capture_output=True, timeout=900)
        found = _find_chromium()
    if found is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get)")
    return found


def run_chromium(binary: str, profile, *args: str) -> subprocess.CompletedProcess:
    profile.mkdir(exist_ok=True)
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def served(tmp_path):
    sample = build_sample_relay(tmp_path / "relay", legs=3, steps_per_leg=30, live_steps=12)
    server = DashboardServer(DashboardReader(LocalStore(sample.store_path), run_dir=sample.run_dir), port=0,
                             refresh_s=30, min_interval_s=0).start()
    yield sample, server
    server.stop()


def test_the_page_renders_in_chromium_with_baton_ledger_and_charts(chromium, served, tmp_path):
    sample, server = served
    dom = run_chromium(chromium, tmp_path / "profile-1", "--dump-dom", server.url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # The baton: held by the live leg's holder, with the lease stated as an estimate.
    assert re.search(r'id="baton-status">HELD<', html)
    assert "carol@h200-node" in html and "(estimate)" in html
    # The ledger: three rows, newest first.
    assert re.findall(r'class="ledger-row" data-leg="(\d+)"', html) == ["3", "2", "1"]
    # Charts over steps and legs, the MoE views, leg boundaries and the live band.
    charts = set(re.findall(r'<svg class="chart[^"]*" data-chart="([^"]+)"', html))
    assert {"loss", "lr", "tokens_per_s", "mfu", "legs-loss", "legs-tokens-per-s", "legs-mfu",
            "moe-heatmap", "moe-max-vio", "moe-dead"} <= charts
    assert html.count('class="leg-boundary"') >= 3 * 6 and 'class="live-band"' in html
    assert 'data-series="loss"' in html and 'data-series="val_loss"' in html
    assert html.count('class="cell"') == 4 * 8  # 4 layers x 8 experts
    assert "Expert load share at step 102" in html

    shot = tmp_path / "dashboard.png"
    result = run_chromium(chromium, tmp_path / "profile-2", "--window-size=1400,2000", f"--screenshot={shot}",
                          server.url)
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a blank page compresses to a few kB
    print(f"\ndashboard screenshot: {shot}")
    if target := os.environ.get("COLIBRI_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, target)
        print(f"copied to {target}")

    # The live run grows: the next load shows the new step.
    with open(sample.run_dir / "metrics.jsonl", "a") as f:
        import random

        f.write(json.dumps(metrics_line(random.Random(1), 103, moe=True, total_steps=120)) + "\n")
    again = run_chromium(chromium, tmp_path / "profile-3", "--dump-dom", server.url)
    assert "Expert load share at step 103" in again.stdout
