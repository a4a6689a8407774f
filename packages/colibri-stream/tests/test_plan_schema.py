"""`colibri-stream plan --json` against its spec (PLAN.md): every key it writes is in the tables,
nothing else is, and the "present" column says which options make a key appear."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from colibri_stream import Engine, TraceEvent, write_trace
from colibri_stream.cli import main
from colibri_stream.plan import PLAN_VERSION

PLAN_MD = Path(__file__).resolve().parents[1] / "src" / "colibri_stream" / "PLAN.md"
QWEN3_30B = Path(__file__).parent / "fixtures" / "qwen3_30b_a3b"
GPT_OSS_20B = Path(__file__).parent / "fixtures" / "gpt_oss_20b"


def documented(heading: str) -> dict[str, str]:
    """{key: its "present" cell} of the table right under `heading`."""
    text = PLAN_MD.read_text()
    section = text[text.index(heading) + len(heading):]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith(("| field", "|---")):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            assert len(cells) == 5, line  # field, type, unit, present, meaning
            for key in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[key] = cells[3]
    return rows


def plan_json(*args) -> dict:
    result = CliRunner().invoke(main, ["plan", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture(scope="module")
def trace(tiny, tmp_path_factory) -> Path:
    f = Engine.plan(tiny[0]).footprint
    layers = f.total_experts // f.n_experts
    events = [TraceEvent(step, layer, ((step + layer) % f.n_experts, (step + layer + 1) % f.n_experts))
              for step in range(20) for layer in range(layers)]
    return write_trace(tmp_path_factory.mktemp("plan") / "trace.jsonl", events, n_moe_layers=layers,
                       n_experts=f.n_experts, top_k=2)


def test_the_keys_written_are_the_keys_documented(tiny, trace):
    top = documented("## Top level")
    plain = plan_json(tiny[0])
    budget = plan_json(tiny[0], "--ram-budget", "200MB")
    target = plan_json(tiny[0], "--trace", trace, "--hit-rate", "0.5")
    auto = plan_json(tiny[0], "--ram-budget", "auto")
    hf = plan_json(QWEN3_30B)
    sliding = plan_json(GPT_OSS_20B / "config.json")
    assert set(plain) | set(budget) | set(target) | set(auto) | set(hf) | set(sliding) == set(top)
    assert set(plain) == {k for k, when in top.items() if when == "always"}
    assert set(budget) - set(plain) == {k for k, when in top.items() if when == "with `--ram-budget`"}
    assert set(target) - set(plain) == {k for k, when in top.items() if "`--hit-rate`" in when}
    assert set(auto) - set(budget) == {k for k, when in top.items() if when == "with `--ram-budget auto`"}
    assert set(hf) - set(plain) == {k for k, when in top.items() if "HF config" in when}
    assert set(sliding) - set(hf) == {k for k, when in top.items() if "sliding-window" in when}
    assert set(target["hit_rate_target"]) == set(documented("## `hit_rate_target`"))
    assert set(auto["memory_cap"]) == set(documented("## `memory_cap`"))


def test_the_output_names_its_version(tiny):
    assert plan_json(tiny[0])["plan_version"] == PLAN_VERSION
    assert f'`"{PLAN_VERSION}"`' in PLAN_MD.read_text() and f"plan format {PLAN_VERSION}" in PLAN_MD.read_text()
    assert re.fullmatch(r"\d+\.\d+", PLAN_VERSION)
