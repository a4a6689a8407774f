"""colibri-eval's int4 adapter before (row by row through engine.logits, no prefix sharing) vs after (packed
rows: each document's context once, its choices beside it, documents side by side under a tree mask), and
the session path between them (padded batches, shared prefixes appended once), interleaved, same engine,
same items (bundled samples of all seven tasks, --limit each). Wall and process CPU seconds (one thread).

    .venv/bin/python bench/int4_eval_throughput.py --limit 15 [--container model.coli] [--dtype bfloat16]

Without --container it exports colibri-model's random `tiny` preset to --work-dir first (a
shape check, not a quality one: the speedup grows with the model, since the tokens saved are
what costs).
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
from colibri_eval import load_model  # noqa: E402
from colibri_eval.request_encoding import encode_requests
from colibri_eval.scoring_engine import ScoringEngine
from colibri_eval.task_data import load_documents
from colibri_eval.tasks import get_task


class Before:
    """The adapter as it was: every row alone, from an empty context."""

    supports_prefix_cache = False

    def __init__(self, engine, max_length):
        self.engine, self.max_length = engine, max_length

    def logits_at(self, input_ids, rows, cols):
        out = []
        for row in range(input_ids.shape[0]):
            wanted = cols[rows == row]
            if wanted.numel() == 0:
                continue
            out.append(torch.as_tensor(self.engine.logits(input_ids[row, : int(wanted.max()) + 1]))[wanted])
        return torch.cat(out, 0)


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--limit", type=int, default=15)
parser.add_argument("--container", type=Path, default=None)
parser.add_argument("--work-dir", type=Path, default=Path("/tmp/colibri-int4-eval-bench"))
parser.add_argument("--dtype", default="float32")
parser.add_argument("--ram-budget", default="2GB")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(args.threads)
container = args.container
if container is None:
    from colibri_int4 import export_checkpoint
    from colibri_model import ColibriForCausalLM, get_preset

    container = args.work_dir / "tiny.coli"
    if not container.exists():
        torch.manual_seed(0)
        ColibriForCausalLM(get_preset("tiny")).save_pretrained(args.work_dir / "ckpt")
        export_checkpoint(args.work_dir / "ckpt", container)
loaded = load_model(f"int4:{container}", ram_budget=args.ram_budget, dtype=args.dtype)
limit = args.limit
names = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa", "lambada_openai"]
items = [encode_requests(loaded.tokenizer, doc.item.requests)
         for n in names for doc in load_documents(get_task(n), "bundled", limit=limit)]
before = Before(loaded.model.engine, loaded.model.max_length)
arms = (("before", before, {}), ("sessions", loaded.model, {"pack": False}), ("after", loaded.model, {}))
times: dict[str, list[float]] = {name: [] for name, _, _ in arms}
cpu: dict[str, list[float]] = {name: [] for name, _, _ in arms}
worst = 0.0
for _ in range(args.repeats):
    for name, model, options in arms:
        began, began_cpu = time.perf_counter(), time.process_time()
        scores = ScoringEngine(model, **options).score(items)
        times[name].append(time.perf_counter() - began)
        cpu[name].append(time.process_time() - began_cpu)
        if name == "before":
            ref = scores
        else:
            worst = max(worst, max(abs(a[0] - b[0]) for x, y in zip(ref, scores) for a, b in zip(x, y)))
print("items", len(items), "requests", sum(len(i) for i in items), "max |dll|", worst)
for key in times:
    print(key, "wall", [round(x, 2) for x in times[key]], "median", round(statistics.median(times[key]), 2),
          "cpu median", round(statistics.median(cpu[key]), 2))
for key in ("sessions", "after"):
    print(f"speedup {key} vs before: wall", round(statistics.median(times["before"]) / statistics.median(times[key]), 2),
          "cpu", round(statistics.median(cpu["before"]) / statistics.median(cpu[key]), 2))
