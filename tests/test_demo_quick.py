"""A shortened `make demo`: the whole loop through the real command lines, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from colibri_relay import Relay


def test_quick_demo_runs_the_whole_loop(tmp_path):
    out = tmp_path / "demo"
    # One intra-op thread: on a shared 2-core box torch's pool spins on contended cores; under six
    # busy processes the quick demo took 737 s with the default 2 threads (pytest's limit is 900 s)
    # and 333 s with one. What the demo shows does not depend on the thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "colibri.cli", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    summary = json.loads((out / "demo-summary.json").read_text())

    # 1. three pretraining legs by alice, bob and dave (who took over from the killed carol), 2. SFT
    ledger = Relay(str(out / "relay")).ledger()
    assert [e.holder for e in ledger] == ["alice", "bob", "dave", "erin"]
    assert ledger[3].model_dump()["kind"] == "sft"
    assert summary["takeover"]["killed"] == "carol" and "carol" not in [e.holder for e in ledger]
    # the routers' balance after the legs, read from the run's metrics.jsonl (tiny: 3 MoE layers x 8)
    assert summary["routing"]["routed_experts"] == 24 and len(summary["routing"]["max_vio"]) == 3
    # 3. int4 container, 4. streamed generation with misses, 5. eval results, 6. ledger printed
    assert summary["container"]["bytes"] > 0 and summary["container"]["bits_per_weight"] < 6
    gen = summary["generation"]
    assert gen["stats"]["misses"] > 0 and gen["cache_slots"] < gen["total_experts"]
    assert gen["stats"]["bytes_read"] > 0
    from colibri_eval import read_results

    tasks = {"lambada_openai", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa", "hellaswag"}
    assert len(summary["eval"]["results"]) == 2  # the checkpoint and the int4 container
    for path in summary["eval"]["results"]:
        read_results(path)  # a valid, versioned results file
        scored = json.loads(open(path).read())["tasks"]
        assert set(scored) == tasks, path
        for task, entry in scored.items():
            metrics = entry["metrics"]
            assert 0.0 <= metrics["acc"]["value"] <= 1.0 and entry["n"] == 8, (task, entry)
    assert "dashboard" in done.stdout and "legs    4 pushed" in done.stdout
