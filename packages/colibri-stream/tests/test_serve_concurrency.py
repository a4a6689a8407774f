"""Several clients at once: 8 streaming clients (chat, completions, Anthropic messages, a batch of
n=2) against the real server, each answer equal to the same request run alone, within a bound,
their decode steps batched together (continuous batching)."""

from __future__ import annotations

import threading
import time

import anthropic
import openai
import pytest
from colibri_stream import Engine
from colibri_stream.serve import make_server, serve_in_thread

MODEL = "tiny-test"
TOPICS = ["a story", "birds", "rivers", "the sea", "bread", "a poem", "the moon", "trains"]
BOUND_SECONDS = 180  # 8 x 16 tokens take a few seconds here; a deadlock or a lost stream fails fast


@pytest.fixture(scope="module")
def served(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", kernel_dtype="f32") as engine:
        server = make_server(engine, "127.0.0.1", 0, model_name=MODEL, keep_sessions=8)
        serve_in_thread(server)
        yield (openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=BOUND_SECONDS),
               anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                   timeout=BOUND_SECONDS), engine)
        server.shutdown()
        server.server_close()


def _requests(client, claude):
    """Eight streaming requests of four kinds, each a function returning (text, telemetry)."""

    def chat(topic, seed=None):
        def go():
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me about {topic}."}], max_tokens=16,
                temperature=0.8 if seed is not None else 0, seed=seed, stream=True,
                stream_options={"include_usage": True}))
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].model_extra["colibri"]
        return go

    def completion(topic, n=1):
        def go():
            chunks = list(client.completions.create(model=MODEL, prompt=f"All about {topic}:", max_tokens=16, n=n,
                                                    temperature=0.7, seed=4, stream=True,
                                                    stream_options={"include_usage": True}))
            texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == j)
                     for j in range(n)]
            return "|".join(texts), chunks[-1].model_extra["colibri"]
        return go

    def message(topic):
        def go():
            events = list(claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, stream=True,
                                                 messages=[{"role": "user", "content": f"Describe {topic}."}]))
            text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
            return text, [e for e in events if e.type == "message_delta"][0].model_extra["colibri"]
        return go

    return [chat(TOPICS[0]), chat(TOPICS[1]), chat(TOPICS[2], seed=7), completion(TOPICS[3]),
            completion(TOPICS[4], n=2), message(TOPICS[5]), message(TOPICS[6]), chat(TOPICS[7], seed=9)]


def test_eight_concurrent_streaming_clients_get_what_each_gets_alone(served):
    client, claude, engine = served
    requests = _requests(client, claude)
    alone = [go()[0] for go in requests]
    combiner = engine.runner.combiner
    before = (combiner.passes, combiner.rows)
    got: dict[int, tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(requests))

    def worker(i, go):
        try:
            start.wait(timeout=30)  # all eight in flight together
            got[i] = go()
        except BaseException as exc:  # noqa: BLE001 - reported below with the request's index
            errors.append(exc)

    began = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i, go), daemon=True) for i, go in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, BOUND_SECONDS - (time.monotonic() - began)))
    assert not any(t.is_alive() for t in threads), f"requests still running after {BOUND_SECONDS} s"
    assert not errors, errors
    assert [got[i][0] for i in range(len(requests))] == alone
    assert all(text for text in alone)
    # the telemetry says the counters were shared while requests ran beside each other
    assert max(got[i][1]["concurrent_requests"] for i in got) >= 1
    # and the sessions' decode steps were batched: passes held several requests' tokens
    assert combiner.rows - before[1] > combiner.passes - before[0] > 0
