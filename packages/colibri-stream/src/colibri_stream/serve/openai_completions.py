"""`POST /v1/completions`: OpenAI's legacy completions over a `ServeContext`.

`prompt` is a string, a list of token ids, or a list of either (a choice per prompt and per `n`,
`index` = prompt * n + choice, all rows one batch: runs.py). `logprobs` n (<= 20) reports each
token's logprob and the n most likely alternatives. `echo` puts the prompt before the completion,
in the text and in the logprobs: each prompt token scored under the model given the tokens
before it, the first one `null` (nothing precedes it), as OpenAI answers. That is how eval
harnesses score a continuation through a server (lm-eval's `local-completions` sends
`echo: true, logprobs: 1, max_tokens: 1` and sums the continuation's logprobs); `max_tokens: 0`
with `echo` scores the prompt without generating. The rest as chat (openai_chat.py).
"""

from __future__ import annotations

import time
import uuid

import torch

from . import params
from .errors import bad, unsupported
from .openai_chat import FINISH, base_spec, max_tokens
from .runs import Answer, Run, drain, single
from .telemetry import RequestTelemetry

KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
         "seed", "logprobs", "echo", "presence_penalty", "frequency_penalty", "top_k", "min_p",
         "repetition_penalty"}
IGNORED = {"user", "best_of"}
REFUSED = {"logit_bias": "the sampler takes no per-token bias", "suffix": "this model does not fill in the middle"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest:
    def __init__(self, ctx, body):
        params.check_fields(body, KNOWN, IGNORED, REFUSED, ctx.model_name)
        n = params.number(body, "n", 1, 1, integer=True)
        if params.number(body, "best_of", n, 1, integer=True) != n:
            raise unsupported("best_of", "only best_of == n (no server-side ranking)")
        self.echo = params.boolean(body, "echo")
        self.spec = base_spec(body, max_tokens(body, ("max_tokens",), DEFAULT_MAX_TOKENS, 0 if self.echo else 1))
        if body.get("logprobs") is not None:
            self.spec.logprobs = int(params.number(body, "logprobs", 0, 0, 20, integer=True))
        self.stream = params.boolean(body, "stream")
        self.include_usage = params.stream_options(body, self.stream)
        if self.echo and self.spec.n > 1:
            raise unsupported("echo", "echo with n > 1")
        self.prompts = prompts_of(ctx.engine, body.get("prompt"))


def prompts_of(engine, prompt, field: str = "prompt") -> list[list[int]]:
    """A string, token ids, or a non-empty list of either, as token id lists (400s name `field`)."""

    def is_ids(value) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if prompt == "" or prompt == []:
        raise bad(f"'{field}' is empty", field)
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad(f"'{field}' must be a string, a list of token ids, or a non-empty list of either", field)
    vocab = engine.tokenizer.get_vocab_size()
    out = []
    for p in prompts:
        ids = engine.encode(p) if isinstance(p, str) else p
        if not ids:
            raise bad(f"'{field}' is empty", field)
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"{field} token ids must be in [0, {vocab})", field)
        out.append(ids)
    return out


class Echo:
    """One prompt's own logprobs (the first null), and its generation continuing the same session."""

    def __init__(self, ctx, ids: list[int], request: CompletionRequest):
        engine, top = ctx.engine, request.spec.logprobs or 0
        if len(ids) + max(request.spec.max_tokens, 1) > engine.max_context:
            raise bad(f"the prompt ({len(ids)} tokens) and max_tokens do not fit the engine's "
                      f"max_context={engine.max_context}", "prompt", "context_length_exceeded")
        telemetry = RequestTelemetry(engine, ctx.in_flight)  # the prefill below is the request's too
        session = engine.session()
        rows = torch.log_softmax(session.append(ids, all_logits=True).float().cpu(), dim=-1)
        self.ids, self.logprobs, self.top = ids, [None], [None]
        for i in range(1, len(ids)):
            self.logprobs.append(float(rows[i - 1, ids[i]]))
            if top:
                values, which = torch.topk(rows[i - 1], top)
                self.top.append([(int(t), float(v)) for t, v in zip(which, values)])
            else:
                self.top.append([])
        try:
            stream = session.stream((), request.spec.max_tokens, **request.spec.session_kwargs(0))
        except ValueError as exc:
            raise bad(str(exc)) from None
        self.run = single(engine, stream, 0, ctx.in_flight, telemetry, len(ids))
        self.text = engine.tokenizer.decode(ids)


