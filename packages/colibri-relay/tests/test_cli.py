"""The `colibri-relay` command through click's runner (and one real subprocess for fake-hub)."""

import json
import os
import subprocess
import sys

from click.testing import CliRunner
from colibri_relay.cli import main


def run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def test_help_lists_every_command():
    out = run("--help").output
    for cmd in ("init", "status", "claim", "release", "ledger", "fake-hub"):
        assert cmd in out


def test_init_status_claim_release_ledger_on_a_local_store(tmp_path):
    s = str(tmp_path / "relay")
    r = run("init", "--store", s, "--lease-s", "3", "--heartbeat-s", "0.5")
    assert r.exit_code == 0, r.output
    r = run("status", "--store", s, "--json")
    data = json.loads(r.output)
    assert data["state"]["status"] == "free" and len(data["head"]) == 40 and data["state"]["leg"] == 0
    r = run("claim", "--store", s, "--holder", "me", "--hold-s", "0.3", "--lease-s", "3", "--heartbeat-s", "0.5")
    assert r.exit_code == 0 and "claimed" in r.output and "released" in r.output, r.output
    assert json.loads(run("status", "--store", s, "--json").output)["state"]["epoch"] == 1
    assert "no legs pushed yet" in run("ledger", "--store", s).output
    assert json.loads(run("ledger", "--store", s, "--json").output) == []
    assert "baton:   free" in run("status", "--store", s).output


def test_release_needs_a_lease_id_or_force(tmp_path):
    s = str(tmp_path / "relay")
    run("init", "--store", s)
    r = CliRunner().invoke(main, ["release", "--store", s])
    assert r.exit_code == 2 and "--lease-id" in r.output
    r = run("release", "--store", s, "--force")
    assert r.exit_code == 0 and "baton free" in r.output


def test_errors_are_one_line_without_traceback(tmp_path):
    r = CliRunner().invoke(main, ["status", "--store", str(tmp_path / "nothing-here")])
    assert r.exit_code == 2  # bad input: no store there
    assert r.output.startswith("error:") and r.output.count("\n") == 1 and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["status", "--store", "s3://bucket/x"])
    assert r.exit_code == 2 and "unknown store scheme" in r.output
    run("init", "--store", str(tmp_path / "relay"))
    r = CliRunner().invoke(main, ["ledger", "--store", str(tmp_path / "relay"), "--revision", "nope"])
    assert r.exit_code == 2 and r.output.startswith("error:") and r.output.count("\n") == 1, r.output
    r = CliRunner().invoke(main, ["status"])
    assert r.exit_code == 2 and "--store" in r.output
    r = CliRunner().invoke(main, ["claim", "--store", str(tmp_path), "--lease-s", "1", "--heartbeat-s", "1"])
    assert r.exit_code == 2 and "heartbeat_s" in r.output


def test_fake_hub_command_serves_the_unmodified_client(tmp_path):
    secret = "hf_SECRETtokenNEVERprinted123"
    env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "PYTHONUNBUFFERED": "1", "HF_TOKEN": secret}
    proc = subprocess.Popen([sys.executable, "-m", "colibri_relay.cli", "fake-hub", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:")
        env["HF_ENDPOINT"] = endpoint
        for args in (["init", "--store", "hf://team/run"], ["status", "--store", "hf://team/run", "--json"]):
            out = subprocess.run([sys.executable, "-m", "colibri_relay.cli", *args], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert secret not in out.stdout + out.stderr
        assert json.loads(out.stdout)["state"]["status"] == "free"
        from huggingface_hub import HfApi

        assert HfApi(endpoint=endpoint, token="anything").model_info("team/run").sha == json.loads(out.stdout)["head"]
        bad = subprocess.run([sys.executable, "-m", "colibri_relay.cli", "status", "--store", "hf://team/missing"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("error:") and secret not in bad.stdout + bad.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_fake_hub_commit_quota_scales_and_a_spent_quota_is_one_clear_error(tmp_path):
    """`--commit-quota 1/600`: init spends it; the claim is told the server's wait, not "held"."""
    env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "colibri_relay.cli", "fake-hub", "--commit-quota", "1/600"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:")
        env["HF_ENDPOINT"] = endpoint
        cli = [sys.executable, "-m", "colibri_relay.cli"]
        out = subprocess.run([*cli, "init", "--store", "hf://team/q"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        out = subprocess.run([*cli, "claim", "--store", "hf://team/q", "--hold-s", "0.1"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.startswith("error:") and out.stderr.count("\n") == 1, out.stderr
        assert "rate limit" in out.stderr and "10 minutes" in out.stderr and "held" not in out.stderr, out.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_fake_hub_commit_quota_values():
    from colibri_relay.testing.fake_hub import parse_commit_quota

    assert parse_commit_quota("128/3600") == (128, 3600.0)
    assert parse_commit_quota("20/10") == (20, 10.0) and parse_commit_quota("20/0.5") == (20, 0.5)
    assert parse_commit_quota("off") is None
    for bad, why in (("20", "no '/'"), ("0/10", "commits"), ("x/10", "commits"), ("2.5/10", "commits"),
                     ("20/0", "window"), ("20/-1", "window"), ("20/soon", "window"), ("20/inf", "window")):
        r = CliRunner().invoke(main, ["fake-hub", "--commit-quota", bad])
        assert r.exit_code == 2 and "--commit-quota" in r.output and why in r.output, (bad, r.output)
        assert "Traceback" not in r.output and r.output.count("Error:") == 1


def test_claim_refuses_negative_and_zero_durations(tmp_path):
    s = str(tmp_path / "relay")
    run("init", "--store", s)
    for flag, value in (("--hold-s", "-5"), ("--hold-s", "0"), ("--lease-s", "-1"), ("--heartbeat-s", "0")):
        r = CliRunner().invoke(main, ["claim", "--store", s, flag, value])
        assert r.exit_code == 2 and flag in r.output and "Traceback" not in r.output, (flag, value, r.output)
    assert json.loads(run("status", "--store", s, "--json").output)["state"]["epoch"] == 0  # nothing claimed


def test_version_exit_status_and_a_held_baton_exits_1(tmp_path):
    from importlib.metadata import version

    import colibri_relay
    from colibri_relay import Relay

    r = run("--version")
    assert r.exit_code == 0 and r.output == f"colibri-relay, version {version('colibri-relay')}\n"
    assert colibri_relay.__version__ == version("colibri-relay")
    assert "Exit status: 0 ok, 1 a check failed" in run("--help").output
    s = str(tmp_path / "relay")
    run("init", "--store", s)
    Relay(s, holder="alice").claim()
    r = CliRunner().invoke(main, ["claim", "--store", s, "--holder", "bob", "--hold-s", "1"])
    assert r.exit_code == 1 and r.output.startswith("error:") and r.output.count("\n") == 1, r.output
