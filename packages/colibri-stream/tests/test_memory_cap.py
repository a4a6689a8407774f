"""`ram_budget="auto"`: reading cgroup v1/v2 limits, fitting under them (a real cgroup where the
machine allows), and both byte counters on every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from colibri_stream import BudgetError, Engine, MemoryCap, MemoryCapWarning, read_memory_cap
from colibri_stream.io.accounting import IOWindow, agreement
from colibri_stream.io.memory_cap import MIN_MARGIN_BYTES, RUNTIME_FILE_BYTES

STATUS = "Name:\tpython\nRssAnon:\t  300000 kB\nRssFile:\t  100000 kB\nRssShmem:\t       4 kB\n"


def fake_proc(root: Path, cgroup: str, mountinfo: str, meminfo_kib: int = 8_000_000) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "self" / "status").write_text(STATUS)
    (proc / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemAvailable: {meminfo_kib} kB\n")
    return proc


def test_v2_limit_of_the_process_cgroup_and_its_ancestors(tmp_path):
    mount = tmp_path / "cg2"
    job = mount / "batch" / "job 1"  # a space: mountinfo and cgroup paths escape nothing here
    job.mkdir(parents=True)
    (mount / "batch" / "memory.max").write_text("2000000000\n")  # the parent's is smaller: it counts
    (job / "memory.max").write_text("3000000000\n")
    (job / "memory.stat").write_text("anon 500000000\nfile 900000000\nfile_mapped 20000000\nshmem 0\n")
    proc = fake_proc(tmp_path, "0::/batch/job 1\n",
                     f"30 1 0:26 / {str(mount).replace(' ', chr(92) + '040')} rw - cgroup2 cgroup2 rw\n")
    cap = read_memory_cap(proc)
    assert cap.limit_bytes == 2_000_000_000 and cap.source.startswith("cgroup v2")
    # the cgroup's anon beats this process's 300 MB; file pages (even mapped ones) are reclaimable
    assert cap.charged_bytes == 500_000_000
    assert cap.available_bytes == 2_000_000_000 - 500_000_000
    room = cap.available_bytes - RUNTIME_FILE_BYTES
    assert cap.budget_bytes == room - int(0.10 * room)
    assert "limit 2.00 GB - charged now 500.0 MB" in cap.describe()


def test_v1_memory_controller_with_the_cgroup_as_mount_root(tmp_path):
    mount = tmp_path / "memory"
    mount.mkdir()
    (mount / "memory.limit_in_bytes").write_text("1000000000\n")
    (mount / "memory.stat").write_text("total_rss 100000000\ntotal_mapped_file 1000000\ntotal_shmem 0\n")
    proc = fake_proc(tmp_path, "5:memory:/docker/abc\n1:name=systemd:/\n0::/\n",
                     f"40 1 0:30 /docker/abc {mount} rw - cgroup cgroup rw,memory\n"
                     f"41 1 0:31 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n")
    cap = read_memory_cap(proc)
    assert cap.source.startswith("cgroup v1") and cap.limit_bytes == 1_000_000_000
    assert cap.charged_bytes == 300_004 * 1024  # this process (RssAnon + RssShmem) beats the cgroup's


def test_no_limit_falls_back_to_mem_available(tmp_path):
    mount = tmp_path / "memory"
    mount.mkdir()
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    proc = fake_proc(tmp_path, "5:memory:/\n", f"40 1 0:30 / {mount} rw - cgroup cgroup rw,memory\n", 150_000)
    cap = read_memory_cap(proc)
    assert cap.limit_bytes is None and cap.available_bytes == 150_000 * 1024 and cap.charged_bytes == 0
    assert cap.margin_bytes == MIN_MARGIN_BYTES and "MemAvailable" in cap.describe()


def test_auto_fits_under_the_cap_or_refuses_with_the_numbers(tiny, monkeypatch):
    import colibri_stream.assembly as assembly

    plan = Engine.plan(tiny[0])
    roomy = MemoryCap("cgroup v1 /test", 3_000_000_000, 2_000_000_000, 1_000_000_000)
    monkeypatch.setattr(assembly, "read_memory_cap", lambda: roomy)
    with Engine.open(tiny[0], ram_budget="auto") as eng:
        assert eng.budget.ram_budget == roomy.budget_bytes and eng.opened_plan.memory_cap is roomy
        assert eng.budget.slots == 48
    tight = MemoryCap("cgroup v1 /test", 600_000_000, plan.smallest_budget // 2, 600_000_000 - plan.smallest_budget // 2)
    monkeypatch.setattr(assembly, "read_memory_cap", lambda: tight)
    with pytest.raises(BudgetError) as info:  # (every projection held: map_weights="off")
        Engine.open(tiny[0], ram_budget="auto", map_weights="off")
    message = str(info.value)
    assert message.startswith("ram budget auto: cgroup v1 /test: limit 600.0 MB - charged now")
    assert "runtime file pages" in message and "margin" in message and "too small" in message
    assert info.value.minimum_bytes == plan.smallest_budget


def test_a_stated_budget_over_what_the_cap_leaves_warns_before_the_oom_killer_would(tiny, monkeypatch):
    import warnings

    import colibri_stream.assembly as assembly

    plan = Engine.plan(tiny[0])
    available = 2 * plan.smallest_budget + RUNTIME_FILE_BYTES + 2 * MIN_MARGIN_BYTES
    cap = MemoryCap("cgroup v2 /test", available + 100_000_000, available, 100_000_000)
    assert cap.budget_bytes >= plan.smallest_budget
    budget = cap.budget_bytes + (8 << 20)
    monkeypatch.setattr(assembly, "read_memory_cap", lambda: cap)
    with pytest.warns(MemoryCapWarning, match=r"ram budget .* is more than this process's memory cgroup leaves "
                                              r"for it \(cgroup v2 /test: limit .* = budget .*\).*--ram-budget auto"):
        Engine.plan(tiny[0], ram_budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryCapWarning)
        Engine.plan(tiny[0], ram_budget=cap.budget_bytes)  # what auto would pick: no warning
        Engine.plan(tiny[0])  # no budget stated
        no_limit = MemoryCap("MemAvailable", None, cap.budget_bytes // 2, 0)
        monkeypatch.setattr(assembly, "read_memory_cap", lambda: no_limit)
        Engine.plan(tiny[0], ram_budget=budget)  # no cgroup: RAM, not a kill, is what runs short


def test_both_byte_counters_and_the_direction_of_a_disagreement(tiny):
    assert IOWindow(10_000_000, 0).agreement == "served from page cache"
    assert IOWindow(10_000_000, 12_000_000).agreement == "re-read under pressure"
    assert IOWindow(10_000_000, 10_100_000).agreement == "agree"  # within 2%
    assert agreement(10, None) == "unavailable"
    with Engine.open(tiny[0], ram_budget=Engine.plan(tiny[0]).min_budget + 4 * 49152) as eng:
        eng.generate(list(range(900, 910)), 4, stop_token_ids=[])  # first-use imports and faults
        # the mapped embedding's rows fault in with the kernel's read-around (128 KB a fault): a
        # page cache that lost the file would put those reads beside the engine's few expert reads
        Path(tiny[0]).read_bytes()
        eng.reset_stats()
        assert eng.stats.bytes_read == 0 and eng.stats.bytes_read_os == 0
        eng.generate(list(range(900, 930)), 16, stop_token_ids=[])
        stats = eng.stats.to_dict()
    assert stats["bytes_read"] > 0 and stats["bytes_read_os"] is not None
    if eng.stats.io_mode == "direct" and eng.stats.filesystem not in ("tmpfs", "ramfs"):
        assert stats["io_agreement"] == "agree", stats  # O_DIRECT: every engine byte reached storage
        assert abs(stats["bytes_read_os"] - stats["bytes_read"]) <= 64 * 1024


def test_generate_under_a_real_memory_cgroup(tiny):
    """`colibri-stream generate --ram-budget auto` in a child memory cgroup: the plan of a process
    in the same cap says what is charged; the cap leaves room for the minimum plus a few experts
    (the tiny model's whole cache is 2.4 MB, so whether it fits in full is up to the margin), and
    the run must finish with its anonymous RSS under the limit, never OOM-killed."""
    from colibri_stream.studies.memory_cgroup import cgroup_unavailable, run_capped

    reason = cgroup_unavailable()
    if reason:
        pytest.skip(f"no memory cgroup to run in: {reason}")
    cli = str(Path(sys.executable).with_name("colibri-stream"))
    plan = Engine.plan(tiny[0])
    probe = run_capped([cli, "plan", str(tiny[0]), "--ram-budget", "auto", "--json"], 2_000_000_000)
    assert probe.returncode == 0, probe.stderr
    charged = json.loads(probe.stdout)["memory_cap"]["charged_bytes"]
    # room for the minimum plus about 8 of the 48 experts once charged, file pages and margin are paid
    wanted = plan.budget_for_slots(8)
    limit = charged + 24 * 1024 * 1024 + RUNTIME_FILE_BYTES + max(MIN_MARGIN_BYTES, int(wanted / 9)) + wanted
    run = run_capped([cli, "generate", str(tiny[0]), "--prompt", "Hello there, little bird", "--ram-budget", "auto",
                      "--max-new-tokens", "8", "--threads", "1", "--json"], limit)
    assert run.returncode == 0 and run.oom_kills == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert plan.min_budget <= out["budget"]["ram_budget"] < limit - charged
    assert out["budget"]["cache_slots"] >= 1
    assert out["stats"]["misses"] > 0 and out["stats"]["bytes_read_os"] is not None
    assert run.peak_rss_anon < limit
