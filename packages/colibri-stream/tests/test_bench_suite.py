"""The benchmark's parts: /proc/self/io accounting, O_DIRECT bandwidth, the synthetic container,
the policy / prefetch / warm studies on a tiny container, and the bench-suite CLI's refusals."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from colibri_int4 import Container
from colibri_stream import Engine, TraceEvent
from colibri_stream.cli.bench_suite import bench_suite, goals
from colibri_stream.io import accounting
from colibri_stream.io.accounting import IOMeter, IOWindow, ProcIOUnavailable, ReadBytesCounter, read_proc_io
from colibri_stream.studies.cache_studies import (
    policy_study,
    prefetch_study,
    random_trace_like,
    routing_trace,
    text_trace,
    warm_run,
)
from colibri_stream.studies.disk_bandwidth import measure_read_bandwidth
from colibri_stream.studies.synthetic_container import synthetic_container
from colibri_stream.studies.trained_workload import heldout_prompts, tuning_prompts


def test_io_window_flags_contamination_both_ways():
    assert not IOWindow(10_000_000, 10_100_000).contaminated  # 1% apart
    cached = IOWindow(10_000_000, 0)  # the page cache served every miss
    assert cached.contaminated and "PAGE-CACHE" in cached.verdict()
    extra = IOWindow(10_000_000, 10_500_000)
    assert extra.contaminated and "EXTRA" in extra.verdict()
    assert not IOWindow(0, 4096).contaminated  # a page of metadata is not contamination
    assert IOWindow(0, 10_000_000).contaminated
    assert IOWindow(5, 0).to_dict()["page_cache_contaminated"] is False  # under the absolute slack


def test_proc_io_parsing(tmp_path):
    fake = tmp_path / "io"
    fake.write_text("rchar: 10\nwchar: 3\nread_bytes: 4096\nwrite_bytes: 0\n")
    assert read_proc_io(str(fake)) == {"rchar": 10, "wchar": 3, "read_bytes": 4096, "write_bytes": 0}
    fake.write_text("rchar: 10\n")
    with pytest.raises(ProcIOUnavailable, match="read_bytes"):
        read_proc_io(str(fake))
    with pytest.raises(ProcIOUnavailable, match="cannot read"):
        read_proc_io(str(tmp_path / "missing"))


def test_the_read_bytes_counter_keeps_its_file_open_and_reopens_it_in_a_forked_child(tmp_path, monkeypatch):
    fake = tmp_path / "io"
    fake.write_text("rchar: 10\nread_bytes: 100\n")
    counter = ReadBytesCounter(str(fake))
    fake.write_text("rchar: 99\nread_bytes: 350\n")  # the same file, read again from its start
    assert counter.since() == 250
    open_files = len(os.listdir("/proc/self/fd"))
    opened = []
    real_open = os.open
    monkeypatch.setattr(accounting.os, "open", lambda *a: opened.append(a[0]) or real_open(*a))
    assert counter.since() == 250 and not opened  # the same process: the open file, read again
    monkeypatch.setattr(accounting.os, "getpid", lambda: -1)  # as in a child after fork
    fake.write_text("rchar: 99\nread_bytes: 400\n")
    assert counter.since() == 300 and opened == [str(fake)]  # opened again, by the "child"
    assert len(os.listdir("/proc/self/fd")) == open_files  # the parent's descriptor closed, not leaked
    assert ReadBytesCounter(str(tmp_path / "missing")).since() is None
    fake.write_text("rchar: 1\n")
    assert counter.since() is None  # no read_bytes line: unavailable, not an exception


def test_engine_bytes_agree_with_the_os(tiny, minimum_budget):
    base = minimum_budget(tiny[0])
    with Engine.open(tiny[0], ram_budget=base) as eng:
        # read_bytes is process-wide: a module imported lazily on the first generate can reach
        # the disk inside the window (seen once after an edit); warm those imports up first
        eng.generate("warm up", 2, stop_token_ids=[])
        eng.cache.clear()
        eng.reset_stats()
        with IOMeter() as meter:
            eng.generate(list(range(500, 540)), 8, stop_token_ids=[])
        window = meter.window(eng.stats.bytes_read)
        assert eng.stats.bytes_read > 0
        if eng.stats.io_mode == "direct" and eng.stats.filesystem not in ("tmpfs", "ramfs"):
            assert not window.contaminated, window.verdict()


def test_bandwidth_reads_blob_sized_ranges(tiny):
    with Container.open(tiny[0]) as c:
        offsets = [e.offset for e in c.header.experts.entries]
        blob = c.header.experts.blob_length
    bw = measure_read_bandwidth(tiny[0], offsets, blob, max_bytes=blob * 10)
    assert bw.reads == 10 and bw.bytes_read == 10 * blob and bw.bytes_per_s > 0
    assert bw.to_dict()["read_size"] == blob
    with pytest.raises(ValueError):
        measure_read_bandwidth(tiny[0], [], blob)


def test_synthetic_container_is_valid_and_removed(tmp_path):
    with synthetic_container(tmp_path, "tiny", n_experts=16, n_layers=3) as path:
        with Container.open(path) as c:
            assert c.verify().failures == []
            assert len(c.header.experts.entries) == 2 * 16
        with Engine.open(path, ram_budget="300MB") as eng:
            assert len(eng.generate("hello", 4, stop_token_ids=[]).token_ids) == 4
    assert not path.exists() and not list(tmp_path.iterdir())


def test_prompts_split_tuning_from_heldout():
    tune, held = tuning_prompts(4, 300), heldout_prompts(4, 300)
    assert len(tune) == len(held) == 4 and all(len(p) > 200 for p in tune + held)
    assert not set(tune) & set(held)


def test_studies_on_a_tiny_container(tiny):
    tune, shape = routing_trace(tiny[0], ["The river town grew slowly."], 8)
    held, _ = text_trace(tiny[0], ["Its mills ran on water until the railway came, and with it coal."], 64)
    assert len({e.step for e in held}) == len(held) // 3  # one token per step, 3 MoE layers
    assert all(len(e.experts) == 1 for e in held)  # top-1 serving, one token: decode-shaped
    assert shape["total_experts"] == 48 and shape["top_k"] == 1
    rnd = random_trace_like(held, shape["n_experts"])
    assert [len(e.experts) for e in rnd] == [len(e.experts) for e in held]
    study = policy_study(tune, held, shape["total_experts"], shape["n_experts"], shape["top_k"], [0.25, 1.0])
    assert study["default_policy"] in study["heldout_mean_hit_rate"]
    for point in study["points"]:
        for trace in ("tuning", "heldout", "shuffled", "random"):
            ceiling = point[trace]["belady_hit_rate"]
            assert all(point[trace][p]["hit_rate"] <= ceiling + 1e-9 for p in ("lru", "lfu", "lru-layer", "pinned"))
    full = study["points"][1]["heldout"]
    assert full["lru"]["hit_rate"] == full["belady_hit_rate"]  # everything fits: only cold misses

    pf = prefetch_study(tiny[0], ["The river town grew slowly."], 0.25, 1, 12, log=lambda m: None)
    assert pf["predict"]["prefetch_issued"] == 0 and 0 <= pf["predict"]["prefetch_accuracy"] <= 1
    assert pf["on"]["prefetch_issued"] > 0 and pf["off"]["prefetch_issued"] == 0
    layers = pf["predict"]["per_layer"]  # every MoE layer after the first is predicted from the one before
    assert set(layers) == {"1", "2", "3"} and layers["1"]["prefetch_accuracy"] == 0.0
    assert all(0 <= layers[k]["prefetch_accuracy"] <= 1 for k in ("2", "3"))
    assert pf["off"]["bytes_read_per_token"] > 0
    warm = warm_run(tiny[0], ["The river town grew slowly."], 6)
    assert warm["misses"] == 0 and warm["hits"] > 0 and 0 <= warm["outside_compute_fraction"] <= 1


def test_shuffled_steps_keep_each_pass_and_break_locality():
    import random

    from colibri_stream.cache.replay import belady
    from colibri_stream.studies.cache_studies import shuffled_steps

    rng = random.Random(0)
    sticky, expert = [], 0
    for step in range(400):  # each layer's expert changes only every ~10 tokens: strong locality
        if rng.random() < 0.1:
            expert = rng.randrange(32)
        sticky += [TraceEvent(step, 1, (expert,)), TraceEvent(step, 2, ((expert * 7) % 32,))]
    mixed = shuffled_steps(sticky)
    assert [e.step for e in mixed] == [e.step for e in sticky]  # same shape, steps renumbered
    passes = lambda trace: sorted(tuple(e.experts for e in trace if e.step == s) for s in range(400))  # noqa: E731
    assert passes(mixed) == passes(sticky)  # every pass intact, only the order changed
    assert belady(sticky, 8).hit_rate > 0.85 > 0.5 > belady(mixed, 8).hit_rate


def test_goals_summary_reads_the_report():
    point = {"budget_fraction": 0.25, "heldout": {"lru": {"vs_belady": 0.93}, "lfu": {"vs_belady": 0.95},
                                                  "belady_hit_rate": 0.8, "static_oracle_hit_rate": 0.6},
             "shuffled": {"belady_hit_rate": 0.76}}
    nano_off, nano_on = {"tokens_per_s": 2.0, "contaminated": False}, {"tokens_per_s": 2.5}
    report = {"workloads": {
        "trained": {
            "policies": {"points": [point], "default_policy": "lfu"},
            "warm": {"outside_compute_fraction": 0.1},
            "prefetch": {"predict": {"prefetch_accuracy": 0.8}, "speedup_on_vs_off": 1.1},
            "sweep": {"points": [{"contaminated": True}]}},
        "nano": {"sweep": {"points": [nano_off]}, "sweep_prefetch_on": {"points": [nano_on]}}}}
    g = goals(report)
    assert g["hit_rate_vs_belady_at_25pct"] == {"target": 0.9, "lru": 0.93, "lfu": 0.95, "static_oracle": 0.75,
                                                "belady_shuffled": 0.95}
    assert g["nano_prefetch_speedup"] == 1.25 and "micro_prefetch_speedup" not in g
    assert g["page_cache_contaminated_workloads"] == ["trained"]


def test_cli_refuses_bad_budgets_and_tmpfs(tmp_path):
    runner = CliRunner()
    result = runner.invoke(bench_suite, ["--workdir", str(tmp_path), "--budgets", "25%,lots"])
    assert result.exit_code == 2 and "--budgets" in result.output and "Traceback" not in result.output
    result = runner.invoke(bench_suite, ["--workdir", str(tmp_path), "--budgets", "150%"])
    assert result.exit_code == 2
    result = runner.invoke(bench_suite, ["--workdir", "/dev/shm/colibri-bench-test"])
    if result.exit_code == 2:
        assert "tmpfs" in result.output
    assert "--workload" in runner.invoke(bench_suite, ["--help"]).output


def test_suite_trained_workload_end_to_end(tmp_path):
    """The whole trained-workload study on a 3-step model (about 20 s): training on the bundled
    prose, export, sweep, policy study (traces kept for policy-study), prefetch study, warm run."""
    import json

    from colibri_stream.io.direct_io import RAM_FILESYSTEMS, filesystem_type
    from colibri_stream.traces.routing_trace import read_trace

    if filesystem_type(tmp_path) in RAM_FILESYSTEMS:
        pytest.skip("the suite refuses a workdir on tmpfs")
    out = tmp_path / "suite.json"
    result = CliRunner().invoke(bench_suite, [
        "--workdir", str(tmp_path / "work"), "--workload", "trained", "--train-steps", "3", "--repeats", "1",
        "--budgets", "25%", "--max-new-tokens", "4", "--bandwidth-mb", "4", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    trained = report["workloads"]["trained"]
    assert trained["train_steps"] == 3 and [p["budget_fraction"] for p in trained["policies"]["points"]] == [0.25]
    held = read_trace(trained["traces"]["heldout"])
    assert held.header.n_moe_layers * held.header.n_experts == 128 and held.header.top_k == 1
    assert sum(len(e.experts) for e in held.events) == trained["policies"]["trace_accesses"]["heldout"]
    assert set(report["goals"]["hit_rate_vs_belady_at_25pct"]) >= {"target", "lru", "static_oracle", "belady_shuffled"}
    assert "same passes shuffled" in result.output and "warm run" in result.output
