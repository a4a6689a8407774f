"""Reading a request body's fields: one checker per kind of value, each failing with one 400 that
names the field; and the rule that every top-level field is known, ignored on purpose (named), or
refused with the reason, never dropped silently."""

from __future__ import annotations

from .errors import APIError, bad, unsupported


def check_fields(body, known: set[str], ignored: set[str] = frozenset(), refused: dict[str, str] | None = None,
                 model_name: str | None = None) -> dict:
    """`body` as a dict whose every key is in `known` or `ignored`; a key of `refused` gets its
    reason; `model` must name the served model (404 otherwise, as OpenAI and Anthropic answer)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name, why in (refused or {}).items():
        if body.get(name) not in (None, False, [], {}):
            raise unsupported(name, why)
    for name in body:
        if name not in known and name not in ignored and name not in (refused or {}):
            raise bad(f"unknown parameter '{name}'", name, "unknown_parameter")
    if model_name is not None and body.get("model") != model_name:
        raise APIError(404, f"The model '{body.get('model')}' does not exist; this server serves '{model_name}'",
                       "model", "model_not_found")
    return body


def number(body: dict, name: str, default, low=None, high=None, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(f"'{name}' must be in [{low}, {high if high is not None else 'inf'}], got {value!r}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def stop_strings(body: dict, name: str = "stop", most: int | None = 4) -> list[str]:
    stop = body.get(name)
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or (most and len(stop) > most):
        limit = f" of at most {most}" if most else ""
        raise bad(f"'{name}' must be a string or a list{limit} strings", name)
    return [s for s in stop if s]


def seed(body: dict) -> int | None:
    value = body.get("seed")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(f"'seed' must be an integer, got {value!r}", "seed")
    return value


def sampling_extensions(body: dict) -> dict:
    """llama.cpp's and vLLM's extensions beside OpenAI's fields (`extra_body` in the openai client)."""
    return dict(top_k=int(number(body, "top_k", 0, 0, integer=True)),
                min_p=float(number(body, "min_p", 0.0, 0, 1)),
                repetition_penalty=float(number(body, "repetition_penalty", 1.0, 1e-6)))


def no_penalties(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if number(body, name, 0, -2, 2) != 0:
            raise unsupported(name, "use 'repetition_penalty' (multiplicative, as transformers applies it)")


def stream_options(body: dict, streaming: bool) -> bool:
    """`stream_options.include_usage` (an object, only beside `stream: true`, as OpenAI checks)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise bad("'stream_options' must be an object with 'include_usage'", "stream_options")
    if not streaming:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return boolean(options, "include_usage")
