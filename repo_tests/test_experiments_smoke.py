"""The four findings' experiments (bench/experiments/) end to end at the smoke scale: a few steps
of a 2-layer model through the real tokenizer trainer, prepare, Trainer and metrics.jsonl, the
results JSON read back through its schema check, and the PNG written. Seconds each."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "bench" / "experiments"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(name: str):
    """bench/experiments/NAME.py as a module (the scripts import their siblings by name)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments-work")  # data and tokenizer shared by the tests


def _run(name: str, work: Path, out: Path, *extra: str) -> dict:
    doc = _load(name).main(["--scale", "smoke", "--work", str(work), "--out", str(out), *extra])
    png = out / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size < 300_000  # small enough to commit
    assert doc["experiment"] == name and doc["runs"]
    assert json.loads((out / f"{name}.json").read_text()) == doc
    return doc


def test_routing_top_k(work, tmp_path):
    doc = _run("routing_top_k", work, tmp_path, "--seeds", "0")
    by = {r["top_k_train"]: r for r in doc["runs"]}
    # at top-1 the LM loss sends the router no gradient: only AdamW's weight decay shrinks W, by at
    # most lr * wd per step; at top-2 the router learns and moves far more
    steps = doc["settings"]["scale"]["steps"]
    decay_only = steps * 3e-3 * 0.1
    assert by[1]["final"]["router_change"] <= decay_only * 1.001
    assert by[2]["final"]["router_change"] > 2 * decay_only
    assert by[1]["curves"]["probe"]["step"][0] == 0 and by[1]["curves"]["probe"]["flipped_share"][0] == 0.0
    assert set(doc["summary"]) == {"router_change", "flipped_share", "top1_entropy", "val_loss_top1"}


def test_balancing_gamma(work, tmp_path):
    doc = _run("balancing_gamma", work, tmp_path, "--seeds", "0")
    assert [r["gamma"] for r in doc["runs"]] == [0.0, 1e-3, 1e-2]
    for r in doc["runs"]:
        cache = r["cache"]
        assert 0 < cache["belady_hit_rate"] <= 1
        assert cache["default_hit_rate"] <= cache["belady_hit_rate"] + 1e-12  # MIN bounds every policy
        assert cache["lru_hit_rate"] <= cache["belady_hit_rate"] + 1e-12
        assert r["curves"]["router"]["step"]
    # one seed: no spread to compare with, and the summary says so instead of claiming a difference
    assert doc["summary"]["max_vio"]["exceeds_seed_spread"]["off_vs_default"] is None


def test_wsd_continuation(work, tmp_path):
    doc = _run("wsd_continuation", work, tmp_path, "--seeds", "0", "--steps", "10")
    names = [r["name"] for r in doc["runs"]]
    assert names == ["cosine_N", "cosine_continued_1.5N", "wsd_stable_trunk", "wsd_N", "wsd_resumed_1.5N"]
    final = {r["name"]: r["final"]["step"] for r in doc["runs"]}
    assert final["cosine_N"] == final["wsd_N"] == 10 and final["wsd_resumed_1.5N"] == 15
    assert final["cosine_continued_1.5N"] == 15  # the continuation's own steps, shifted to the common axis
    lr = {r["name"]: r["curves"]["lr"] for r in doc["runs"]}
    assert lr["cosine_continued_1.5N"]["lr"][0] < lr["cosine_continued_1.5N"]["lr"][1]  # re-warmed
    assert lr["wsd_resumed_1.5N"]["lr"][-1] == pytest.approx(0.1 * max(lr["wsd_stable_trunk"]["lr"]))


def test_moe_vs_dense(work, tmp_path):
    doc = _run("moe_vs_dense", work, tmp_path, "--seeds", "0")
    params = doc["summary"]["params"]
    # equal active parameters at top-2 up to the routers (E x d per MoE layer)
    moe, dense = params["moe"]["active_params_train"], params["dense"]["active_params_train"]
    assert abs(moe - dense) / dense < 0.05
    assert params["moe"]["total_params"] > params["dense"]["total_params"]
    assert len(doc["summary"]["tasks"]) == 7


def test_demo_balance(work, tmp_path):
    doc = _run("demo_balance", work, tmp_path, "--steps", "4")
    for r in doc["runs"]:
        # sign updates move each bias by exactly gamma per optimizer step
        assert max(r["final"]["max_abs_bias"]) <= r["gamma"] * 4 + 1e-6


