"""The dashboard's data layer: snapshots of real relays (built through the Relay API), tolerant
metrics parsing, missing and corrupt data, the lease estimate, caching, and no secrets in the output."""

from __future__ import annotations

import json

import pytest
from colibri_relay import LocalStore, PutFile, Relay, open_store
from colibri_relay.dashboard import DASHBOARD_VERSION, DashboardReader
from colibri_relay.dashboard.metrics_reader import parse_metrics
from colibri_relay.dashboard.page import render_page
from colibri_relay.dashboard.sample_relay import build_sample_relay
from colibri_relay.dashboard.series_builder import MAX_POINTS, build_series
from colibri_relay.dashboard.snapshot import LegSpan
from colibri_relay.relay_state import RELAY_FILE


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return build_sample_relay(tmp_path_factory.mktemp("relay"), legs=3, steps_per_leg=20, live_steps=7)


def test_snapshot_of_a_relay_with_legs_and_a_live_run(sample):
    store = LocalStore(sample.store_path)
    snap = DashboardReader(store, run_dir=sample.run_dir).read()
    assert snap.dashboard_version == DASHBOARD_VERSION
    assert snap.source.revision == store.head() and snap.source.metrics_path == "metrics.jsonl"
    assert snap.problems == []
    baton = snap.baton
    assert (baton.status, baton.holder, baton.current_leg, baton.legs_pushed) == ("held", "carol@h200-node", 4, 3)
    assert baton.last_renewal_commit == store.head()  # the claim was the holder's last write
    assert 1100 < baton.lease_remaining_s_estimate <= 1200 and "Estimate" in baton.estimate_note
    # Ledger newest first, each row pointing at its leg tag.
    tags = store.list_tags()
    assert [r.leg for r in snap.ledger] == [3, 2, 1]
    assert [r.commit for r in snap.ledger] == [tags["leg-3"], tags["leg-2"], tags["leg-1"]]
    assert [r.holder for r in snap.ledger] == ["dana@cloud-a100", "bob@lab-h100", "alice@gpu-box"]
    # Leg spans: each leg adds the steps after the previous leg's last step; the live leg comes last.
    assert [(s.leg, s.first_step, s.last_step, s.points, s.live) for s in snap.legs] == [
        (1, 1, 20, 20, False), (2, 21, 40, 20, False), (3, 41, 60, 20, False), (4, 61, 67, 7, True)]
    assert {"loss", "val_loss", "lr", "tokens_per_s", "mfu", "grad_norm"} <= set(snap.series)
    assert snap.series["loss"].steps == [float(s) for s in range(1, 68)]
    assert snap.series["val_loss"].steps == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    # Per-leg aggregates take loss in/out from the ledger.
    assert [a.loss_end for a in snap.per_leg[:3]] == [e.loss_end for e in reversed(snap.ledger)]
    assert snap.per_leg[3].label == "leg 4 (live)" and snap.per_leg[3].tokens_per_s > 0
    # MoE views from the router stats: latest step's heatmap, 4 layers x 8 experts, rows sum to 1.
    moe = snap.moe
    assert moe.heatmap_step == 67 and moe.layers == [0, 1, 2, 3]
    assert all(len(row) == 8 and abs(sum(row) - 1) < 1e-4 for row in moe.load_share)
    assert list(moe.max_vio) == ["L0", "L1", "L2", "L3"] and len(moe.max_vio["L0"].steps) == 67
    assert moe.dead_experts.values[0] == 1 and moe.dead_experts.values[-1] == 0
    # The JSON round-trips through the schema.
    assert type(snap).model_validate_json(snap.model_dump_json()) == snap


def test_a_generic_payload_plots_its_own_fields_and_shows_no_moe_views(tmp_path):
    sample = build_sample_relay(tmp_path, legs=2, steps_per_leg=5, live=False, moe=False)
    snap = DashboardReader(LocalStore(sample.store_path)).read()
    assert snap.moe is None and snap.problems == []
    assert set(snap.series) == {"loss", "reward", "lr", "episodes_per_s"}
    html = render_page(snap, refresh_s=30)
    assert 'data-chart="field-reward"' in html and 'data-chart="moe-heatmap"' not in html
    assert 'data-chart="mfu"' in html and "no data yet" in html  # a fixed chart with no data says so


def test_an_empty_relay_shows_a_free_baton_and_says_nothing_is_pushed(tmp_path):
    store = LocalStore(tmp_path / "s")
    Relay(store).init()
    snap = DashboardReader(store, run_dir=tmp_path / "run").read()
    assert snap.baton.status == "free" and snap.baton.current_leg is None and snap.ledger == []
    assert snap.series == {} and snap.moe is None
    assert any("no legs pushed yet" in p for p in snap.problems)
    assert any("live run" in p and "does not exist yet" in p for p in snap.problems)
    html = render_page(snap, refresh_s=30)
    assert "No legs pushed yet." in html and ">FREE<" in html


