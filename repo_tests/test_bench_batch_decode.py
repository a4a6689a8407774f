"""bench/batch_decode.py at the smoke scale (the tiny preset, 4 new tokens, f32 kernels): both arms
run, give the same greedy tokens (the script asserts it under f32), and the batched arm takes one
pass per step where the other takes one per row and step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "batch_decode.py"


def test_batch_decode_bench_smoke(tmp_path):
    args = ["--preset", "tiny", "--layers", "4", "--new-tokens", "4", "--repeats", "1", "--kernel-dtype", "f32",
            "--share", "0.3", "--workdir", str(tmp_path)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["rows_with_same_tokens"] == 4
    assert out["one_by_one"]["passes"] == 1 + 4 * 3 and out["batched"]["passes"] == 1 + 3
    # a step asks once per distinct expert: never more lookups than the rows one by one
    assert out["batched"]["decode_expert_requests"] <= out["one_by_one"]["decode_expert_requests"]
    assert out["batched"]["io_agreement"] == "agree"