def test_bad_results_document_is_named(tmp_path):
    report = _load("report")
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"experiment_version": "9.0"}))
    with pytest.raises(report.ExperimentFormatError, match=r"x\.json: experiment_version 9\.0 is not supported"):
        report.read_result(path)
    path.write_text(json.dumps({"experiment_version": "1.0", "experiment": "e"}))
    with pytest.raises(report.ExperimentFormatError, match="missing field 'finding'"):
        report.read_result(path)
    path.write_text("{")
    with pytest.raises(report.ExperimentFormatError, match="not JSON"):
        report.read_result(path)


def test_bad_flags_exit_2(tmp_path, capsys):
    runs = _load("runs")
    for argv in (["--seeds", "a,b"], ["--scale", "huge"], ["--steps", "1"]):
        with pytest.raises(SystemExit) as exc:
            runs.experiment_args("x", argv)
        assert exc.value.code == 2
    assert "--seeds 'a,b'" in capsys.readouterr().err


def test_diloco_rounds(work, tmp_path):
    doc = _run("diloco_rounds", work, tmp_path, "--seeds", "0", "--steps", "16", "--inner-steps", "2")
    by = {r["name"]: r for r in doc["runs"]}
    assert {"k1", "k2", "k4", "k4_fp32", "k4_late_reject", "k4_late_discount", "k4_late_as_is"} <= set(by)
    # equal tokens, one shared init: every arm starts from the same model and, but for the
    # late-worker arms, ends having trained the same tokens
    assert len({r["points"][0]["top2"]["val_loss"] for r in doc["runs"]}) == 1
    assert {by[n]["final"]["tokens"] for n in ("k1", "k2", "k4", "k4_fp32")} == {16 * 4 * 32}
    assert by["k4_late_reject"]["final"]["tokens"] < by["k4_late_as_is"]["final"]["tokens"] < by["k4"]["final"]["tokens"]
    int8, fp32 = by["k4"]["rounds"][0]["contribution_bytes"], by["k4_fp32"]["rounds"][0]["contribution_bytes"]
    assert 3.5 < fp32 / int8 < 4.0  # 1 + 4/256 bytes per value against 4
    assert all(0 <= p["top1"]["dead_experts"] for r in doc["runs"] for p in r["points"])


def test_diloco_rounds_with_split_batches(work, tmp_path):
    doc = _run("diloco_rounds", work, tmp_path, "--seeds", "0", "--steps", "8", "--inner-steps", "2", "--split-batch",
               "--outer-lr", "1.0", "--outer-momentum", "0", "--ablations", "")
    by = {r["name"]: r for r in doc["runs"]}
    assert set(by) == {"k1", "k2", "k4"}
    # the batch splits over the workers: every arm takes K=1's steps and trains K=1's tokens
    assert (by["k2"]["worker_batch"], by["k4"]["worker_batch"]) == (2, 1)
    assert {r["final"]["step"] for r in doc["runs"]} == {8}
    assert {r["final"]["tokens"] for r in doc["runs"]} == {8 * 4 * 32}
    assert by["k4"]["outer_momentum"] == 0.0 and doc["settings"]["split_batch"] is True


def test_diloco_rounds_with_chosen_workers_and_inner_lr(work, tmp_path):
    doc = _run("diloco_rounds", work, tmp_path, "--seeds", "0", "--steps", "8", "--inner-steps", "2", "--split-batch",
               "--outer-lr", "1.0", "--outer-momentum", "0", "--ablations", "", "--workers", "4",
               "--inner-lr", "2e-3")
    by = {r["name"]: r for r in doc["runs"]}
    assert set(by) == {"k1", "k4"}  # K=1 always, then only the arms asked for
    assert by["k4"]["inner_lr"] == 2e-3 and doc["settings"]["inner_lr"] == 2e-3  # read back from the base
    assert "vs_k1_equal_tokens" in doc["summary"]["k4"]


def test_diloco_rounds_with_a_larger_global_batch(work, tmp_path):
    doc = _run("diloco_rounds", work, tmp_path, "--seeds", "0", "--steps", "8", "--inner-steps", "2", "--split-batch",
               "--batch-size", "8", "--outer-lr", "1.0", "--outer-momentum", "0", "--ablations", "", "--workers", "4")
    by = {r["name"]: r for r in doc["runs"]}
    # K=1 takes the global batch of 8 a step, each of the 4 workers its share of 2: equal tokens
    assert doc["settings"]["batch_size"] == 8 and by["k4"]["worker_batch"] == 2
    assert {r["final"]["tokens"] for r in doc["runs"]} == {8 * 8 * 32}
    assert doc["settings"]["val_windows"] == 64  # the same validation windows whatever the batch


def test_diloco_rounds_refuses_a_batch_of_no_sequences(capsys):
    with pytest.raises(SystemExit) as exc:
        _load("diloco_rounds").main(["--batch-size", "0"])
    assert exc.value.code == 2 and "--batch-size 0" in capsys.readouterr().err