def test_a_store_without_relay_files_says_it_is_not_initialised(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.create()
    snap = DashboardReader(store).read()
    assert snap.baton is None
    assert any("not initialised" in p for p in snap.problems)
    assert ">UNKNOWN<" in render_page(snap, refresh_s=30)


def test_corrupt_relay_json_and_ledger_lines_show_what_is_readable(sample, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(sample.store_path, root)
    store = LocalStore(root)
    head = store.head()
    ledger = store.read_file("LEDGER.jsonl", head).splitlines(keepends=True)
    bad_ledger = ledger[0] + b'{"leg": "two"\n' + ledger[2]
    store.commit([PutFile(RELAY_FILE, b'{"relay_version": "1.0", "epoch": -3}'), PutFile("LEDGER.jsonl", bad_ledger)],
                 parent=head, message="vandalism", nonce="abcd")
    before = store.head()
    snap = DashboardReader(store).read()
    assert snap.baton is None
    assert any("baton unknown" in p and "epoch" in p for p in snap.problems)
    assert any("LEDGER.jsonl line 2: not valid JSON" in p for p in snap.problems)
    assert [r.leg for r in snap.ledger] == [3, 1]  # the readable rows are still shown
    assert store.head() == before  # reading never writes


def test_an_unknown_major_relay_version_is_reported_naming_both_versions(tmp_path):
    store = LocalStore(tmp_path / "s")
    head = store.create()
    store.commit([PutFile(RELAY_FILE, json.dumps({"relay_version": "7.1"}).encode())], parent=head, message="m",
                 nonce="ab")
    [problem] = [p for p in DashboardReader(store).read().problems if "relay_version" in p]
    assert "7.1" in problem and "1.0" in problem


def test_metrics_parsing_is_tolerant_and_reports_what_it_skipped():
    lines = [
        json.dumps({"metrics_version": "1.0", "step": 1, "loss": 3.0, "lr": 1e-3, "skipped": False}),
        "{not json",
        json.dumps({"metrics_version": "2.0", "step": 2, "loss": 2.0}),
        json.dumps([1, 2]),
        json.dumps({"step": 3, "loss": float("nan"), "lr": 2e-3, "note": "text", "flag": True}),
        json.dumps({"metrics_version": "1.0", "step": 1, "loss": 2.5}),  # step 1 re-logged after a resume
    ]
    raw = ("\n".join(lines) + "\n" + '{"step": 4, "lo').encode()  # a line being appended
    parsed = parse_metrics(raw, "m.jsonl")
    assert parsed.incomplete_tail
    assert [(p.step, p.values) for p in parsed.points] == [(1, {"loss": 2.5}), (3, {"lr": 2e-3})]
    assert any("m.jsonl line 2: not valid JSON" in p for p in parsed.problems)
    assert any("line 3: metrics_version 2.0 is not supported (this dashboard reads 1.0)" in p for p in parsed.problems)
    assert any("line 4: not a JSON object" in p for p in parsed.problems)


def test_metrics_without_step_use_line_order():
    parsed = parse_metrics(b'{"reward": 1}\n{"reward": 2}\n', "r.jsonl")
    assert [p.step for p in parsed.points] == [0, 1]
    assert any("no numeric 'step'" in p for p in parsed.problems)


def test_a_live_run_mid_append_shows_complete_lines_and_says_the_rest_is_coming(sample, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    full = (sample.run_dir / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(full + b'{"metrics_version": "1.0", "step": 99, "lo')
    snap = DashboardReader(LocalStore(sample.store_path), run_dir=run).read()
    assert snap.legs[-1].live and snap.legs[-1].last_step == 67
    assert any("still being written" in p for p in snap.problems)


def test_a_held_lease_past_its_duration_is_lapsed(sample):
    store = LocalStore(sample.store_path)
    fresh = DashboardReader(store).read().baton
    later = DashboardReader(store, clock=lambda: __import__("time").time() + 1500).read().baton
    assert fresh.status == "held"
    assert later.status == "lapsed" and later.lease_remaining_s_estimate < -250
    assert "lapsed" in render_page(DashboardReader(store, clock=lambda: 4e9).read(), refresh_s=30)


def test_the_renewal_is_found_by_nonce_when_the_head_is_not_a_relay_write(sample, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(sample.store_path, root)
    store = LocalStore(root)
    renewal = store.head()
    store.commit([PutFile("README.md", b"# notes\n")], parent=renewal, message="docs", nonce="0123")
    baton = DashboardReader(store).read().baton
    assert baton.last_renewal_commit == renewal and baton.status == "held"


class CountingStore(LocalStore):
    def __init__(self, root):
        super().__init__(root)
        self.reads: list[tuple[str, str]] = []

    def read_file(self, path, revision):
        self.reads.append((path, revision))
        return super().read_file(path, revision)

    def commit(self, *a, **k):  # the dashboard must never get here
        raise AssertionError("the dashboard wrote to the store")

    create_tag = commit


def test_leg_metrics_are_read_once_per_leg_commit(sample):
    store = CountingStore(sample.store_path)
    reader = DashboardReader(store, run_dir=sample.run_dir)
    reader.read()
    first = [r for r in store.reads if r[0] == "metrics.jsonl"]
    assert len(first) == 3
    store.reads.clear()
    reader.read()
    assert [r for r in store.reads if r[0] == "metrics.jsonl"] == []  # cached by immutable commit


def test_long_series_are_downsampled_keeping_leg_ends():
    from colibri_relay.dashboard.metrics_reader import MetricsPoint

    n = 5 * MAX_POINTS
    leg1 = [MetricsPoint(step=float(s), values={"loss": 1.0 / s}) for s in range(1, n // 2)]
    leg2 = [MetricsPoint(step=float(s), values={"loss": 1.0 / s}) for s in range(n // 2, n + 1)]
    series = build_series([(LegSpan(leg=1, label="leg 1"), leg1), (LegSpan(leg=2, label="leg 2"), leg2)])["loss"]
    assert series.total_points == n and len(series.steps) <= MAX_POINTS + 2
    assert leg1[-1].step in series.steps and series.steps[-1] == n and series.steps[0] == 1


def test_text_from_the_store_is_escaped_in_the_page(tmp_path):
    store = LocalStore(tmp_path / "s")
    relay = Relay(store, holder="<script>alert(1)</script>")
    relay.init()
    leg = relay.claim(wait=False)
    leg.close()
    html = render_page(DashboardReader(store).read(), refresh_s=30)
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_a_hub_relay_reads_through_the_real_client_and_never_exposes_the_token(hub_store, tmp_path, monkeypatch):
    relay = Relay(hub_store, holder="hub-user", lease_duration_s=60, heartbeat_s=20)
    relay.init()
    with relay.leg(wait=False) as leg:
        work = tmp_path / "w"
        work.mkdir()
        (work / "metrics.jsonl").write_text('{"metrics_version": "1.0", "step": 1, "loss": 4.0}\n'
                                            '{"metrics_version": "1.0", "step": 2, "loss": 3.5}\n')
        leg.push(work, {"steps": 2, "tokens": 64, "loss_start": 4.0, "loss_end": 3.5})
    held = relay.claim(wait=False)
    held.close()
    snap = DashboardReader(hub_store).read()
    assert snap.source.store_kind == "hub" and snap.source.revision == hub_store.head()
    assert snap.baton.status == "held" and snap.baton.last_renewal_time is not None
    assert [r.leg for r in snap.ledger] == [1] and snap.series["loss"].values == [4.0, 3.5]
    dumped = snap.model_dump_json() + render_page(snap, refresh_s=30)
    assert "hf_fake_token" not in dumped and "fake_token" not in dumped
    # The way the CLI opens it: a spec, the endpoint from HF_ENDPOINT, the token from HF_TOKEN.
    monkeypatch.setenv("HF_TOKEN", "hf_env_secret_42")
    by_spec = DashboardReader(open_store(f"hf://{hub_store.repo_id}")).read()
    assert by_spec.source.store == f"hf://{hub_store.repo_id}" and by_spec.baton.holder == "hub-user"
    assert "hf_env_secret_42" not in by_spec.model_dump_json() + render_page(by_spec, refresh_s=30)


def test_the_live_metrics_tail_parses_only_new_complete_lines_and_rereads_a_replaced_file(tmp_path):
    from colibri_relay.dashboard.metrics_reader import MetricsTail

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    tail = MetricsTail(path, "live")
    first = tail.read()
    assert [p.step for p in first.points] == [1] and first.incomplete_tail
    with open(path, "ab") as f:
        f.write(b'ss": 2.5}\nnot json\n{"step": 3, "loss": 2.0}\n')
    second = tail.read()
    assert [(p.step, p.values["loss"]) for p in second.points] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert not second.incomplete_tail and any("live line 3: not valid JSON" in p for p in second.problems)
    replacement = tmp_path / "new.jsonl"  # a resumed trainer rewrites the file atomically
    replacement.write_bytes(b'{"step": 1, "loss": 9.0}\n')
    replacement.replace(path)
    assert [(p.step, p.values["loss"]) for p in tail.read().points] == [(1, 9.0)]


def test_legs_whose_steps_restart_are_drawn_one_after_another_and_flagged(tmp_path):
    store = LocalStore(tmp_path / "s")
    relay = Relay(store, holder="gen", lease_duration_s=60, heartbeat_s=20)
    relay.init()
    # Each leg's payload holds only its own metrics, counting from step 0; leg 3 re-pushes leg 2's file.
    files = [[{"step": s, "reward": leg * 10 + s} for s in range(5)] for leg in (1, 2)]
    files.append(files[1])
    for number, lines in enumerate(files, 1):
        work = tmp_path / f"w{number}"
        work.mkdir()
        (work / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (work / "weights.bin").write_bytes(bytes([number]))
        with relay.leg(wait=False) as leg:
            leg.push(work, {"steps": 5})
    snap = DashboardReader(store).read()
    assert [(s.first_step, s.last_step, s.points) for s in snap.legs] == [(0, 4, 5), (5, 9, 5), (None, None, 0)]
    assert snap.series["reward"].values == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
    assert any("leg 2: its metrics restart at step 0" in p and "drawn from step 5" in p for p in snap.problems)
    assert any("leg 3: its metrics add no step after step 9" in p for p in snap.problems)
