"""What every endpoint shares: the engine, the served name, the chat template, the pooled chat
sessions, the in-flight count; and the two ways a request starts generating (a conversation, or
raw prompts), each returning a `Run` (runs.py). The API modules only translate field names and
shapes around these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..chat import ChatTemplate, ChatTemplateError, ContextOverflowError
from .constrained import Grammars
from .errors import bad
from .runs import Run, Spec, batched, single
from .session_pool import ChatSessionPool
from .telemetry import InFlight


@dataclass
class ServeContext:
    engine: object
    model_name: str
    pool: ChatSessionPool
    template: ChatTemplate
    grammars: Grammars
    in_flight: InFlight = field(default_factory=InFlight)
    embedding_pooling: str = "mean"  # /v1/embeddings: the mean or the last token's hidden state

    def chat_run(self, messages: list[dict], spec: Spec, template_variables: dict | None = None) -> Run:
        """The assistant's next turn after `messages` ({role, content, ...} as the template takes
        them). `n` = 1 continues the pooled session sharing the longest prefix (only the new turn
        is prefilled: `cached_tokens`); `n` > 1 decodes the choices as one batch."""
        template = self.template.with_variables(**template_variables) if template_variables else self.template
        try:
            if spec.n > 1:
                ids = template.encode(messages)
                return self._batched([ids], spec)
            chat = self.pool.take(template.encode(messages))
            chat.template = template
            prompt_tokens = len(chat.prompt_ids(messages, spec.max_tokens))  # after the overflow policy
            stream = chat.stream(messages, spec.max_tokens, **spec.session_kwargs(0))
            cached = chat.session.kv.length  # what the truncate to the shared prefix kept, already run
            return single(self.engine, stream, cached, self.in_flight, prompt_tokens=prompt_tokens,
                          tokens=self.pool.returning(chat, stream))
        except ContextOverflowError as exc:
            raise bad(str(exc), "messages", "context_length_exceeded") from None
        except ChatTemplateError as exc:
            raise bad(str(exc), "messages") from None
        except ValueError as exc:
            raise _value_error(exc) from None

    def prompt_run(self, prompts: list[list[int]], spec: Spec) -> Run:
        """Raw prompts (token ids): one prompt and one choice on a fresh session, else a batch."""
        try:
            if len(prompts) == 1 and spec.n == 1:
                stream = self.engine.session().stream(prompts[0], spec.max_tokens, **spec.session_kwargs(0))
                return single(self.engine, stream, 0, self.in_flight, prompt_tokens=len(prompts[0]))
            return self._batched(prompts, spec)
        except ValueError as exc:
            raise _value_error(exc) from None

    def _batched(self, prompts: list[list[int]], spec: Spec) -> Run:
        return batched(self.engine, prompts, spec, self.in_flight)


def _value_error(exc: ValueError):
    code = "context_length_exceeded" if "max_context" in str(exc) else None
    return bad(str(exc), None, code)
