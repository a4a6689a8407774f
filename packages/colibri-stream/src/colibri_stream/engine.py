"""`Engine`: a Colibri int4 container served under a RAM budget.

    >>> from colibri_stream import Engine
    >>> print(Engine.plan("model.coli").min_budget)                         # doctest: +SKIP
    >>> with Engine.open("model.coli", ram_budget="600MB") as eng:          # doctest: +SKIP
    ...     print(eng.generate("The capital of France is", max_new_tokens=16).text)
    ...     print(eng.stats.to_dict()["hit_rate"])

`Engine.plan` reads the container header and says how a budget is split (plan.py) without
building anything; `Engine.open` follows that plan: it builds colibri-model's
`ColibriForCausalLM` with a `StreamedExperts` backend per MoE layer (the transformer math is
colibri-model's, not a copy; assembly.py) and preallocates the KV cache. Every forward pass,
prefill or decode, goes through the KV cache in chunks of at most `prefill_chunk` tokens, so
activations stay within the workspace the budget reserved. `forward_tokens` is that pass,
public: it appends to the context and returns logits; `reset()` empties the context. Serving
uses the config's `top_k_infer` (top-1 for the presets, trained at top-2) unless `top_k` is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from colibri_int4 import Container
from colibri_model.chat import encode_chat
from colibri_model.tokenizer import EOS_TOKEN, IM_END

from .assembly import assemble, parse_budget, plan_for
from .generation import GenerationResult, SamplingConfig, decode_loop
from .hit_rate_target import budget_for_hit_rate
from .io.accounting import ReadBytesCounter, agreement
from .io.heap import HeapTrimmer
from .options import EngineOptions
from .plan import Plan
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
        self.kv_cache = self.model.new_kv_cache(1, self.max_context)
        self.path = container.path
        self.heap_trimmer = HeapTrimmer(self.budget.heap_slack_bytes)
        self._os_reads = ReadBytesCounter()  # from here on, every storage read is the run's
        self._update_io()

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, ram_budget: str | int = "600MB", **options) -> Engine:
        """Open a container under `ram_budget` (bytes, "600MB", or "auto": fit under this
        process's cgroup memory limit, else MemAvailable; io/memory_cap.py).

        Options (`EngineOptions`): `compute` "auto" | "int4" | "dequant" (auto: torch's CPU
        int4 kernels where the shapes allow and where they are not timed slower than the
        dequantized matmuls on this CPU, compute/choice.py; always dequantized on CUDA);
        `dtype` "f32" | "bf16" for resident weights, activations and KV cache (unset: f32, or
        bf16 where the budget cannot hold f32, plan.py); `kernel_dtype` "bf16" | "f32" for
        activations inside the int4 kernels (bf16 is the fast path, f32 the exact one);
        `device`; `cache_policy` (name or `CachePolicy`, default LFU with aging, chosen by
        measurement); `top_k` (default: the config's top_k_infer); `max_context` (KV cache
        length; unset: max_seq_len, halved where the budget needs); `prefill_chunk` (tokens per
        forward pass; unset: 128, less where the budget needs); `direct_io`; `record_trace`;
        `prefetch` "auto" | "off" | "predict" | "on" (read the next layer's predicted experts on
        `prefetch_threads` workers; "predict" only measures the guess; "auto", the default, is
        "on" for experts of 512 KiB or more when a CPU is free beyond torch's threads and the
        cache cannot hold every expert; set torch's threads before opening); `slab` (default
        True: int4 experts live in one allocation made now, cache/slab.py); `tokenizer`
        (default: the container's, else colibri-model's bundled one).

        Raises `BudgetError` (naming the minimum) when `ram_budget` cannot hold the resident
        part plus one layer's working set, `colibri_int4.ContainerError` for a damaged file.
        """
        budget = parse_budget(ram_budget)
        opts = EngineOptions(**options)
        container = Container.open(path)
        try:
            return cls(container, plan_for(container, opts, budget), opts)
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
            plan = plan_for(opened, opts, budget)
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
        self.stats.reset()
        self._os_reads.rebase()
        self._update_io()

    def _update_io(self) -> None:
        self.stats.bytes_read_os = self._os_reads.since()
        self.stats.io_agreement = agreement(self.stats.bytes_read, self.stats.bytes_read_os)

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
    @property
    def context_length(self) -> int:
        """Tokens the context (KV cache) holds now."""
        return self.kv_cache.length

    def reset(self) -> None:
        """Empty the context: the next `forward_tokens` starts a new sequence."""
        self.kv_cache.length = 0

    @torch.inference_mode()
    def forward_tokens(self, ids: Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append `ids` to the context and run them, in chunks of `prefill_chunk`; returns the fp32
        logits of the last position ([V]) or, with `all_logits`, of every one ([T, V]), on the
        engine's device. One token after a non-empty context counts as a decode step, anything
        else as prefill (`stats.decode_tokens` / `prefill_tokens`)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("forward_tokens() needs at least one token")
        if self.kv_cache.length + len(ids) > self.max_context:
            raise ValueError(
                f"{self.kv_cache.length + len(ids)} tokens exceed the engine's max_context={self.max_context}"
            )
        if len(ids) == 1 and self.kv_cache.length > 0:
            self.stats.decode_tokens += 1
        else:
            self.stats.prefill_tokens += len(ids)
        outputs = []
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = torch.tensor([ids[start : start + self.prefill_chunk]], dtype=torch.long, device=self.device)
            self.stats.steps += 1
            self.cache.policy.begin_step(self.stats.steps)
            began = time.perf_counter()
            logits = self.model(chunk, cache=self.kv_cache).logits[0]
            self.stats.forward_seconds += time.perf_counter() - began
            outputs.append(logits.float() if all_logits else logits[-1].float())
        if self.cache.prefetcher is not None:
            self.cache.prefetcher.drain()
        # Freed verify/repack temporaries stay on the C heap (io/heap.py): give them back once
        # they have grown past the budget's slack. Trimming after every miss cost 27% of
        # tokens/s; the check itself is only made after a slack's worth of reads (RESULTS.md).
        self.heap_trimmer.maybe_trim(self.stats.bytes_read)
        self._update_io()
        return torch.cat(outputs, 0) if all_logits else outputs[-1]

    def logits(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits `[T, vocab]` of one sequence (a 1-D tensor or list of token ids), from
        an empty context: row t scores the token after position t."""
        ids = input_ids.flatten().tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if not ids:
            raise ValueError("logits() needs at least one token")
        self.reset()
        return self.forward_tokens(ids, all_logits=True).cpu()

    # --- text ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in colibri-model's ChatML template, ending with the
        assistant header so that the model writes the next turn."""
        return encode_chat(messages, self.tokenizer, add_generation_prompt=True)[0]

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               stop_token_ids: Sequence[int] | None = None, result: list | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated (see `generate`). If `result` is a list, the
        final `GenerationResult` is appended to it when the iterator is exhausted."""
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if stop_token_ids is None:
            ends = (self.tokenizer.token_to_id(EOS_TOKEN), self.tokenizer.token_to_id(IM_END))
            stop_token_ids = [i for i in ends if i is not None]
        sampling = SamplingConfig(temperature, top_p, seed)
        yield from decode_loop(self, prompt_ids, max_new_tokens, sampling, tuple(stop), set(stop_token_ids), result)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt` (text or token ids). Greedy unless
        `temperature > 0` (then nucleus sampling with `top_p`, repeatable with `seed`). Stops at
        an end token (`<|endoftext|>`, `<|im_end|>` by default), or at the first of the `stop`
        strings (cut from the text). `on_text(piece)` receives the text as it is produced."""
        result: list[GenerationResult] = []
        for piece in self.stream(prompt, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 stop=stop, stop_token_ids=stop_token_ids, result=result):
            if on_text is not None:
                on_text(piece)
        return result[0]

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **kwargs) -> GenerationResult:
        """The assistant's reply to `messages` ([{"role": ..., "content": ...}, ...])."""
        return self.generate(self.chat_prompt(messages), max_new_tokens, **kwargs)
