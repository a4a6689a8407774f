"""`colibri-stream serve` with 8 concurrent streaming clients against 1 client: aggregate tokens/s
(ratio) and wrong answers (each concurrent answer against the same request run alone), with the
sessions' decode steps combined into one pass (continuous batching, the server's default) and
one pass at a time (`--no-batch-sessions`).

A random NanoColibri-like model (colibri-model's `--preset`, default tiny) is exported to an int4
container in WORKDIR (or `--container` is served as it is), served on 127.0.0.1 in this process
(the server's own threads), and the official `openai` client sends greedy streaming chat
completions of `--max-tokens` tokens:

- alone: the 8 requests one after another (one client), each answer kept as the reference;
- queued: the same 8 requests at once (8 threads released by a barrier), one pass at a time;
- batched: the same, the decode steps of the 8 sessions combined (step_combiner.py);

interleaved in that order over `--rounds` rounds, one engine (the mode switched between them).
Tokens are the server's own usage counts. Prints one JSON object: tokens/s of each mode per
round, the ratios to alone (median over rounds), the mean rows of a combined pass, wrong answers.

    nice python bench/serve_concurrency.py [--preset tiny | --container X.coli --ram-budget 4GB]
        [--rounds 3] [--max-tokens 32] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

TOPICS = ["a story", "birds", "rivers", "the sea", "bread", "a poem", "the moon", "trains"]


def build(workdir: Path, preset: str) -> Path:
    import torch
    from colibri_int4 import export_checkpoint
    from colibri_model import ColibriForCausalLM, get_preset

    container = workdir / f"{preset}.coli"
    if not container.exists():
        torch.manual_seed(0)
        ColibriForCausalLM(get_preset(preset)).save_pretrained(workdir / "ckpt")
        export_checkpoint(workdir / "ckpt", container)
    return container


def one(client, model: str, topic: str, max_tokens: int) -> tuple[str, int]:
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me about {topic}."}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def concurrent(client, model: str, max_tokens: int) -> tuple[list[str], int, float]:
    results: dict[int, tuple[str, int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(TOPICS) + 1)

    def worker(i: int, topic: str) -> None:
        try:
            barrier.wait(timeout=60)
            results[i] = one(client, model, topic, max_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, t)) for i, t in enumerate(TOPICS)]
    for thread in threads:
        thread.start()
    barrier.wait(timeout=60)
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return [results[i][0] for i in range(len(TOPICS))], sum(results[i][1] for i in range(len(TOPICS))), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--container", default=None, help="serve this container instead of a random preset")
    parser.add_argument("--ram-budget", default="auto")
    args = parser.parse_args()

    import openai
    import torch
    from colibri_stream import Engine
    from colibri_stream.serve import make_server, serve_in_thread

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        container = Path(args.container) if args.container else build(workdir, args.preset)
        with Engine.open(container, ram_budget=args.ram_budget) as engine:
            # no pooled sessions: a pooled prefix changes the prompt's chunking, so its logits (and,
            # at the near ties of random weights, its tokens) differ from the same request alone
            server = make_server(engine, "127.0.0.1", 0, model_name="bench", keep_sessions=0)
            serve_in_thread(server)
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
            combiner = engine.runner.combiner
            try:
                one(client, "bench", "warm-up", 4)
                rows, wrong, passes, combined_rows = [], {"queued": 0, "batched": 0}, 0, 0
                for _ in range(args.rounds):
                    engine.runner.batch_sessions = False
                    started = time.perf_counter()
                    alone = [one(client, "bench", topic, args.max_tokens) for topic in TOPICS]
                    alone_wall = time.perf_counter() - started
                    alone_rate = sum(a[1] for a in alone) / alone_wall
                    row = {"alone_tok_s": round(alone_rate, 2)}
                    for mode in ("queued", "batched"):
                        engine.runner.batch_sessions = mode == "batched"
                        before = (combiner.passes, combiner.rows)
                        texts, tokens, wall = concurrent(client, "bench", args.max_tokens)
                        if mode == "batched":
                            passes += combiner.passes - before[0]
                            combined_rows += combiner.rows - before[1]
                        wrong[mode] += sum(a[0] != t for a, t in zip(alone, texts, strict=True))
                        row[f"{mode}_tok_s"] = round(tokens / wall, 2)
                        row[f"{mode}_ratio"] = round(tokens / wall / alone_rate, 3)
                    rows.append(row)
                compute = engine.stats.compute_mode
            finally:
                server.shutdown()
                server.server_close()
    print(json.dumps({"model": args.container or args.preset, "compute": compute, "clients": len(TOPICS),
                      "max_tokens": args.max_tokens, "rounds": rows,
                      "median_queued_ratio": statistics.median(r["queued_ratio"] for r in rows),
                      "median_batched_ratio": statistics.median(r["batched_ratio"] for r in rows),
                      "mean_rows_per_combined_pass": round(combined_rows / max(passes, 1), 2),
                      "wrong_answers": wrong, "answers_checked_per_mode": len(TOPICS) * args.rounds}))


if __name__ == "__main__":
    main()
