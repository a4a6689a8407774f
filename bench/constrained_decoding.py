"""Grammar overhead per token: constrained decoding (the server's `response_format`) against free
decoding on the same engine, and the candidate grammar libraries side by side on its tokenizer.

Arms, on a random-weight container of a colibri-model preset's shapes (its 49k-token byte-level
BPE tokenizer, which is what the grammar libraries pay for):
- "free": `Session.stream` greedy, no constraint;
- "llguidance": the same with serve/constrained.py's `Grammar` for `--schema` (what the server
  runs); the time inside the constraint (mask + accept) is measured apart from the whole step.
- "outlines_core" (when installed): its `Index` for the schema's regex over the same vocabulary
  (built up front), then per token the allowed ids and the same -inf mask.
xgrammar is not measured: on this CPU-only torch it installs triton and transformers with it, and
its tokenizer info comes from a transformers tokenizer (see the package README).

Prints one JSON object: per arm the median per-token seconds over `--repeats` runs, the
constraint's own seconds per token, compile/index seconds, the ratio constrained / free per whole
step, and the constraint's own time over a free step (the figure that noise on shared cores leaves
alone). `valid`: the answer keeps the schema (enum, integer range), or "cut" by max tokens.

    .venv/bin/python bench/constrained_decoding.py                  # nano shapes, 4 layers
    .venv/bin/python bench/constrained_decoding.py --tokens 96 --schema free_text
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from colibri_stream import Engine
from colibri_stream.serve.constrained import Grammars
from colibri_stream.studies.synthetic_container import synthetic_container

SCHEMAS = {
    "bounded": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}},
        "required": ["city", "days", "tags"], "additionalProperties": False},
    "free_text": {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]},
}
PROMPT = "Write the answer as JSON:"


class Timed:
    """A constraint factory whose rows add their mask + accept time to `seconds`."""

    def __init__(self, factory):
        self.factory, self.seconds, self.calls = factory, 0.0, 0

    def __call__(self):
        inner, outer = self.factory(), self

        class Row:
            def mask(self, logits):
                began = time.perf_counter()
                out = inner.mask(logits)
                outer.seconds += time.perf_counter() - began
                outer.calls += 1
                return out

            def accept(self, token):
                began = time.perf_counter()
                inner.accept(token)
                outer.seconds += time.perf_counter() - began

        return Row()


class OutlinesRow:
    def __init__(self, index, vocab_size: int):
        import outlines_core

        self.guide, self.vocab_size = outlines_core.Guide(index), vocab_size

    def mask(self, logits):
        allowed = torch.zeros(logits.numel(), dtype=torch.bool)
        allowed[torch.tensor(self.guide.get_tokens(), dtype=torch.long)] = True
        return logits.float().masked_fill(~allowed, float("-inf"))

    def accept(self, token):
        if not self.guide.is_finished():
            self.guide.advance(int(token))


def outlines_index(engine, schema: dict):
    """outlines-core's index for `schema` over the engine's byte-level vocabulary (None if absent)."""
    try:
        import outlines_core
    except ImportError:
        return None, None
    # GPT-2's byte-level alphabet back to bytes: outlines-core matches the tokens' bytes
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in codes:
            codes[b], extra = 256 + extra, extra + 1
    to_byte = {chr(c): b for b, c in codes.items()}
    vocabulary: dict[bytes, list[int]] = {}
    for text, ident in engine.tokenizer.get_vocab().items():
        if ident in engine.end_token_ids:
            continue
        key = bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else text.encode()
        vocabulary.setdefault(key, []).append(ident)
    began = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    index = outlines_core.Index(regex, outlines_core.Vocabulary(engine.end_token_ids[0], vocabulary))
    return index, time.perf_counter() - began


def valid(text: str, schema: str) -> bool | str:
    """Whether an answer keeps the schema: JSON, and for "bounded" its enum and integer range
    ("cut" when max tokens ended it first)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "cut"
    if schema == "bounded":
        return value.get("city") in ("Paris", "Oslo", "Lima") and 1 <= value.get("days", 0) <= 30 and \
            len(value.get("tags", [])) <= 8 and all(len(t) <= 12 for t in value.get("tags", []))
    return isinstance(value.get("story"), str)


def run(engine, tokens: int, constraint) -> dict:
    began = time.perf_counter()
    stream = engine.session().stream(PROMPT, tokens, constraint=constraint)
    for _ in stream:
        pass
    wall = time.perf_counter() - began
    r = stream.result
    return dict(tokens=len(r.token_ids), text=r.text, decode_seconds=r.decode_seconds,
                per_token=r.decode_seconds / max(len(r.token_ids) - 1, 1), wall=wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--schema", default="bounded", choices=sorted(SCHEMAS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    schema = SCHEMAS[args.schema]
    with tempfile.TemporaryDirectory() as workdir, \
            synthetic_container(workdir, args.preset, n_layers=args.layers) as path, \
            Engine.open(path, ram_budget="4GB", prefetch="off") as engine:
        grammars = Grammars(engine)
        began = time.perf_counter()
        grammars.tokenizer()
        tokenizer_seconds = time.perf_counter() - began
        began = time.perf_counter()
        grammar = grammars.json_schema(schema, "bench")
        compile_seconds = time.perf_counter() - began
        index, index_seconds = outlines_index(engine, schema)
        run(engine, 4, None)  # warm: every expert the prompt routes to is cached for all arms
        arms: dict[str, list[dict]] = {"free": [], "llguidance": []}
        if index is not None:
            arms["outlines_core"] = []
        inside: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.repeats):  # interleaved
            for name in arms:
                timed = None
                if name == "llguidance":
                    timed = Timed(grammar)
                elif name == "outlines_core":
                    timed = Timed(lambda: OutlinesRow(index, engine.tokenizer.get_vocab_size()))
                out = run(engine, args.tokens, timed)
                arms[name].append(out)
                if timed is not None:
                    inside[name].append(timed.seconds / max(timed.calls, 1))
    free = statistics.median(r["per_token"] for r in arms["free"])
    summary = {}
    for name, runs in arms.items():
        per_token = statistics.median(r["per_token"] for r in runs)
        summary[name] = dict(tokens=runs[0]["tokens"], seconds_per_token=round(per_token, 6),
                             constraint_seconds_per_token=round(statistics.median(inside[name]), 6) if inside[name]
                             else 0.0, ratio_to_free=round(per_token / free, 3), sample=runs[0]["text"][:80])
        # the step ratio carries the machine's noise; the constraint's own time over a free step does not
        summary[name]["constraint_over_free_step"] = round(summary[name]["constraint_seconds_per_token"] / free, 4)
        if name != "free":
            summary[name]["valid"] = valid(runs[0]["text"], args.schema)
    print(json.dumps(dict(preset=args.preset, layers=args.layers, schema=args.schema, max_tokens=args.tokens,
                          threads=args.threads, repeats=args.repeats, llguidance_tokenizer_seconds=round(tokenizer_seconds, 4),
                          llguidance_compile_seconds=round(compile_seconds, 4),
                          outlines_core_index_seconds=None if index_seconds is None else round(index_seconds, 4),
                          **summary), indent=1))


if __name__ == "__main__":
    main()
