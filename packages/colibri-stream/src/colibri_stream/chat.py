"""Chat: messages through the model's chat template, and a chat session that keeps its KV cache.

`ChatTemplate` renders a list of {role, content} messages to token ids: with the container's own
Jinja template where it carries one (`Container.chat_template`, container format 1.1, written by
`colibri-int4 import-hf`), rendered by jinja2 in a sandbox the way transformers renders it
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
`strftime_now`; trim_blocks / lstrip_blocks), the text then tokenized with special tokens
recognised; else with colibri-model's ChatML template (colibri_model.chat, the tokenization the
model was trained on).

`ChatSession` holds one `Session` for the whole conversation. Each call renders the full message
list, keeps the longest common prefix of those ids with what the session already holds (the
earlier turns and the reply it generated), truncates to it and prefills only the rest: turn n
costs its new tokens, not the whole history.

Context overflow policy: when the rendered conversation leaves less than `max_new_tokens` of room
in `max_context`, the oldest messages after the leading system message(s) are dropped, one at
a time, until it fits or only the last message is left (the KV cache is then rebuilt from the
first changed token: a re-prefill). If even the system message(s) and the last message leave no
room for one new token, `ContextOverflowError` says so. Generation stops at `max_context`
(finish_reason "length").
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from datetime import datetime

from colibri_model import encode_chat, validate_messages

from .errors import ChatTemplateError, ContextOverflowError
from .generation import GenerationResult, StreamedToken, TokenStream, result_sink


class ChatTemplate:
    def __init__(self, tokenizer, source: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, variables: dict | None = None):
        self.tokenizer, self.source = tokenizer, source
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.variables = dict(variables or {})  # passed to the template beside `messages` (e.g. `tools`)
        self._compiled = None
        if source is not None:
            self._compiled = _compile(source)

    def with_variables(self, **variables) -> ChatTemplate:
        """The same template rendering with extra variables (transformers passes `tools` this
        way); the compiled Jinja is shared."""
        twin = ChatTemplate(self.tokenizer, None, self.bos_token, self.eos_token, {**self.variables, **variables})
        twin.source, twin._compiled = self.source, self._compiled
        return twin

    @classmethod
    def for_engine(cls, engine) -> ChatTemplate:
        """The container's template if it carries one, else ChatML."""
        source = engine.container.chat_template
        config = engine.container.tokenizer_config or {}
        return cls(engine.tokenizer, source, config.get("bos_token"), config.get("eos_token"))

    @property
    def name(self) -> str:
        return "container" if self.source is not None else "chatml"

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            from colibri_model import format_chat

            return format_chat(messages, add_generation_prompt)
        try:
            return self._compiled.render(**self.variables, messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2's own errors while rendering
            raise ChatTemplateError(f"the container's chat template failed to render: {exc}") from None

    def encode(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        if self._compiled is not None:  # a template may take what ChatML cannot (tool turns)
            return self.tokenizer.encode(self.render(messages, add_generation_prompt), add_special_tokens=False).ids
        validate_messages(list(messages), "chat")
        return encode_chat(messages, self.tokenizer, add_generation_prompt=add_generation_prompt)[0]


def _compile(source: str):
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency of colibri-stream
        raise ChatTemplateError("rendering the container's chat template needs jinja2 (pip install jinja2)") from None

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the container's chat template is not valid Jinja: {exc}") from None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """A conversation on one engine whose KV cache survives between turns (module docstring).

        >>> chat = engine.chat_session()                                          # doctest: +SKIP
        >>> messages = [{"role": "user", "content": "Hi!"}]
        >>> reply = chat.reply(messages, 64)
        >>> messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "More"}]
        >>> chat.reply(messages, 64).prefilled_tokens       # only the new turn's tokens
    """

    def __init__(self, engine, template: ChatTemplate | None = None):
        self.engine = engine
        self.template = template or ChatTemplate.for_engine(engine)
        self.session = engine.session()
        self.dropped_messages = 0  # by the overflow policy, at the last call

    def prompt_ids(self, messages: Sequence[dict], max_new_tokens: int) -> list[int]:
        """The conversation's ids after the overflow policy (sets `dropped_messages`)."""
        messages = list(messages)
        if self.template.source is None:  # ChatML's roles; a container's template judges its own
            validate_messages(messages, "chat")
        limit = self.engine.max_context
        head = 0
        while head < len(messages) and messages[head]["role"] == "system":
            head += 1
        kept = list(messages)
        self.dropped_messages = 0
        ids = self.template.encode(kept)
        while len(ids) + max_new_tokens > limit and len(kept) > head + 1:
            del kept[head]
            self.dropped_messages += 1
            ids = self.template.encode(kept)
        if len(ids) + 1 > limit:
            raise ContextOverflowError(
                f"the conversation does not fit the context: {len(ids)} tokens for the system message(s) and the "
                f"last message alone, max_context={limit} (open the engine with a larger max_context, or shorten "
                "the message)")
        return ids

    def stream(self, messages: Sequence[dict], max_new_tokens: int = 256, *, result: list | None = None,
               **kwargs) -> TokenStream:
        """The assistant's next turn, streamed (`Session.stream` for the options); the stream's
        `result`, once exhausted, counts the whole prompt in `prompt_tokens`."""
        ids = self.prompt_ids(messages, max_new_tokens)
        reused = common_prefix(self.session.tokens, ids)
        reused = min(reused, len(ids) - 1)  # at least one token runs: its logits start the reply
        self.session.truncate(reused)
        tokens = self.session.stream(ids[reused:], max_new_tokens, **kwargs)
        return TokenStream(self._finish(tokens, len(ids)), result_sink(result))

    @staticmethod
    def _finish(tokens: TokenStream, prompt_tokens: int) -> Generator[StreamedToken, None, GenerationResult | None]:
        yield from tokens
        if tokens.result is not None:  # the session ran only the new turn; the result names the whole prompt
            tokens.result.prompt_tokens = prompt_tokens
        return tokens.result

    def reply(self, messages: Sequence[dict], max_new_tokens: int = 256, *, on_text=None,
              **kwargs) -> GenerationResult:
        tokens = self.stream(messages, max_new_tokens, **kwargs)
        for token in tokens:
            if on_text is not None and token.text:
                on_text(token.text)
        return tokens.result
