"""`colibri train` legs end to end: colibri-model's trainer driven by colibri-relay's lease, on the
fake Hub (the unmodified huggingface_hub client over loopback) and on a LocalStore."""

from __future__ import annotations

import json
import os
import threading
import time

os.environ["HF_HUB_DISABLE_XET"] = "1"  # the fake Hub speaks LFS only

import pytest
import torch
from click.testing import CliRunner
from colibri_model.corpus import chat_file, prose_files
from colibri_model.data import prepare
from colibri_relay import Relay
from safetensors.torch import load_file

from colibri.cli import main as colibri_cli
from colibri.relay_leg import LegError, LegOptions, run_leg

SMALL_RUN = dict(seq_len=32, batch_size=2, micro_batch=2, lr=3e-3, warmup_steps=2, eval_every=0, eval_batches=1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    prepare([str(prose_files()[0])], out, val_fraction=0.05, max_val_tokens=20_000, progress=False)
    return out


def _force_release(store) -> None:
    """Free the baton from outside, as an operator would. A holder's heartbeat may land between
    our read of the head and our write: that is the CAS doing its job, so read again and retry."""
    from colibri_relay.errors import CasLost

    for _ in range(50):
        try:
            Relay(str(store), holder="ops").force_release()
            return
        except CasLost:
            time.sleep(0.05)
    raise AssertionError("could not force-release the baton in 50 tries")


def _options(relay: str, work, data, **kw) -> LegOptions:
    base = dict(relay=relay, work_dir=work, data_dir=data, preset="tiny", leg_steps=3, lease_duration_s=6.0,
                heartbeat_s=1.0, train_overrides=dict(SMALL_RUN), progress=False, log=lambda m: None)
    base.update(kw)
    return LegOptions(**base)


def test_two_legs_and_an_sft_leg_on_the_fake_hub(fake_hub, shards, tmp_path):  # fake_hub: colibri-relay's pytest plugin
    spec = "hf://colibri/tiny-relay"
    Relay(spec, lease_duration_s=6.0, heartbeat_s=1.0).init()

    first = run_leg(_options(spec, tmp_path / "alice", shards, holder="alice"))
    assert first.pushed and first.leg == 1 and (first.step_start, first.step_end) == (0, 3)
    pushed_weights = load_file(str(tmp_path / "alice" / "leg" / "push" / "model.safetensors"))

    second = run_leg(_options(spec, tmp_path / "bob", shards, holder="bob", preset=None))
    assert second.pushed and second.leg == 2 and (second.step_start, second.step_end) == (3, 6)
    # bob resumed exactly alice's weights
    pulled = load_file(str(tmp_path / "bob" / "leg" / "payload" / "model.safetensors"))
    assert all(torch.equal(pulled[k], pushed_weights[k]) for k in pushed_weights)

    sft = run_leg(_options(spec, tmp_path / "erin", None, holder="erin", sft=True, chat_files=[chat_file()],
                           leg_steps=2))
    assert sft.pushed and sft.leg == 3

    relay = Relay(spec)
    head, state = relay.status()
    ledger = relay.ledger(head)
    assert [e.holder for e in ledger] == ["alice", "bob", "erin"]
    assert [e.steps for e in ledger] == [3, 3, 2]
    assert ledger[2].model_dump().get("kind") == "sft"
    assert state.status == "free" and {"model.safetensors", "optimizer.safetensors", "training_state.json",
                                       "metrics.jsonl"} <= set(state.payload)
    # The pretraining run's metrics travelled leg after leg and are archived beside the SFT run's.
    pretrain = relay.store.read_file("metrics_pretrain.jsonl", head).decode().splitlines()
    assert [json.loads(line)["step"] for line in pretrain] == [0, 1, 2, 3, 4, 5, 6]
    assert "metrics.jsonl" in state.payload


def test_a_lost_lease_stops_the_leg_without_pushing(shards, tmp_path):
    store = tmp_path / "relay"
    Relay(str(store), lease_duration_s=3.0, heartbeat_s=0.3).init()
    metrics = tmp_path / "carol" / "leg" / "run" / "metrics.jsonl"

    def usurp():  # somebody force-releases the baton while carol trains: her next renewal fails the CAS
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not metrics.exists():
            time.sleep(0.05)
        time.sleep(0.5)
        _force_release(store)

    thread = threading.Thread(target=usurp)
    thread.start()
    outcome = run_leg(_options(str(store), tmp_path / "carol", shards, holder="carol", leg_steps=400,
                               lease_duration_s=3.0, heartbeat_s=0.3))
    thread.join()
    assert not outcome.pushed and outcome.reason == "lease lost"
    assert 0 < outcome.step_end < 400
    head, state = Relay(str(store)).status()
    assert state.leg == 0 and Relay(str(store)).ledger(head) == []


def test_bad_leg_options_fail_with_one_clear_error(shards, tmp_path):
    store = tmp_path / "relay"
    Relay(str(store), lease_duration_s=6.0, heartbeat_s=1.0).init()
    head_before = Relay(str(store)).store.head()
    with pytest.raises(LegError, match="--preset"):
        run_leg(_options(str(store), tmp_path / "w", shards, preset=None))
    with pytest.raises(LegError, match="pretrained checkpoint"):
        run_leg(_options(str(store), tmp_path / "w", None, sft=True, chat_files=[chat_file()]))
    with pytest.raises(LegError, match="--chat-data"):
        run_leg(_options(str(store), tmp_path / "w", None, sft=True))
    with pytest.raises(LegError, match="--data DIR"):
        run_leg(_options(str(store), tmp_path / "w", None))
    # Refused before claiming: a typo costs no claim/release commits (on the Hub, rate-limited).
    assert Relay(str(store)).store.head() == head_before

    runner = CliRunner()
    result = runner.invoke(colibri_cli, ["train", "--relay", str(store), "--preset", "tiny"], catch_exceptions=False)
    assert result.exit_code == 2 and "--leg-steps" in result.output
    result = runner.invoke(colibri_cli, ["status", "--relay", str(tmp_path / "nowhere")], catch_exceptions=False)
    assert result.exit_code == 2 and result.output.startswith("Error: relay:")  # bad input: no relay there
    result = runner.invoke(colibri_cli, ["train", "--relay", str(store), "--leg-steps", "1", "--data", str(shards)],
                           catch_exceptions=False)
    assert result.exit_code == 2 and "--preset" in result.output and result.output.count("\n") == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_leg_only_rank0_talks_to_the_relay_and_all_ranks_stop_together(shards, tmp_path):
    import subprocess
    import sys

    store = tmp_path / "relay"
    Relay(str(store), lease_duration_s=4.0, heartbeat_s=0.4).init()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}

    def torchrun(work, steps, parallelism):
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "colibri.cli", "train",
                "--relay", str(store), "--preset", "tiny", "--data", str(shards), "--leg-steps", str(steps),
                "--work-dir", str(work), "--holder", parallelism, "--lease-duration", "4", "--heartbeat", "0.4",
                "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2", "--eval-every", "0", "--no-progress",
                "--parallelism", parallelism]

    # First leg under FSDP2: it checkpoints in DCP shards and pushes the single-file payload.
    done = subprocess.run(torchrun(tmp_path / "w1", 2, "fsdp"), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("claimed the baton") == 1  # rank 0 alone claimed and pushed
    ledger = Relay(str(store)).ledger()
    assert len(ledger) == 1 and ledger[0].hardware.startswith("2x") and ledger[0].steps == 2
    assert (tmp_path / "w1/leg/run/checkpoints/step_00000002/dcp.json").is_file()
    _, state = Relay(str(store)).status()
    assert {"model.safetensors", "optimizer.safetensors", "training_state.json"} <= set(state.payload)
    assert not any(name.startswith(("model/", "optimizer/")) or name == "dcp.json" for name in state.payload)

    # Second leg, DDP, resumes that payload; the baton is force-released mid-leg: both ranks stop,
    # nobody pushes.
    metrics = tmp_path / "w2" / "leg" / "run" / "metrics.jsonl"
    proc = subprocess.Popen(torchrun(tmp_path / "w2", 500, "ddp"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.1)
    _force_release(store)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "LEASE LOST" in out, (out[-2000:], err[-2000:])
    assert len(Relay(str(store)).ledger()) == 1


def test_cli_version_and_exit_status(tmp_path, monkeypatch):
    from importlib.metadata import version
    from types import SimpleNamespace

    import colibri
    import colibri.relay_leg

    runner = CliRunner()
    result = runner.invoke(colibri_cli, ["--version"])
    assert result.exit_code == 0 and result.output == f"colibri, version {version('colibri')}\n"
    assert colibri.__version__ == version("colibri")
    assert "Exit status: 0 ok, 1 a check failed" in runner.invoke(colibri_cli, ["--help"]).output
    # a leg that stopped without pushing (the lease was lost) is a failed check: 1, no longer 3
    monkeypatch.setattr(colibri.relay_leg, "run_leg", lambda opts: SimpleNamespace(ok=False, reason="lease lost"))
    result = runner.invoke(colibri_cli, ["train", "--relay", str(tmp_path / "r"), "--leg-steps", "1"])
    assert result.exit_code == 1 and "leg not pushed: lease lost" in result.output
    (tmp_path / "demo" / "relay").mkdir(parents=True)
    result = runner.invoke(colibri_cli, ["demo", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 2 and "already holds a relay" in result.output


def test_bias_gamma_sets_a_new_runs_balancer_and_legs_keep_it(shards, tmp_path):
    store = tmp_path / "relay"
    Relay(str(store), lease_duration_s=6.0, heartbeat_s=1.0).init()
    runner = CliRunner()
    args = ["train", "--relay", str(store), "--preset", "tiny", "--data", str(shards), "--leg-steps", "1",
            "--seq-len", "32", "--batch-size", "2", "--warmup-steps", "1", "--eval-every", "0",
            "--lease-duration", "6", "--heartbeat", "1", "--no-progress"]
    result = runner.invoke(colibri_cli, [*args, "--work-dir", str(tmp_path / "a"), "--bias-gamma", "0.01"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "a" / "leg" / "push" / "config.json").read_text())
    assert config["bias_update_gamma"] == 0.01
    # a resumed run keeps its own model, like every other new-run option
    result = runner.invoke(colibri_cli, [*args, "--work-dir", str(tmp_path / "b"), "--bias-gamma", "0.5"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b" / "leg" / "push" / "config.json").read_text())["bias_update_gamma"] == 0.01
    result = runner.invoke(colibri_cli, [*args, "--bias-gamma", "-1"], catch_exceptions=False)
    assert result.exit_code == 2 and "--bias-gamma" in result.output
