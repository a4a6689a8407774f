"""The OpenAI endpoints' generation features through the official `openai` client against the real
server: `n` choices (one batch, each seeded), logprobs on both endpoints, `echo` (prompt logprobs,
as eval harnesses score), `stream_options.include_usage`, `cached_tokens` from the session reuse,
and the `colibri` telemetry object."""

from __future__ import annotations

import openai
import pytest
import torch
from colibri_stream import Engine
from colibri_stream.serve import make_server, serve_in_thread

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def served(tiny):
    # f32 kernels: a batch's rows then equal each prompt alone to f32 rounding on every CPU (runs.py)
    with Engine.open(tiny[0], ram_budget="200MB", kernel_dtype="f32") as engine:
        server = make_server(engine, "127.0.0.1", 0, model_name=MODEL)
        serve_in_thread(server)
        yield engine, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        server.shutdown()
        server.server_close()


def test_n_choices_are_one_batch_each_seeded_as_n1_with_seed_plus_j(served):
    engine, client = served
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0)
    singles = [client.chat.completions.create(**kwargs, seed=5 + j) for j in range(3)]
    alone = [r.choices[0].message.content for r in singles]
    steps = engine.stats.steps
    got = client.chat.completions.create(**kwargs, seed=5, n=3)
    assert engine.stats.steps - steps <= 8  # one batched prefill, then one pass per step for all rows
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == alone
    assert len(set(alone)) > 1  # the seeds differ, so the choices do
    assert got.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    assert got.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    # completions: a list of prompts x n, index = prompt * n + choice, as OpenAI numbers them
    prompts = ["Once upon a time", "The little bird"]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0.8, seed=11)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        for j in range(2):
            one = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0.8, seed=11 + j)
            assert batch.choices[i * 2 + j].text == one.choices[0].text
    streamed = list(client.chat.completions.create(**kwargs, seed=5, n=3, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == j) for j in range(3)]
    assert texts == alone
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs, n=0)
    assert err.value.body["param"] == "n"


def test_logprobs_on_both_endpoints_are_the_models(served):
    engine, client = served
    prompt = "Once upon a time"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    ids = engine.encode(prompt)
    logits = engine.logits(ids + engine.encode(got.choices[0].text))
    want = torch.log_softmax(logits[len(ids) - 1], -1)
    assert lp.token_logprobs[0] == pytest.approx(float(want.max()), abs=1e-4)  # greedy: the top token
    assert max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0], abs=1e-6)
    assert all(len(top) == 3 for top in lp.top_logprobs) and len(lp.tokens) == 5
    assert "".join(lp.tokens) == got.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
    assert entries[0].logprob == pytest.approx(entries[0].top_logprobs[0].logprob, abs=1e-6)
    assert bytes(entries[0].bytes).decode() == entries[0].token
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    assert "logprobs" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, logprobs=21)


def test_echo_scores_the_prompt_as_eval_harnesses_need(served):
    engine, client = served
    prompt = "The little bird sang a song"
    ids = engine.encode(prompt)
    rows = torch.log_softmax(engine.logits(ids), -1)
    want = [float(rows[i - 1, ids[i]]) for i in range(1, len(ids))]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
    # lm-eval's request: token ids, echo, logprobs 1, max_tokens 1; the generated token follows
    more = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = more.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    assert more.choices[0].text == prompt + engine.generate(prompt, 1).text
    assert lp.text_offset[: 2] == [0, len(lp.tokens[0])]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == prompt + engine.generate(prompt, 2).text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)  # 0 only with echo


def test_usage_reports_the_reused_prefix_as_cached_tokens(served):
    engine, client = served
    messages = [{"role": "user", "content": "Name three rivers."}]
    before = engine.stats.prefill_tokens
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    # a pooled session of an earlier test may share the template's header with this prompt
    reused = first.usage.prompt_tokens_details.cached_tokens
    assert reused < first.usage.prompt_tokens and engine.stats.prefill_tokens - before == first.usage.prompt_tokens - reused
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And three lakes?"}]
    before = engine.stats.prefill_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    prefilled = engine.stats.prefill_tokens - before
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1  # the first turn's prompt (at least) was not run again
    assert prefilled == usage.prompt_tokens - cached  # the KV cache really held those tokens
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True))
    assert all(getattr(c, "usage", None) is None for c in plain)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"


def test_colibri_telemetry_is_the_requests_share_of_the_engine_counters(served):
    engine, client = served
    before = engine.stats.to_dict()
    got = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    after = engine.stats.to_dict()
    tele = got.model_extra["colibri"]
    assert tele["expert_hits"] == after["hits"] - before["hits"]
    assert tele["expert_misses"] == after["misses"] - before["misses"]
    assert tele["bytes_read"] == after["bytes_read"] - before["bytes_read"]
    assert tele["expert_hits"] + tele["expert_misses"] > 0 and 0 <= tele["expert_hit_rate"] <= 1
    assert tele["prefill_tokens"] == len(engine.encode("Hello there")) and tele["decode_tokens"] == 5
    assert tele["tokens_per_s"] > 0 and 0 <= tele["ttft_seconds"] <= tele["seconds"]
    assert tele["io_wait_seconds"] >= 0 and tele["concurrent_requests"] == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    tele, usage = chunks[-1].model_extra["colibri"], chunks[-1].usage
    run = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens + usage.completion_tokens - 1
    assert tele["prefill_tokens"] + tele["decode_tokens"] == run  # the last sampled token is never run
