"""`colibri-stream serve`: the real server on a free loopback port, driven by the official
`openai` client (chat and completions, plain and SSE streaming, logprobs) and by raw HTTP for
the error shapes."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from colibri_stream import Engine
from colibri_stream.serve import make_server, serve_in_thread

MODEL = "tiny-test"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def served(tiny):
    # f32 expert kernels: these tests hold a batched request equal to each prompt alone, and
    # torch's bf16 int4 kernel rounds a many-row batch differently from one row where the CPU has
    # AMX (logprobs ~5e-4 apart), and the native kernel's int8 activations can round either way
    # on such differences; torch's kernel in f32 agrees to f32 rounding on every CPU.
    with Engine.open(tiny[0], ram_budget="200MB", compute="int4", kernel_dtype="f32") as engine:
        server = make_server(engine, "127.0.0.1", 0, model_name=MODEL)
        serve_in_thread(server)
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        yield engine, server, client
        server.shutdown()
        server.server_close()


def test_models_lists_the_served_model(served):
    engine, server, client = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.server_address[0] == "127.0.0.1"
    root = server.url.removesuffix("/v1")

    def post(path, body):
        request = urllib.request.Request(root + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read())

    ids = post("/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})["tokens"]
    assert ids == engine.encode("Once upon a time")
    assert post("/detokenize", {"tokens": ids})["prompt"] == "Once upon a time"
    info = json.loads(urllib.request.urlopen(root + "/tokenizer_info", timeout=30).read())
    assert engine.encode(info["eos_token"]) == [engine.end_token_ids[0]] and info["model_max_length"] == engine.max_context
    with pytest.raises(urllib.error.HTTPError) as http:
        post("/tokenize", {"prompt": 3})
    assert http.value.code == 400 and json.loads(http.value.read())["error"]["param"] == "prompt"


def test_chat_completion_is_the_engines_chat(served):
    engine, _, client = served
    want = engine.chat(MESSAGES, 12, stop_token_ids=engine.end_token_ids)
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == len(want.token_ids)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")


def test_chat_streaming_adds_up_to_the_full_reply(served):
    _, _, client = served
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_with_logprobs_and_sampling(served):
    engine, _, client = served
    want = engine.generate("Once upon a time", 8)
    got = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    choice = got.choices[0]
    assert choice.text == want.text
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text
    kwargs = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0.9, top_p=0.95, seed=3,
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens and len(entries[0].top_logprobs) == 3


def test_a_list_of_prompts_is_one_batch_with_a_choice_each(served):
    engine, _, client = served
    prompts = ["Once upon a time", "Hi", "The little bird sang a song today"]
    want = [engine.generate(p, 8) for p in prompts]
    steps = engine.stats.steps
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, logprobs=1)
    assert engine.stats.steps - steps <= 1 + 7  # one prefill pass, then one pass per step for all rows
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == [("length" if w.finish_reason == "length" else "stop")
                                                      for w in want]
    for choice, w in zip(got.choices, want):
        assert choice.logprobs.token_logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert got.usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    ids = [engine.encode(p) for p in prompts]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in as_ids.choices] == [w.text for w in want]
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [w.text for w in want]
    assert sorted(c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert streamed[-1].usage.completion_tokens == got.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=MODEL, prompt=["Hi", 3], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model=MODEL, prompt=["Hi", ""], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["Hi", "word " * (engine.max_context + 10)], max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"


def test_stop_strings_cut_the_reply(served):
    _, _, client = served
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped(served):
    engine, server, client = served
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", logit_bias={"1": 5})
    assert err.value.body["param"] == "logit_bias" and err.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"temprature": 0.5})
    assert err.value.body == {"message": "unknown parameter 'temprature'", "type": "invalid_request_error",
                              "param": "temprature", "code": "unknown_parameter"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="word " * (engine.max_context + 10), max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    request = urllib.request.Request(server.url + "/chat/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    assert http.value.code == 400 and json.loads(http.value.read())["error"]["code"] == "invalid_json"
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(server.url + "/nothing", timeout=30)
    assert http.value.code == 404 and "error" in json.loads(http.value.read())


def test_concurrent_requests_get_their_own_answers(served):
    _, _, client = served
    prompts = ["Once upon a time", "The little bird", "Hello there"]
    want = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
            for p in prompts}
    got: dict[str, str] = {}

    def ask(prompt):
        got[prompt] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_the_cli_serves_on_loopback(tiny):
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-c", "from colibri_stream.cli import main; main()", "serve", str(tiny[0]), "--ram-budget", "200MB", "--port", "0",
           "--model-name", MODEL, "--threads", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        assert url, line
        client = openai.OpenAI(base_url=url.group(1), api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens <= 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run(cmd[:-6] + ["--port", "70000"], capture_output=True, text=True)
    assert bad.returncode == 2 and "70000" in bad.stderr


def test_a_resent_conversation_prefills_only_its_new_turn(served):
    engine, server, client = served
    messages = [{"role": "user", "content": "Name three birds."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And three fish?"}]
    before = engine.stats.prefill_tokens
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    prefilled = engine.stats.prefill_tokens - before
    assert prefilled <= second.usage.prompt_tokens - first.usage.prompt_tokens + 1  # not the first turn again
    assert second.choices[0].message.content == engine.chat(messages, 8).text
    assert 1 <= len(server.pool) <= 4
