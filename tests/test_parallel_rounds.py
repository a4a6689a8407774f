"""Parallel DiLoCo rounds of the app: the outer step against torch.optim.SGD (bit for bit), the MoE
merge rules, the int8 codec with error feedback, and two `colibri train --parallel` worker processes
on the fake Hub, checked by the relay's round history checker with the outer step recomputed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

os.environ["HF_HUB_DISABLE_XET"] = "1"  # the fake Hub speaks LFS only

import pytest
import torch
from click.testing import CliRunner
from colibri_model.corpus import prose_files
from colibri_model.data import prepare
from colibri_relay import Relay
from colibri_relay.rounds import RoundRelay
from colibri_relay.testing.round_history_check import check_round_history
from safetensors.torch import load_file, save_file

from colibri.cli import main as colibri_cli
from colibri.outer_step import mean_pseudograd, merged_biases, nesterov_step
from colibri.parallel_round import MODEL_FILE, MOMENTUM_FILE
from colibri.pseudograd import (
    BLOCK,
    PSEUDOGRAD_FILE,
    ROUTER_FILE,
    ErrorFeedback,
    PseudogradError,
    decode_int8,
    encode_int8,
    is_router_state,
    read_pseudograd,
    write_pseudograd,
)
from colibri.relay_leg import LegError, LegOptions, check_options

SMALL = ["--seq-len", "32", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1", "--eval-every", "0"]


def _sgd_reference(params, grads_per_round, lr=0.7, mu=0.9):
    """torch.optim.SGD(nesterov=True), the outer optimizer of torchft's DiLoCo, round after round."""
    ps = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    opt = torch.optim.SGD(list(ps.values()), lr=lr, momentum=mu, nesterov=True)
    for grads in grads_per_round:
        for n, p in ps.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach() for n, p in ps.items()}, {n: opt.state[p]["momentum_buffer"] for n, p in ps.items()}


def test_outer_step_is_torch_sgd_nesterov_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(33, 7, generator=g), "b": torch.randn(5, generator=g)}
    rounds = [{n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in params.items()} for _ in range(3)]
    want, want_buf = _sgd_reference(params, rounds)
    got, buf = params, None
    for grads in rounds:
        got, buf = nesterov_step(got, grads, buf, lr=0.7, mu=0.9)
    assert all(torch.equal(got[n], want[n]) and torch.equal(buf[n], want_buf[n]) for n in params)


def test_expert_mean_skips_workers_that_never_routed_and_biases_average():
    e = "layers.1.moe.experts.up_proj"
    deltas = [{e: torch.full((3, 2, 2), 1.0), "w": torch.ones(2)}, {e: torch.full((3, 2, 2), 3.0), "w": torch.zeros(2)}]
    counts = [{"layers.1.moe.router.tokens_per_expert": torch.tensor([5.0, 0.0, 0.0])},
              {"layers.1.moe.router.tokens_per_expert": torch.tensor([1.0, 4.0, 0.0])}]
    mean = mean_pseudograd(deltas, counts)
    assert mean[e][0].unique().tolist() == [2.0]  # both routed: plain mean
    assert mean[e][1].unique().tolist() == [3.0]  # only worker 1 routed to expert 1
    assert mean[e][2].unique().tolist() == [0.0]  # nobody routed to expert 2: no update from weight decay
    assert mean["w"].tolist() == [0.5, 0.5]
    bias = "layers.1.moe.router.expert_bias"
    assert merged_biases([{bias: torch.tensor([1.0, -1.0])}, {bias: torch.tensor([3.0, 1.0])}])[bias].tolist() == [2, 0]