def start(ctx, request: CompletionRequest) -> tuple[Run, list[Echo]]:
    if not request.echo:
        return ctx.prompt_run(request.prompts, request.spec), []
    echoes = [Echo(ctx, ids, request) for ids in request.prompts]
    return Chained(echoes), echoes


class Chained:
    """Echoed prompts run one after another (each on its own session), seen as one `Run`."""

    def __init__(self, echoes: list[Echo]):
        self.echoes = echoes
        self.events = ((i, t) for i, e in enumerate(echoes) for _, t in e.run.events)

    @property
    def results(self):
        return [e.run.results[0] for e in self.echoes]

    def usage(self) -> dict:
        prompt = sum(len(e.ids) for e in self.echoes)
        completion = sum(len(r.token_ids) for r in self.results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0}}

    def telemetry(self) -> dict:
        reports = [e.run.telemetry() for e in self.echoes]
        return reports[0] if len(reports) == 1 else {"prompts": reports}


def _piece(engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def logprobs_block(engine, ids, logprobs, tops, texts, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top, text in zip(ids, logprobs, tops, texts):
        out["tokens"].append(_piece(engine, token_id))
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else {_piece(engine, i): lp for i, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def generated_block(engine, tokens, offset: int = 0) -> dict:
    real = [t for t in tokens if t.id is not None]
    return logprobs_block(engine, [t.id for t in real], [t.logprob for t in real], [t.top_logprobs for t in real],
                          [t.text for t in real], offset)


def echo_block(engine, echo: Echo) -> dict:
    texts = [_piece(engine, i) for i in echo.ids]
    return logprobs_block(engine, echo.ids, echo.logprobs, echo.top, texts)


def full_response(ctx, request: CompletionRequest, run, echoes: list[Echo]) -> dict:
    engine, choices = ctx.engine, []
    for index, result in enumerate(run.results):
        text, logprobs = result.text, None
        if echoes:
            echo = echoes[index]
            text = echo.text + text
            if request.spec.logprobs is not None:
                logprobs = echo_block(engine, echo)
                tail = generated_block(engine, result.tokens, len(echo.text))
                for key in logprobs:
                    logprobs[key] += tail[key]
        elif request.spec.logprobs is not None:
            logprobs = generated_block(engine, result.tokens)
        choices.append({"index": index, "text": text, "finish_reason": FINISH[result.finish_reason],
                        "logprobs": logprobs})
    return {"id": new_id(), "object": "text_completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": choices, "usage": run.usage(), "system_fingerprint": None, "colibri": run.telemetry()}


def new_id() -> str:
    return "cmpl-" + uuid.uuid4().hex[:24]


def stream_events(ctx, request: CompletionRequest, run, echoes: list[Echo]):
    engine, ident, created = ctx.engine, new_id(), int(time.time())
    want_logprobs = request.spec.logprobs is not None

    def chunk(index, text, finish=None, logprobs=None) -> dict:
        out = {"id": ident, "object": "text_completion", "created": created, "model": ctx.model_name,
               "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if request.include_usage:
            out["usage"] = None
        return out

    for index, echo in enumerate(echoes):
        yield chunk(index, echo.text, logprobs=echo_block(engine, echo) if want_logprobs else None)
    for index, token in run.events:
        if token.text or (token.id is not None and want_logprobs):
            logprobs = generated_block(engine, [token]) if token.id is not None and want_logprobs else None
            yield chunk(index, token.text, logprobs=logprobs)
    for index, result in enumerate(run.results):
        last = chunk(index, "", FINISH[result.finish_reason])
        if not request.include_usage:
            last["colibri"] = run.telemetry()
        yield last
    if request.include_usage:
        yield {"id": ident, "object": "text_completion", "created": created, "model": ctx.model_name,
               "choices": [], "usage": run.usage(), "colibri": run.telemetry()}


def answer(ctx, body) -> Answer:
    request = CompletionRequest(ctx, body)
    run, echoes = start(ctx, request)
    if request.stream:
        return Answer(events=((None, c) for c in stream_events(ctx, request, run, echoes)), done_marker=True)
    drain(run)
    return Answer(full_response(ctx, request, run, echoes))
