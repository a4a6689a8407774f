"""`colibri-stream serve`: how long streaming clients wait for a token while another request reads
a long prompt, with the decode steps run between the prompt's chunks (the default, continuous
batching) and with one request's passes at a time (`--no-batch-sessions`).

Per round and mode: `--streams` greedy streaming chat completions start; once each has its first
tokens, one completion with a `--prompt-tokens`-token prompt (and `max_tokens` 1) arrives. For each
stream the longest gap between two of its chunks (client-side clock) after the long request was
sent, and the long request's own time. Modes interleave over `--rounds`; one engine. Prints one JSON object.

    nice python bench/serve_long_prompt.py [--preset tiny | --container X.coli --ram-budget 4GB]
        [--streams 4] [--prompt-tokens 1024] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from serve_concurrency import TOPICS, build


def round_of(client, streams: int, prompt: list[int], max_tokens: int) -> dict:
    started = threading.Barrier(streams + 1)
    sent: dict[str, float] = {}
    gaps: list[float] = []
    errors: list[BaseException] = []

    def stream(topic: str) -> None:
        try:
            chunks = client.chat.completions.create(
                model="bench", messages=[{"role": "user", "content": f"Tell me about {topic}."}],
                max_tokens=max_tokens, temperature=0, stream=True)
            last, seen, longest = None, 0, 0.0
            for _ in chunks:
                now = time.perf_counter()
                seen += 1
                if seen == 3:
                    started.wait(timeout=600)
                if last is not None and "long" in sent and now > sent["long"]:  # waited since the long request came
                    longest = max(longest, now - max(last, sent["long"]))
                last = now
            gaps.append(longest)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(TOPICS[i % len(TOPICS)],)) for i in range(streams)]
    for thread in threads:
        thread.start()
    started.wait(timeout=600)
    sent["long"] = time.perf_counter()
    client.completions.create(model="bench", prompt=prompt, max_tokens=1, temperature=0)
    long_s = time.perf_counter() - sent["long"]
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"long_request_s": round(long_s, 3), "longest_stream_gap_s": round(max(gaps), 3),
            "median_stream_longest_gap_s": round(statistics.median(gaps), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--container", default=None)
    parser.add_argument("--ram-budget", default="auto")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    args = parser.parse_args()

    import openai
    import torch
    from colibri_stream import Engine
    from colibri_stream.serve import make_server, serve_in_thread

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        container = Path(args.container) if args.container else build(Path(scratch), args.preset)
        with Engine.open(container, ram_budget=args.ram_budget) as engine:
            server = make_server(engine, "127.0.0.1", 0, model_name="bench", keep_sessions=0)
            serve_in_thread(server)
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=3600)
            prompt = [(37 * i) % 4000 + 10 for i in range(min(args.prompt_tokens, engine.max_context - 2))]
            rounds = []
            try:
                for _ in range(args.rounds):
                    row = {}
                    for mode in ("queued", "batched"):
                        engine.runner.batch_sessions = mode == "batched"
                        row[mode] = round_of(client, args.streams, prompt, args.max_tokens)
                    rounds.append(row)
                chunk = engine.prefill_chunk
            finally:
                server.shutdown()
                server.server_close()
    print(json.dumps({"model": args.container or args.preset, "streams": args.streams, "prompt_tokens": len(prompt),
                      "prefill_chunk": chunk, "rounds": rounds,
                      "median_longest_gap_s": {m: statistics.median(r[m]["longest_stream_gap_s"] for r in rounds)
                                               for m in ("queued", "batched")},
                      "median_long_request_s": {m: statistics.median(r[m]["long_request_s"] for r in rounds)
                                                for m in ("queued", "batched")}}))


if __name__ == "__main__":
    main()