def test_int8_codec_error_feedback_and_clear_errors(tmp_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g)
    q, s = encode_int8(x)
    assert q.dtype == torch.int8 and q.numel() == 4 * BLOCK
    assert (decode_int8(q, s, (1000,)) - x).abs().max() <= s.max() / 2 + 1e-7
    # error feedback: what two rounds sent differs from their true sum by one rounding at most
    feedback, sent = ErrorFeedback(tmp_path), torch.zeros(1000)
    true = [torch.randn(1000, generator=g) * 1e-3 for _ in range(2)]
    for i, d in enumerate(true):
        write_pseudograd(tmp_path / f"{i}.safetensors", {"t": d}, feedback)
        sent += read_pseudograd(tmp_path / f"{i}.safetensors", {"t": (1000,)})["t"]
    assert torch.allclose(sent + feedback.residual["t"], true[0] + true[1], atol=1e-9)
    with pytest.raises(PseudogradError, match=r"tensor t has shape \(1000,\), the base has \(10, 100\)"):
        read_pseudograd(tmp_path / "0.safetensors", {"t": (10, 100)})
    save_file({"t": torch.zeros(3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(PseudogradError, match="format None"):
        read_pseudograd(tmp_path / "bad.safetensors", {"t": (3,)})


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    prepare([str(prose_files()[0])], out, val_fraction=0.05, max_val_tokens=20_000, progress=False)
    return out


def _replay_outer_step(entry, base_dir, new_dir, contributions) -> list[str]:
    """Recompute the merge from the contributions: masked mean, torch.optim.SGD(nesterov), mean biases."""
    base = load_file(str(base_dir / MODEL_FILE))
    new = load_file(str(new_dir / MODEL_FILE))
    params = {n: t for n, t in base.items() if not is_router_state(n)}
    shapes = {n: tuple(t.shape) for n, t in params.items()}
    deltas = [read_pseudograd(p / PSEUDOGRAD_FILE, shapes) for _, p in contributions]
    routers = [load_file(str(p / ROUTER_FILE)) for _, p in contributions]
    counts = [{k: v for k, v in r.items() if k.endswith("tokens_per_expert")} for r in routers]
    grads = mean_pseudograd(deltas, counts)
    ps = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    opt = torch.optim.SGD(list(ps.values()), lr=0.7, momentum=0.9, nesterov=True)
    if (base_dir / MOMENTUM_FILE).is_file():
        buf = load_file(str(base_dir / MOMENTUM_FILE))
        for n, p in ps.items():
            opt.state[p]["momentum_buffer"] = buf[n].clone()
    for n, p in ps.items():
        p.grad = grads[n]
    opt.step()
    out = [f"{n} differs from the reference outer step" for n, p in ps.items() if not torch.equal(p.detach(), new[n])]
    for n in base:
        if is_router_state(n):
            want = torch.stack([r[n] for r in routers]).mean(dim=0)
            if not torch.equal(want, new[n]):
                out.append(f"{n} is not the mean of the workers' biases")
    return out


def test_two_workers_two_rounds_on_the_fake_hub(fake_hub, shards, tmp_path):
    spec = "hf://colibri/parallel-run"
    env = {**os.environ, "HF_ENDPOINT": fake_hub.endpoint, "HF_HUB_DISABLE_XET": "1"}
    common = ["train", "--parallel", "--relay", spec, "--data", str(shards), "--rounds", "2", "--preset", "tiny",
              "--workers", "2", "--inner-steps", "2", "--round-time", "120", "--min-round-time", "0",
              "--lease-duration", "6", "--heartbeat", "1", "--poll", "0.2", "--no-plan-check", "--no-progress", *SMALL]
    procs = [subprocess.Popen([sys.executable, "-m", "colibri.cli", *common, "--slot", str(i), "--holder", f"w{i}",
                               "--work-dir", str(tmp_path / f"w{i}")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs

    relay = Relay(spec)
    rounds = RoundRelay(relay)
    ledger = rounds.ledger()
    assert [e.round for e in ledger] == [0, 1]
    assert all(sorted(c.slot for c in e.contributions) == [0, 1] and not e.rejected for e in ledger)
    slices = [(c.data_slice["first_window"], c.data_slice["windows"]) for e in ledger for c in e.contributions]
    starts = sorted(s for s, _ in slices)
    assert starts == [0, 4, 8, 12] and all(n == 4 for _, n in slices)  # disjoint, recomputable: (r*K + i)*H*B
    assert all(e.tokens == 2 * 2 * 2 * 32 and e.utilisation is not None and 0 < e.utilisation <= 1 for e in ledger)
    assert all("max_vio" in e.stats and "dead_experts" in e.stats for e in ledger)
    view = rounds.view()
    report = check_round_history(relay.store, rounds.companion(view.rounds), min_rounds=2, replay=_replay_outer_step)
    assert report["violations"] == []

    # a sequential leg cannot mix into the parallel run
    with pytest.raises(LegError, match="runs parallel rounds"):
        check_options(LegOptions(relay=spec, work_dir=tmp_path / "seq", data_dir=shards, leg_steps=1), relay)
    status = CliRunner().invoke(colibri_cli, ["status", "--relay", spec])
    assert status.exit_code == 0, status.output
    assert "rounds  2 merged" in status.output and "utilisation" in status.output


def test_a_plan_over_the_hub_limits_is_refused_in_one_line(fake_hub, shards, tmp_path):
    result = CliRunner().invoke(colibri_cli, [
        "train", "--parallel", "--relay", "hf://colibri/too-fast", "--data", str(shards), "--slot", "0", "--rounds",
        "2", "--preset", "tiny", "--workers", "8", "--inner-steps", "2", "--round-time", "300", "--poll", "10"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "companion repo" in result.output and "128 per hour" in result.output


CONTRIBUTED = re.compile(r"^\[(\S+)\] contributed to round (\d+) \(slot (\d+), ([0-9a-f]{12})\)", re.MULTILINE)


def _acks_from_logs(companion, logs: list[str]) -> list[dict]:
    """The contributions the workers were told landed (their "contributed to round" lines), with the
    nonce read from the companion commit each names: what the history checker must find merged or
    rejected."""
    commits = {c.sha[:12]: c.sha for c in companion.history()}
    acks = []
    for log in logs:
        for _, r, slot, short in CONTRIBUTED.findall(log):
            path = f"rounds/{int(r):06d}/slot-{int(slot):04d}/contribution.json"
            meta = json.loads(companion.read_file(path, commits[short]))
            acks.append({"round": int(r), "slot": int(slot), "nonce": meta["nonce"]})
    return acks


def _wait_for(what: str, ready, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll READY() until it holds; fail naming WHAT if PROC exits first or TIMEOUT_S passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the worker exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g}s"
        time.sleep(0.05)


def test_a_worker_killed_mid_round_the_run_completes_and_merges_it_at_most_once(fake_hub, shards, tmp_path,
                                                                                 monkeypatch):
    """SIGKILL one `colibri train --parallel` worker while it trains round 0, start it again (same
    holder, empty inner state): both rounds merge, the killed slot is in round 0's entry at most
    once (merged, or rejected with a reason), and the history checker finds no violation."""
    spec = "hf://colibri/kill-run"
    # The Hub's 128 commits an hour fit a lease of 1200 s; this run's 6 s lease, renewed every second
    # by a merger that may wait 90 s for the restart, gets the same quota scaled to its lease.
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (128, 3600.0 * 6 / 1200))
    env = {**os.environ, "HF_ENDPOINT": fake_hub.endpoint, "HF_HUB_DISABLE_XET": "1"}
    # Generous timers for a loaded 2-core machine: the merger waits up to 90 s for the restarted
    # worker, and the lease (6 s) lets the survivor take over should the killed one hold it.
    common = ["train", "--parallel", "--relay", spec, "--data", str(shards), "--rounds", "2", "--preset", "tiny",
              "--workers", "2", "--inner-steps", "2", "--round-time", "90", "--min-round-time", "0",
              "--lease-duration", "6", "--heartbeat", "1", "--poll", "0.2", "--no-plan-check", "--no-progress", *SMALL]
    logs, procs = [], []

    def start(slot: int) -> subprocess.Popen:
        log = tmp_path / f"w{slot}-{len(logs)}.log"
        logs.append(log)
        with log.open("w") as out:  # the child holds its own copy of the descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", "colibri.cli", *common, "--slot", str(slot),
                                           "--holder", f"w{slot}", "--work-dir", str(tmp_path / f"w{slot}")],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))
        return procs[-1]

    survivor, victim = start(0), start(1)
    try:
        # ColibriRounds.train makes WORK/run when its trainer starts: the victim is inside round 0
        _wait_for("round-0 training of worker 1", (tmp_path / "w1" / "run").exists, victim, 180)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        killed_log = logs[-1].read_text()
        restarted = start(1)
        codes = [survivor.wait(timeout=240), restarted.wait(timeout=240)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [p.read_text() for p in logs]
    assert codes == [0, 0], "\n----\n".join(t[-3000:] for t in texts)

    relay = Relay(spec)
    rounds = RoundRelay(relay)
    ledger = rounds.ledger()
    assert [e.round for e in ledger] == [0, 1]
    for e in ledger:
        named = [c.slot for c in e.contributions] + [j.slot for j in e.rejected]
        assert sorted(named) == sorted(set(named)), f"round {e.round} names a slot twice: {named}"
    round0 = [c.slot for c in ledger[0].contributions] + [j.slot for j in ledger[0].rejected]
    late = "round 0 closed before our contribution landed" in texts[-1]
    assert round0.count(1) == 1 or late, texts[-1][-3000:]
    assert sorted(c.slot for c in ledger[1].contributions) == [0, 1]
    companion = rounds.companion(rounds.view().rounds)
    acks = _acks_from_logs(companion, texts)
    if "contributed to round 0" not in killed_log:  # killed before its post: only the restart's counts
        assert [a["slot"] for a in acks if a["round"] == 0].count(1) <= 1
    report = check_round_history(relay.store, companion, min_rounds=2, acks=acks, replay=_replay_outer_step)
    assert report["violations"] == []
    assert report["acks"] >= 3  # round 0 by the survivor, round 1 by both (round 0 by the restart unless late)


def test_a_merged_model_file_has_the_same_bytes_every_time(tmp_path):
    """safetensors writes its metadata map in a random order; the merge's file must not, so a base
    rebuilt by the next merger (ROUNDS.md) has the checksums of the one it replaces."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import load_file

    from colibri.parallel_round import save_canonical

    tensors = {"b": torch.arange(6.0).view(2, 3), "a": torch.ones(4, dtype=torch.bfloat16)}
    metadata = {"format": "pt", "format_version": "1.0", "z": "last", "m": "mi\u00e9ddle"}
    digests = set()
    for i in range(6):
        path = tmp_path / f"m{i}.safetensors"
        save_canonical(tensors, path, metadata)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1
    got = load_file(str(path))
    assert torch.equal(got["b"], tensors["b"]) and torch.equal(got["a"], tensors["a"])
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
