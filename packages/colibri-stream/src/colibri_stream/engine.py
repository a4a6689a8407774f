"""`Engine`: a Colibri int4 container served under a RAM budget.

    >>> from colibri_stream import Engine
    >>> print(Engine.plan("model.coli").min_budget)                         # doctest: +SKIP
    >>> with Engine.open("model.coli", ram_budget="600MB") as eng:          # doctest: +SKIP
    ...     print(eng.generate("The capital of France is", max_new_tokens=16).text)
    ...     print(eng.stats.to_dict()["hit_rate"])

`Engine.plan` reads the container header and says how a budget is split (plan.py) without
building anything; `Engine.open` follows that plan: it builds colibri-model's
`ColibriForCausalLM` with a `StreamedExperts` backend per MoE layer (the transformer math is
colibri-model's, not a copy; assembly.py) and preallocates the KV cache. The engine is the
user's facade: what runs the model (the model, cache, stats, lock and I/O accounting) is its
`runner` (runner.py), what turns text into ids its `codec` (generation.py's `TextCodec`), and
sessions and batches are given those two, never the engine. Every forward pass,
prefill or decode, goes through the KV cache in chunks of at most `prefill_chunk` tokens, so
activations stay within the workspace the budget reserved. Serving uses the config's
`top_k_infer` (top-1 for the presets, trained at top-2) unless `top_k` is given.

Contexts are `Session`s (session.py): `engine.session()` holds its own KV cache and token ids
(`append(ids) -> logits`, `fork`, `truncate`, `stream`, `generate`); `generate`, `stream`,
`logits`, `embed` and `chat` each run on a fresh session. Threads: the weights, the expert cache, the
prefetcher and `stats` are shared, so every forward pass, whatever its session, holds the
runner's lock; sessions may be used from several threads (one thread per session
at a time), and the decode steps of sessions generating at the same time run as one pass
(`batch_sessions`, step_combiner.py: continuous batching). `forward_tokens` / `reset` / `context_length` are the engine's own default session,
one context: kept for single-threaded callers, not for concurrent use.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from colibri_int4 import Container
from colibri_model import EOS_TOKEN, IM_END

from .assembly import assemble, compute_routes, plan_for
from .chat import ChatSession, ChatTemplate
from .generation import GenerationResult, TextCodec, TokenStream
from .hit_rate_target import budget_for_hit_rate
from .io.heap import HeapTrimmer
from .options import EngineOptions
from .plan import Plan
from .runner import ForwardRunner
from .session import Session
from .session_kv import SessionKV
from .sizes import parse_budget
from .traces.routing_trace import RoutingTrace, read_trace, write_trace


class Engine:
    """A served model. Create with `Engine.open`; close (or use `with`) to release the file."""

    def __init__(self, container: Container, plan: Plan, options: EngineOptions):
        parts = assemble(container, plan, options)
        self.container, self.opened_plan, self.options = container, plan, options  # opened_plan: what Engine.plan said
        self.config, self.model, self.cache = parts.config, parts.model, parts.cache
        self.reader, self.tokenizer, self.stats = parts.reader, parts.tokenizer, parts.stats
        self.budget = plan.budget
        self.max_context, self.prefill_chunk = plan.footprint.max_context, plan.footprint.prefill_chunk
        self.device = options.device
        self._default_session: Session | None = None
        self._chat_template: ChatTemplate | None = None
        self.path = container.path
        self.heap_trimmer = HeapTrimmer(self.budget.heap_slack_bytes)
        self.runner = ForwardRunner(self.model, self.cache, self.stats, self.heap_trimmer, max_context=self.max_context,
                                    prefill_chunk=self.prefill_chunk, device=self.device, dtype=plan.footprint.dtype,
                                    batch_sessions=options.batch_sessions)
        self.codec = TextCodec(self.tokenizer, tuple(_end_token_ids(container, self.tokenizer)))

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, ram_budget: str | int = "600MB", **options) -> Engine:
        """Open a container under `ram_budget` (bytes, "600MB", or "auto": fit under this
        process's cgroup memory limit, else MemAvailable; io/memory_cap.py).

        Options (`EngineOptions`): `compute` "auto" | "int4" | "dequant" (auto: torch's CPU
        int4 kernels where the shapes allow and where they are not timed slower than the
        dequantized matmuls on this CPU, compute/choice.py; always dequantized on CUDA);
        `dtype` "f32" | "bf16" for resident weights, activations and KV cache (unset: f32, bf16
        when the resident weights exceed 2 GiB in f32 or the budget cannot hold f32, plan.py); `kernel_dtype` "bf16" | "f32" for
        activations inside the int4 kernels (bf16 is the fast path, f32 the exact one);
        `device`; `cache_policy` (name or `CachePolicy`, default next-use, chosen on real
        routing); `top_k` (routed experts per token, default the config's top_k_infer; above the
        trained top-k only with `allow_extra_experts=True`); `max_context` (KV cache
        length; unset: max_seq_len capped at 4096, halved where the budget needs); `prefill_chunk` (tokens per
        forward pass; unset: 128, less where the budget needs); `direct_io`; `record_trace`;
        `prefetch` "auto" | "off" | "predict" | "on" (read the next layer's predicted experts on
        `prefetch_threads` workers; "predict" only measures the guess; "auto", the default, is
        "on" for experts of 512 KiB or more when a CPU is free beyond torch's threads and the
        cache cannot hold every expert; set torch's threads before opening); `slab` (default
        True: int4 experts live in one allocation made now, cache/slab.py); `tokenizer`
        (default: the container's, else colibri-model's bundled one); `batch_sessions` (default
        True: sessions generating on several threads at once have their decode steps run as one
        pass, step_combiner.py; with the native kernels each row of a step of up to 16 keeps the
        bits it gets alone); `map_weights` "auto" | "off" | "all" (native kernels: compute
        projections on a read-only map of the container instead of holding a copy; "auto" maps
        the fewest, from the last layer down, only where the budget cannot hold them all with
        every unset default stepped down, or the few that make room for "auto" prefetch's
        buffers: they are read through the page cache every token, from the disk again where
        memory is short; "all": every one, as llama.cpp's mmap).

        Raises `BudgetError` (naming the minimum) when `ram_budget` cannot hold the resident
        part (less what `map_weights` may map) plus one layer's working set,
        `colibri_int4.ContainerError` for a damaged file.
        """
        budget = parse_budget(ram_budget)
        opts = EngineOptions(**options)
        container = Container.open(path)
        try:  # compute="auto" is timed here, once, before the (pure) plan is built
            return cls(container, plan_for(container, opts, budget, compute=compute_routes(container, opts)), opts)
        except BaseException:
            container.close()
            raise

    @staticmethod
    def plan(container: str | os.PathLike | Container, ram_budget: str | int | None = None, *,
             trace: str | os.PathLike | RoutingTrace | None = None, hit_rate: float | None = None,
             **options) -> Plan:
        """The plan `Engine.open` would follow, from the header alone (plan.py): `min_budget`,
        `full_budget` (every expert cached), the split at `ram_budget` if given ("auto" too),
        and with a routing `trace` and a `hit_rate` target the least budget reaching it."""
        opts = EngineOptions(**options)
        budget = None if ram_budget is None else parse_budget(ram_budget)
        own = not isinstance(container, Container)
        opened = Container.open(container) if own else container
        try:
            plan = plan_for(opened, opts, budget, compute=compute_routes(opened, opts))
        finally:
            if own:
                opened.close()
        if trace is not None or hit_rate is not None:
            if trace is None or hit_rate is None:
                raise ValueError("a hit-rate target needs both a routing trace and hit_rate")
            source = str(trace) if not isinstance(trace, RoutingTrace) else "the trace"
            routing = trace if isinstance(trace, RoutingTrace) else read_trace(trace)
            target = budget_for_hit_rate(plan, routing, hit_rate, opts.cache_policy, source)
            plan = replace(plan, target=target)
        return plan

    def close(self) -> None:
        self.cache.close()
        self.reader.close()
        self.container.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_stats(self) -> None:
        """Start a new measurement window (counters and the OS read_bytes baseline alike)."""
        self.runner.reset_stats()

    @property
    def top_k(self) -> int:
        """Routed experts per token per layer, as served (the `top_k` option or top_k_infer)."""
        return self.opened_plan.footprint.top_k

    def save_trace(self, path: str | os.PathLike, source: str = "") -> Path:
        """Write the routing trace recorded since the last reset as a ROUTING_TRACE.md file (for
        `colibri-stream policy-study`). Needs `record_trace=True` at open."""
        if not self.stats.record_trace:
            raise ValueError("this engine records no routing trace: open it with record_trace=True")
        config = self.config
        return write_trace(path, self.stats.trace, n_moe_layers=config.n_layers - config.n_dense_layers,
                           n_experts=config.n_experts, top_k=self.top_k, model=Path(self.path).name, source=source)

    # --- forward passes --------------------------------------------------------------------
    def session(self) -> Session:
        """A new, empty context on this engine (session.py)."""
        return Session(self.runner, self.codec)

    def new_session_kv(self) -> SessionKV:
        return self.runner.new_session_kv()

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one context position holds (per session)."""
        return self.new_session_kv().bytes_per_position

    @property
    def end_token_ids(self) -> list[int]:
        """Token ids that end a generation by default: the container's (format 1.1), else
        `<|endoftext|>` and `<|im_end|>` where the tokenizer has them."""
        return list(self.codec.end_token_ids)

    @property
    def _context(self) -> Session:
        if self._default_session is None:
            self._default_session = self.session()
        return self._default_session

    @property
    def context_length(self) -> int:
        """Tokens the engine's default context holds now (see `forward_tokens`)."""
        return len(self._context)

    def reset(self) -> None:
        """Empty the engine's default context."""
        self._context.reset()

    def forward_tokens(self, ids: Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append `ids` to the engine's default context (one session, for single-threaded use;
        `engine.session()` gives independent ones) and return its logits (`Session.append`)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("forward_tokens() needs at least one token")
        return self._context.append(ids, all_logits=all_logits)

    def logits(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits `[T, vocab]` (on the CPU) of one sequence (a 1-D tensor or list of token
        ids), on a fresh session: row t scores the token after position t."""
        ids = input_ids.flatten().tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if not ids:
            raise ValueError("logits() needs at least one token")
        return self.session().append(ids, all_logits=True).cpu()

    def packed_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                      rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] at (rows, cols) of a [B, T] batch with per-row positions and a
        per-query mask [B, T, T] (packed sequences; batch.packed_logits), on the CPU."""
        from .batch import packed_logits

        return packed_logits(self.runner, input_ids, positions, attention_mask, rows, cols).cpu()

    def embed(self, text_or_ids: str | Sequence[int], *, pooling: str = "mean", normalize: bool = True) -> torch.Tensor:
        """An embedding of a text or token ids, fp32 [d_model] on the CPU: the final norm's output
        (the last hidden state) over the tokens, their `pooling` "mean" or the "last" token's,
        L2-normalised unless `normalize=False`. A language model's own representation (what
        llama.cpp's `--embedding --pooling mean` serves), not a trained embedding model's."""
        ids = self.encode(text_or_ids) if isinstance(text_or_ids, str) else [int(i) for i in text_or_ids]
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be mean or last, got {pooling!r}")
        hidden = self.runner.hidden_states(ids).cpu()
        pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
        return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled

    # --- text ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    @property
    def chat_template(self) -> ChatTemplate:
        """The container's chat template (format 1.1), else colibri-model's ChatML (chat.py)."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_engine(self)
        return self._chat_template

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in the chat template, ending with the assistant header so
        that the model writes the next turn."""
        return self.chat_template.encode(messages, add_generation_prompt=True)

    def chat_session(self) -> ChatSession:
        """A conversation whose KV cache is kept across turns (chat.py: prefix reuse, overflow)."""
        return ChatSession(self, self.chat_template)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **kwargs) -> TokenStream:
        """Yield a `StreamedToken` (id, text piece, logprob) per generated token, on a fresh
        session (`Session.stream` for the sampling options, stop strings and logprobs); once
        exhausted, the stream's `result` is the `GenerationResult`."""
        return self.session().stream(prompt, max_new_tokens, **kwargs)

    def stream_text(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """`stream`, text pieces only."""
        return self.session().stream_text(prompt, max_new_tokens, **kwargs)

    def generate(self, prompt, max_new_tokens: int = 128, *, on_text: Callable[[str], None] | None = None,
                 **kwargs):
        """Generate up to `max_new_tokens` after `prompt` (text or token ids) on a fresh session.
        Greedy unless `temperature > 0` (then `top_k`, `top_p`, `min_p`, repeatable with `seed`);
        `repetition_penalty`; stops at an end token (`end_token_ids` by default) or at the first
        of the `stop` strings (cut from the text); `logprobs=n` adds the n most likely
        alternatives to each of `result.tokens`. `on_text(piece)` receives the text as it is
        produced. A list of prompts (texts, or lists of ids) returns a list of results, each what
        the prompt alone gives, run as one padded batch: one prefill, then one pass per step for
        every row still going (batch_decode.py)."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
            from .batch_decode import generate_batch

            return generate_batch(self.runner, self.codec, list(prompt), max_new_tokens, on_text=on_text, **kwargs)
        return self.session().generate(prompt, max_new_tokens, on_text=on_text, **kwargs)

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **kwargs) -> GenerationResult:
        """The assistant's reply to `messages` ([{"role": ..., "content": ...}, ...]) on a fresh
        chat session (the overflow policy of chat.py applies); `chat_session()` keeps the cache."""
        return self.chat_session().reply(messages, max_new_tokens, **kwargs)



def _end_token_ids(container: Container, tokenizer) -> list[int]:
    """The container's end ids (format 1.1), else `<|endoftext|>` and `<|im_end|>` where the
    tokenizer has them."""
    config = container.tokenizer_config or {}
    if config.get("eos_token_ids"):
        return [int(i) for i in config["eos_token_ids"]]
    ends = (tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(IM_END))
    return [i for i in ends if i is not None]
