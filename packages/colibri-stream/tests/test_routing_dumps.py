"""Routing dumps of other runtimes (traces/routing_dumps.py, `colibri-stream trace-import`): each
shape imports to the same events, auto-detection, malformed input named by line, the split at
request boundaries (trace format 1.1), and per-layer hits in the replay and `policy-study --json`."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from click.testing import CliRunner
from colibri_stream import TraceEvent
from colibri_stream.cache.policies import POLICIES, LRUPolicy
from colibri_stream.cache.replay import belady, replay, static_oracle
from colibri_stream.cli import main
from colibri_stream.traces.routing_dumps import DumpFormatError, detect_format, import_dump
from colibri_stream.traces.routing_trace import (
    RoutingTrace,
    TraceFormatError,
    TraceHeader,
    read_trace,
    write_trace,
)

# two requests decoded side by side (a batching server), layers 1 and 3 (block 0 and 2 dense), top-2
ROUTING = [  # (request, token, layer, experts) in the order the server ran them
    (0, 0, 1, (5, 2)), (0, 0, 3, (1, 0)),
    (1, 0, 1, (3, 4)), (1, 0, 3, (7, 1)),
    (0, 1, 1, (5, 6)), (0, 1, 3, (0, 2)),
    (1, 1, 1, (4, 3)), (1, 1, 3, (1, 6)),
]
EXPECTED = [  # each (request, token) one step, by first appearance
    TraceEvent(0, 1, (5, 2), 0), TraceEvent(0, 3, (1, 0), 0),
    TraceEvent(1, 1, (3, 4), 1), TraceEvent(1, 3, (7, 1), 1),
    TraceEvent(2, 1, (5, 6), 0), TraceEvent(2, 3, (0, 2), 0),
    TraceEvent(3, 1, (4, 3), 1), TraceEvent(3, 3, (1, 6), 1),
]
WITHOUT_REQUESTS = [TraceEvent(e.step, e.layer, e.experts) for e in EXPECTED]


def _write(tmp_path, name, text):
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _jsonl(keys=("request", "token", "layer", "topk_ids"), order=ROUTING):
    r, t, la, e = keys
    return "".join(json.dumps({r: q, t: tok, la: layer, e: list(ex)}) + "\n" for q, tok, layer, ex in order)


def _llama_log():
    lines = ["llama_model_loader: loaded meta data with 24 key-value pairs", "main: prompt: 'Hello'", ""]
    steps = {(q, t): i for i, (q, t) in enumerate(dict.fromkeys((q, t) for q, t, _, _ in ROUTING))}
    for q, t, layer, ex in ROUTING:
        lines.append(f"route {steps[q, t]} {layer} " + " ".join(map(str, ex)))
        lines.append("llama_perf_context_print: eval time = 1.0 ms / routed 3 tokens")
    return "\n".join(lines) + "\n"


def _csv_lists(separator=";"):
    rows = ["request,token,layer,topk_ids"] + [f"{q},{t},{layer},{separator.join(map(str, ex))}"
                                               for q, t, layer, ex in ROUTING]
    return "\n".join(rows) + "\n"


def _csv_quoted():  # "[5, 9]" in a quoted cell
    rows = ["request,token,layer,topk_ids"] + [f'{q},{t},{layer},"[{", ".join(map(str, ex))}]"'
                                               for q, t, layer, ex in ROUTING]
    return "\n".join(rows) + "\n"


def _csv_rows():
    rows = ["request_id\ttoken_idx\tlayer_id\texpert_id\tweight"]
    rows += [f"{q}\t{t}\t{layer}\t{e}\t0.5" for q, t, layer, ex in ROUTING for e in ex]
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("name, text, fmt, expected", [
    ("vllm.jsonl", _jsonl(), "jsonl", EXPECTED),
    ("sglang.jsonl.gz", _jsonl(("request_id", "token_idx", "layer_id", "expert_ids")), "jsonl", EXPECTED),
    ("steps.jsonl", _jsonl(("request", "step", "layer", "experts")), "jsonl", EXPECTED),
    # layer-major: every token of layer 1, then of layer 3 (a hook per layer); the same passes
    ("layer_major.jsonl", _jsonl(order=sorted(ROUTING, key=lambda r: r[2])), "jsonl", EXPECTED),
    ("run.log", _llama_log(), "llama-cpp", WITHOUT_REQUESTS),
    ("lists.csv", _csv_lists(), "csv", EXPECTED),
    ("spaces.csv", _csv_lists(" "), "csv", EXPECTED),
    ("quoted.csv", _csv_quoted(), "csv", EXPECTED),
    ("rows.tsv", _csv_rows(), "csv", EXPECTED),
])
def test_each_dump_shape_imports_to_the_same_events(tmp_path, name, text, fmt, expected):
    path = _write(tmp_path, name, text)
    assert detect_format(path) == fmt
    for given in (fmt, "auto"):
        dump = import_dump(path, given)
        assert dump.events == expected and dump.format == fmt
        assert (dump.n_moe_layers, dump.n_experts, dump.top_k) == (2, 8, 2)
        assert dump.steps == 4 and dump.requests == (2 if expected is EXPECTED else 0)
    assert any("n_experts 8 inferred" in note for note in dump.notes)


def test_passes_of_several_tokens_merge_and_shape_given(tmp_path):
    # a hook that numbers forward passes: a 3-token prefill chunk under step 0, then a decode step
    lines = [{"step": 0, "layer": 0, "topk_ids": [1, 2]}, {"step": 0, "layer": 0, "topk_ids": [2, 3]},
             {"step": 0, "layer": 0, "topk_ids": [0, 1]}, {"step": 1, "layer": 0, "topk_ids": [[4, 1]]},
             {"step": 2, "layer": 0, "topk_ids": [[1, 5], [6, 1]]}]  # a chunk as one list per token
    path = _write(tmp_path, "chunk.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    dump = import_dump(path, n_experts=64, n_moe_layers=4, layer_offset=1)
    assert dump.events == [TraceEvent(0, 1, (1, 2, 3, 0)), TraceEvent(1, 1, (4, 1)), TraceEvent(2, 1, (1, 5, 6))]
    assert (dump.n_moe_layers, dump.n_experts, dump.top_k) == (4, 64, 2)
    assert [n for n in dump.notes if "inferred" in n] == ["top_k 2 inferred (most common experts per token)"]
    # one expert per CSV row: the same expert again under one index is the pass's next token
    rows = "step,layer,expert\n0,2,1\n0,2,2\n0,2,2\n0,2,3\n1,2,5\n"
    dump = import_dump(_write(tmp_path, "rows.csv", rows), top_k=2)
    assert dump.events == [TraceEvent(0, 2, (1, 2, 3)), TraceEvent(1, 2, (5,))] and dump.top_k == 2


def test_a_request_follows_its_token_indices(tmp_path):
    # layer-major, and token 1 is missing from layer 1 (a dropped row): it first appears under
    # layer 3, after token 2, yet it is still the second step
    order = [(0, 0, 1, (1,)), (0, 2, 1, (2,)), (0, 0, 3, (3,)), (0, 1, 3, (4,)), (0, 2, 3, (5,))]
    dump = import_dump(_write(tmp_path, "gap.jsonl", _jsonl(order=order)))
    assert dump.events == [TraceEvent(0, 1, (1,), 0), TraceEvent(0, 3, (3,), 0), TraceEvent(1, 3, (4,), 0),
                           TraceEvent(2, 1, (2,), 0), TraceEvent(2, 3, (5,), 0)]


def test_string_request_ids_are_numbered(tmp_path):
    lines = [{"request_id": "cmpl-b", "token": 0, "layer": 0, "topk_ids": [1]},
             {"request_id": "cmpl-a", "token": 0, "layer": 0, "topk_ids": [2]},
             {"request_id": "cmpl-b", "token": 1, "layer": 0, "topk_ids": [3]}]
    dump = import_dump(_write(tmp_path, "s.jsonl", "".join(json.dumps(x) + "\n" for x in lines)))
    assert dump.events == [TraceEvent(0, 0, (1,), 0), TraceEvent(1, 0, (2,), 1), TraceEvent(2, 0, (3,), 0)]


def test_detection_refuses_what_it_cannot_tell(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", EXPECTED, n_moe_layers=2, n_experts=8, top_k=2)
    with pytest.raises(DumpFormatError, match="already a colibri routing trace"):
        detect_format(trace)
    with pytest.raises(DumpFormatError, match="cannot tell the dump's format"):
        detect_format(_write(tmp_path, "x.log", "hello\nrouted 3 tokens\n"))
    with pytest.raises(DumpFormatError, match="empty file"):
        detect_format(_write(tmp_path, "e.log", "\n\n"))
    with pytest.raises(DumpFormatError, match="cannot open"):
        import_dump(tmp_path / "missing.jsonl")
    records = [(0, t, 1, (t % 7, 7)) for t in range(500)]
    damaged = _write(tmp_path, "cut.jsonl.gz", _jsonl(order=records))
    damaged.write_bytes(damaged.read_bytes()[: len(damaged.read_bytes()) // 2])
    with pytest.raises(DumpFormatError, match="unreadable"):
        import_dump(damaged, "jsonl")


GOOD = '{"token": 0, "layer": 1, "topk_ids": [1, 2]}'
CSV_HEAD = "token,layer,topk_ids"


@pytest.mark.parametrize("fmt, lines, line, message", [
    ("jsonl", [GOOD, "{broken"], 2, "not JSON"),
    ("jsonl", [GOOD, "[1, 2]"], 2, "must be a JSON object"),
    ("jsonl", ['{"layer": 1, "topk_ids": [1]}'], 1, "no token index (one of 'token', 'token_idx', 'step')"),
    ("jsonl", ['{"token": 0, "step": 0, "layer": 1, "topk_ids": [1]}'], 1, "both 'token' and 'step'"),
    ("jsonl", ['{"token": 0, "topk_ids": [1]}'], 1, "no layer"),
    ("jsonl", ['{"token": 0, "layer": 1}'], 1, "no expert list"),
    ("jsonl", ['{"token": 0, "layer": 1, "topk_ids": []}'], 1, "must be a non-empty list"),
    ("jsonl", ['{"token": -1, "layer": 1, "topk_ids": [1]}'], 1, "the token index must be >= 0, got -1"),
    ("jsonl", ['{"token": 0, "layer": true, "topk_ids": [1]}'], 1, "the layer must be an integer, got True"),
    ("jsonl", ['{"token": 0, "layer": 1, "topk_ids": [1, -2]}'], 1, "an expert id must be >= 0, got -2"),
    ("jsonl", ['{"token": 0, "layer": 1, "topk_ids": [1, 1]}'], 1, "repeat an expert"),
    ("jsonl", [GOOD, '{"token": 1, "layer": 1, "topk_ids": [8]}'], 2, "expert 8 is not in [0, 8)"),
    ("jsonl", [GOOD, '{"token": 5, "layer": 1, "topk_ids": [1]}', GOOD], 3,
     "token 0 comes after token 5 in layer 1 of the dump (no request ids"),
    ("jsonl", ['{"request": 0, "token": 5, "layer": 1, "topk_ids": [1]}',
               '{"request": 0, "token": 4, "layer": 1, "topk_ids": [1]}'], 2, "of request 0"),
    ("jsonl", ['{"request": 0, "token": 0, "layer": 1, "topk_ids": [1]}', GOOD], 2, "names no request"),
    ("jsonl", ['{"request": 0, "token": 0, "layer": 1, "topk_ids": [1]}',
               '{"request": "x", "token": 1, "layer": 1, "topk_ids": [1]}'], 2, "mixes integer and string"),
    ("jsonl", [GOOD, '{"token": 0, "layer": 2, "topk_ids": [1]}', '{"token": 0, "layer": 3, "topk_ids": [1]}'],
     3, "more distinct layers (3) than n_moe_layers (2)"),
    ("llama-cpp", ["noise", "route 0 1 2 3", "route 1 1"], 3, "a route line is 'route <step> <layer> <expert> ...'"),
    ("llama-cpp", ["route 0 1 2 x"], 1, "an expert id must be an integer, got 'x'"),
    ("llama-cpp", ["route 0 -1 2"], 1, "the layer must be >= 0"),
    ("llama-cpp", ["route 3 1 2", "route 3 2 2", "route 2 1 2"], 3, "step 2 comes after step 3"),
    ("llama-cpp", ["nothing here"], None, "no 'route <step> <layer> <expert> ...' line"),
    ("csv", ["step,experts"], 1, "no layer column"),
    ("csv", ["step,layer"], 1, "no expert column"),
    ("csv", ["step,layer,expert,experts"], 1, "both an expert list column"),
    ("csv", [CSV_HEAD, "0,1,1;2", "1,1"], 3, "2 fields, the header has 3"),
    ("csv", [CSV_HEAD, "0,1,"], 2, "no experts"),
    ("csv", [CSV_HEAD, "0,one,1;2"], 2, "the layer must be an integer, got 'one'"),
    ("csv", [CSV_HEAD, "0,1,1;9"], 2, "expert 9 is not in [0, 8)"),
    ("csv", ["step,layer,expert", "0,1,3", "0,1,9"], 3, "expert 9 is not in [0, 8)"),
    ("jsonl", [], None, "no records"),
])
def test_malformed_dump_is_one_error_naming_the_line(tmp_path, fmt, lines, line, message):
    path = _write(tmp_path, "dump.txt", "".join(ln + "\n" for ln in lines))
    with pytest.raises(DumpFormatError) as info:
        import_dump(path, fmt, n_experts=8, n_moe_layers=2)
    where = f"{path}:{line}: " if line else f"{path}: "
    assert str(info.value).startswith(where) and message in str(info.value), str(info.value)
    result = CliRunner().invoke(main, ["trace-import", str(path), "--format", fmt, "--out", str(tmp_path / "o.jsonl"),
                                       "--n-experts", "8", "--n-moe-layers", "2"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o.jsonl").exists()


def test_trace_import_cli_writes_a_trace(tmp_path):
    dump = _write(tmp_path, "hook.jsonl", _jsonl())
    out = tmp_path / "t.jsonl.gz"
    result = CliRunner().invoke(main, ["trace-import", str(dump), "--out", str(out), "--experts-per-token", "2",
                                       "--model", "some/moe"])
    assert result.exit_code == 0, result.output
    assert "4 steps, 2 requests x 2 MoE layers, 8 experts, top-2 (jsonl)" in result.output
    trace = read_trace(out)
    assert trace.events == EXPECTED and trace.header.version == "1.1" and trace.header.model == "some/moe"
    assert "trace-import --format jsonl of hook.jsonl" in trace.header.source
    assert "n_experts 8 inferred (largest expert id + 1" in trace.header.source
    assert "top_k" not in trace.header.source  # given, not inferred
    bad = CliRunner().invoke(main, ["trace-import", str(dump), "--out", str(out), "--n-experts", "2", "--experts-per-token", "3"])
    assert bad.exit_code == 2 and "top_k (3) exceeds n_experts (2)" in bad.output


# --- requests in the trace format (1.1) and the split between them ----------------------------------


def test_requests_round_trip_and_split_between_requests(tmp_path):
    path = write_trace(tmp_path / "r.jsonl", EXPECTED, n_moe_layers=2, n_experts=8, top_k=2)
    trace = read_trace(path)
    assert trace.events == EXPECTED and trace.requests == [0, 1]
    first, rest = trace.split(0.5)  # requests interleave step by step: the cut is by request, not by step
    assert first == [e for e in EXPECTED if e.request == 0] and rest == [e for e in EXPECTED if e.request == 1]
    events = [TraceEvent(s, 1, (s % 4,), s // 3) for s in range(12)]  # 4 requests of 3 steps
    first, rest = RoutingTrace(TraceHeader(1, 4, 1), events).split(0.5)
    assert {e.request for e in first} == {0, 1} and {e.request for e in rest} == {2, 3}
    first, rest = RoutingTrace(TraceHeader(1, 4, 1), events).split(0.9)  # at least one request held out
    assert {e.request for e in rest} == {3}
    one = [TraceEvent(s, 1, (0,), 7) for s in range(4)]  # one request: the step split
    assert [len(part) for part in RoutingTrace(TraceHeader(1, 4, 1), one).split(0.5)] == [2, 2]


def test_version_1_0_files_and_request_errors(tmp_path):
    header = {"format": "colibri-routing-trace", "version": "1.0", "n_moe_layers": 1, "n_experts": 4, "top_k": 1}
    old = tmp_path / "old.jsonl"  # in 1.0, "request" is an unknown key: ignored
    old.write_text(json.dumps(header) + '\n{"step": 0, "layer": 0, "experts": [1], "request": "x"}\n')
    assert read_trace(old).events == [TraceEvent(0, 0, (1,))] and read_trace(old).requests == []
    new = {**header, "version": "1.1"}
    for events, message in [
        ([{"step": 0, "layer": 0, "experts": [1], "request": 0}, {"step": 1, "layer": 0, "experts": [1]}],
         ":3: 'request' must be on every event or on none"),
        ([{"step": 0, "layer": 0, "experts": [1], "request": 0}, {"step": 0, "layer": 1, "experts": [1], "request": 1}],
         ":3: step 0 mixes requests 0 and 1"),
        ([{"step": 0, "layer": 0, "experts": [1], "request": -1}], ":2: 'request' must be >= 0"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text("".join(json.dumps(x) + "\n" for x in [{**new, "n_moe_layers": 2}, *events]))
        with pytest.raises(TraceFormatError, match=message.replace("(", r"\(")):
            read_trace(bad)


def _requests_trace(tmp_path, n_requests=4, steps=30, seed=0):
    rng = random.Random(seed)
    events, step = [], 0
    for request in range(n_requests):
        hot = [rng.randrange(8), rng.randrange(8)]
        for _ in range(steps):
            for i, layer in enumerate((1, 2)):
                if rng.random() > 0.7:
                    hot[i] = rng.randrange(8)
                events.append(TraceEvent(step, layer, (hot[i],), request))
            step += 1
    return write_trace(tmp_path / "req.jsonl", events, n_moe_layers=2, n_experts=8, top_k=1)


def test_policy_study_tunes_on_the_first_requests_and_reports_per_layer(tmp_path):
    path = _requests_trace(tmp_path)
    result = CliRunner().invoke(main, ["policy-study", str(path), "--budgets", "25%,50%", "--json"])
    assert result.exit_code == 0, result.output
    study = json.loads(result.output)
    assert study["trace"]["tuned_on"] == "first 2 of its 4 requests"
    assert study["trace_accesses"]["tuning"] == study["trace_accesses"]["heldout"] == 2 * 30 * 2
    for point in study["points"]:
        for name in ("tuning", "heldout", "shuffled", "random"):
            row = point[name]
            assert {"belady_hit_rate", "static_oracle_hit_rate", *POLICIES} <= set(row)  # the keys it had
            for per_layer, rate in [(row["belady_per_layer"], row["belady_hit_rate"]),
                                    *[(row[p]["per_layer"], row[p]["hit_rate"]) for p in POLICIES]]:
                assert set(per_layer) == {"1", "2"}
                hits = sum(c["hits"] for c in per_layer.values())
                total = hits + sum(c["misses"] for c in per_layer.values())
                assert total == study["trace_accesses"][name] and abs(hits / total - rate) < 1e-6
                assert all(c["hit_rate"] == round(c["hits"] / (c["hits"] + c["misses"]), 6) for c in per_layer.values())
    table = CliRunner().invoke(main, ["policy-study", str(path), "--budgets", "25%"])
    assert table.exit_code == 0 and "tuned on the first 2 of its 4 requests" in table.output


def test_replay_per_layer_counts():
    # layer 1 asks for expert 0 every step (hits after the first); layer 2 cycles 0..3 (LRU with
    # 3 slots shared: a stream of misses); per-layer counts add up to the totals
    trace = [TraceEvent(s, layer, (0,) if layer == 1 else (s % 4,)) for s in range(20) for layer in (1, 2)]
    plain = replay(LRUPolicy(), trace, 3)
    split = replay(LRUPolicy(), trace, 3, per_layer=True)
    assert plain.per_layer is None and (split.hits, split.misses) == (plain.hits, plain.misses)
    assert (split.per_layer[1].hits, split.per_layer[1].misses) == (19, 1)
    assert split.per_layer[2].hits == 0 and split.per_layer[2].misses == 20
    for result in (belady(trace, 3, per_layer=True), static_oracle(trace, 3, per_layer=True)):
        assert sum(r.hits for r in result.per_layer.values()) == result.hits
        assert sum(r.misses for r in result.per_layer.values()) == result.misses
        assert result.per_layer[1].hits == 19  # the pinned / optimal choice keeps the one hot expert
    assert belady(trace, 3, per_layer=True).hits == belady(trace, 3).hits
    rng = random.Random(3)
    noisy = [TraceEvent(s, layer, tuple(rng.sample(range(6), 2))) for s in range(50) for layer in (0, 4, 5)]
    for spec in POLICIES.values():
        a, b = replay(spec.factory(noisy, 6), noisy, 6), replay(spec.factory(noisy, 6), noisy, 6, per_layer=True)
        assert (a.hits, a.misses) == (b.hits, b.misses) == (sum(r.hits for r in b.per_layer.values()),
                                                             sum(r.misses for r in b.per_layer.values()))
