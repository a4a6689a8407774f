"""`Engine`: a Colibri int4 container served under a RAM budget.

    >>> from colibri_stream import Engine
    >>> with Engine.open("model.coli", ram_budget="600MB") as eng:          # doctest: +SKIP
    ...     print(eng.generate("The capital of France is", max_new_tokens=16).text)
    ...     print(eng.stats.to_dict()["hit_rate"])

Opening reads the container header and its resident region once, builds colibri-model's
`ColibriForCausalLM` with a `StreamedExperts` backend per MoE layer (the transformer math is
colibri-model's, not a copy), splits the budget (budget.py) and preallocates the KV cache.
Every forward pass, prefill or decode, goes through the KV cache in chunks of at most
`prefill_chunk` tokens, so activations stay within the workspace the budget reserved.
Serving uses the config's `top_k_infer` (top-1 for the presets, trained at top-2) unless
`top_k` is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
from colibri_int4 import Container
from colibri_model import held_dtype, load_tokenizer
from colibri_model.chat import encode_chat
from colibri_model.tokenizer import EOS_TOKEN, IM_END
from tokenizers import Tokenizer

from .cache.expert_cache import ExpertCache
from .cache.policies import make_policy
from .cache.prefetch import Prefetcher, RoutingPredictor
from .cache.slab import ExpertSlab
from .compute.choice import time_compute
from .compute.expert_compute import DequantExpert, Int4Expert, int4_supported, prepared_nbytes
from .compute.streamed_experts import StreamedExperts
from .errors import BudgetError
from .generation import GenerationResult, SamplingConfig, decode_loop
from .io.direct_io import BlobReader
from .io.heap import HeapTrimmer
from .io.heap import slack_bytes as heap_slack_bytes
from .options import EngineOptions
from .plan import Budget, kv_cache_bytes, plan_budget, workspace_bytes
from .resident import build_model, model_config, module_bytes
from .sizes import parse_size
from .stats import StreamStats
from .traces.routing_trace import write_trace


class Engine:
    """A served model. Create with `Engine.open`; close (or use `with`) to release the file."""

    def __init__(
        self,
        container: Container,
        config,
        model,
        cache: ExpertCache,
        reader: BlobReader,
        tokenizer: Tokenizer,
        budget: Budget,
        stats: StreamStats,
        max_context: int,
        prefill_chunk: int,
        device: torch.device,
    ):
        self.container, self.config, self.model, self.cache = container, config, model, cache
        self.reader, self.tokenizer, self.budget, self.stats = reader, tokenizer, budget, stats
        self.max_context, self.prefill_chunk, self.device = max_context, prefill_chunk, device
        self.kv_cache = model.new_kv_cache(1, max_context)
        self.path = container.path
        self.heap_trimmer = HeapTrimmer(budget.heap_slack_bytes)

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, ram_budget: str | int = "600MB", **options) -> Engine:
        """Open a container and plan the budget (see budget.py).

        Options (`EngineOptions`): `compute` "auto" | "int4" | "dequant" (auto: torch's CPU
        int4 kernels where the shapes allow and where they are not timed slower than the
        dequantized matmuls on this CPU, compute_choice.py; always dequantized on CUDA);
        `dtype` "f32" | "bf16" for resident weights, activations and KV cache; `kernel_dtype`
        "bf16" | "f32" for activations inside the int4 kernels (bf16 is the fast path, f32 the
        exact one); `device`; `cache_policy` (name or `CachePolicy`, default LFU with aging, chosen by measurement); `top_k`
        (default: the config's top_k_infer); `max_context` (KV cache length, default
        max_seq_len); `prefill_chunk` (tokens per forward pass); `direct_io`; `record_trace`;
        `prefetch` "auto" | "off" | "predict" | "on" (read the next layer's predicted experts on
        `prefetch_threads` workers; "predict" only measures the guess; "auto", the default, is
        "on" for experts of `PREFETCH_AUTO_MIN_BLOB` bytes or more when a CPU is free beyond
        torch's threads, where it was measured to pay; set torch's threads before opening);
        `slab` (default True: int4 experts live in one allocation made now, so the heap cannot
        creep past the budget; expert_slab.py); `tokenizer` (default: the container's, else
        colibri-model's bundled one).

        Raises `BudgetError` (naming the minimum) when `ram_budget` cannot hold the resident
        part plus one layer's working set, `colibri_int4.ContainerError` for a damaged file.
        """
        budget_bytes = parse_size(ram_budget)
        opts = EngineOptions(**options)
        container = Container.open(path)
        try:
            return cls._open(container, budget_bytes, opts)
        except BaseException:
            container.close()
            raise

    @classmethod
    def _open(cls, container: Container, budget_bytes: int, opts: EngineOptions) -> Engine:
        config = model_config(container)
        top_k = opts.top_k or config.top_k_infer
        if config.n_moe_layers and not 1 <= top_k <= config.n_experts:
            raise ValueError(f"top_k must be in [1, {config.n_experts}], got {top_k}")
        max_context = opts.max_context or config.max_seq_len
        dtype, device, layout = opts.dtype, opts.device, container.blob_layout
        compute = _choose_compute(opts, layout, config)
        expert_dtype = opts.kernel_dtype if compute == "int4" else dtype
        elem = torch.empty((), dtype=dtype).element_size()
        slot_bytes = (
            prepared_nbytes(layout, config.d_model, config.expert_dim, compute, expert_dtype) if layout else 0
        )
        # The resident size is known before materialising it: every resident tensor's element count.
        resident_bytes = (
            sum(
                held_dtype(t.shape, dtype).itemsize * _numel(t.shape)
                for t in container.header.tensors
            )
            + 4 * config.n_moe_layers * config.n_experts
        )  # router token counters
        tokenizer, tokenizer_bytes = _load_tokenizer(container, opts.tokenizer)
        blob_length = layout.blob_length if layout else 0

        def plan(prefetch_threads: int) -> Budget:
            # Prefetch workers each hold a staging buffer and, until it is stored, one prepared expert.
            return plan_budget(
                budget_bytes,
                config,
                resident_bytes,
                kv_cache_bytes(config, max_context, elem),
                workspace_bytes(config, min(opts.prefill_chunk, max_context), max_context, elem),
                blob_length + prefetch_threads * (blob_length + slot_bytes),
                slot_bytes,
                top_k,
                other_bytes=tokenizer_bytes,
                heap_slack_bytes=heap_slack_bytes(blob_length),
            )

        prefetch = opts.prefetch
        if prefetch == "auto":
            prefetch, budget = _choose_prefetch(plan, blob_length, opts.prefetch_threads, device)
        else:
            budget = plan(opts.prefetch_threads if prefetch == "on" and layout else 0)
        stats = StreamStats(record_trace=opts.record_trace)
        policy = make_policy(opts.cache_policy)
        reader = BlobReader(container.path, direct=opts.direct_io)
        cache = None
        try:
            entries = {(e.layer, e.expert): e for e in container.header.experts.entries}
            if compute == "int4":

                def prepare(blob):
                    return Int4Expert(blob, expert_dtype)
            else:

                def prepare(blob):
                    return DequantExpert(blob, expert_dtype, device)

            capacity = max(budget.slots, 1)
            # CPU int4 experts live in one slab allocated now (expert_slab.py); the dequantized
            # reference path (and CUDA) keeps per-expert tensors
            slab = ExpertSlab(capacity, slot_bytes) if compute == "int4" and opts.slab else None
            cache = ExpertCache(reader, entries, layout, prepare, capacity, policy, stats, slab=slab)
            backends = {
                i: StreamedExperts(i, config.n_experts, config.d_model, cache, stats)
                for i in range(config.n_dense_layers, config.n_layers)
            }
            model = build_model(container, config, backends, dtype, device)
            if top_k != config.top_k_infer:
                model.set_top_k(top_k)
            if prefetch != "off":
                prefetcher = Prefetcher(cache, opts.prefetch_threads) if prefetch == "on" and layout else None
                predictor = RoutingPredictor({i: model.layers[i] for i in backends}, top_k, stats, prefetcher)
                for backend in backends.values():
                    backend.predictor = predictor
            actual_resident = module_bytes(model)
            if actual_resident > resident_bytes:  # the plan must never under-count
                raise AssertionError(
                    f"resident weights take {actual_resident} bytes, planned {resident_bytes}"
                )
        except BaseException:
            if cache is not None:
                cache.close()
            reader.close()
            raise
        stats.ram_budget_bytes, stats.resident_bytes = budget.ram_budget, actual_resident
        stats.kv_cache_bytes, stats.staging_bytes = budget.kv_cache_bytes, budget.staging_bytes
        stats.workspace_bytes, stats.cache_capacity_bytes = (
            budget.workspace_bytes,
            budget.cache_capacity_bytes,
        )
        stats.cache_slots, stats.io_mode, stats.filesystem = budget.slots, reader.mode, reader.filesystem
        stats.compute_mode = (
            f"int4-{'bf16' if expert_dtype == torch.bfloat16 else 'f32'}" if compute == "int4" else compute
        )
        stats.policy, stats.prefetch = policy.name, prefetch
        engine = cls(
            container,
            config,
            model,
            cache,
            reader,
            tokenizer,
            budget,
            stats,
            max_context,
            opts.prefill_chunk,
            device,
        )
        engine.options = opts
        return engine

    def close(self) -> None:
        self.cache.close()
        self.reader.close()
        self.container.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_stats(self) -> None:
        self.stats.reset()

    @property
    def top_k(self) -> int:
        """Routed experts per token per layer, as served (the `top_k` option or top_k_infer)."""
        return self.options.top_k or self.config.top_k_infer

    def save_trace(self, path: str | os.PathLike, source: str = "") -> Path:
        """Write the routing trace recorded since the last reset as a ROUTING_TRACE.md file (for
        `colibri-stream policy-study`). Needs `record_trace=True` at open."""
        if not self.stats.record_trace:
            raise ValueError("this engine records no routing trace: open it with record_trace=True")
        config = self.config
        return write_trace(path, self.stats.trace, n_moe_layers=config.n_layers - config.n_dense_layers,
                           n_experts=config.n_experts, top_k=self.top_k, model=Path(self.path).name, source=source)

    # --- forward passes --------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, ids: list[int], keep: Literal["all", "last"]) -> torch.Tensor:
        """Run `ids` through the model after what the KV cache holds, in chunks; returns fp32
        logits of every position ([T, V]) or of the last one ([V])."""
        if self.kv_cache.length + len(ids) > self.max_context:
            raise ValueError(
                f"{self.kv_cache.length + len(ids)} tokens exceed the engine's max_context={self.max_context}"
            )
        outputs = []
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = torch.tensor(
                [ids[start : start + self.prefill_chunk]], dtype=torch.long, device=self.device
            )
            self.stats.steps += 1
            self.cache.policy.begin_step(self.stats.steps)
            began = time.perf_counter()
            logits = self.model(chunk, cache=self.kv_cache).logits[0]
            self.stats.forward_seconds += time.perf_counter() - began
            outputs.append(logits.float() if keep == "all" else logits[-1].float())
        if self.cache.prefetcher is not None:
            self.cache.prefetcher.drain()
        # Freed verify/repack temporaries stay on the C heap (heap.py): give them back once they
        # have grown past the budget's slack. Trimming after every miss cost 27% of tokens/s;
        # the check itself is only made after a slack's worth of reads (bench/RESULTS.md).
        self.heap_trimmer.maybe_trim(self.stats.bytes_read)
        return torch.cat(outputs, 0) if keep == "all" else outputs[-1]

    def logits(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits `[T, vocab]` of one sequence (a 1-D tensor or list of token ids), from
        an empty context: row t scores the token after position t."""
        ids = (
            input_ids.flatten().tolist()
            if isinstance(input_ids, torch.Tensor)
            else [int(i) for i in input_ids]
        )
        if not ids:
            raise ValueError("logits() needs at least one token")
        self.kv_cache.length = 0
        self.stats.prefill_tokens += len(ids)
        return self._forward(ids, keep="all").cpu()

    # --- text ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in colibri-model's ChatML template, ending with the
        assistant header so that the model writes the next turn."""
        return encode_chat(messages, self.tokenizer, add_generation_prompt=True)[0]

    def _special_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] | None = None,
        result: list | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as they are generated (see `generate`). If `result` is a list, the
        final `GenerationResult` is appended to it when the iterator is exhausted."""
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if stop_token_ids is None:
            stop_token_ids = [
                i for i in (self._special_id(EOS_TOKEN), self._special_id(IM_END)) if i is not None
            ]
        sampling = SamplingConfig(temperature, top_p, seed)
        yield from decode_loop(
            self, prompt_ids, max_new_tokens, sampling, tuple(stop), set(stop_token_ids), result
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt` (text or token ids). Greedy unless
        `temperature > 0` (then nucleus sampling with `top_p`, repeatable with `seed`). Stops at
        an end token (`<|endoftext|>`, `<|im_end|>` by default), or at the first of the `stop`
        strings (cut from the text). `on_text(piece)` receives the text as it is produced."""
        result: list[GenerationResult] = []
        for piece in self.stream(
            prompt,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            result=result,
        ):
            if on_text is not None:
                on_text(piece)
        return result[0]

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **kwargs) -> GenerationResult:
        """The assistant's reply to `messages` ([{"role": ..., "content": ...}, ...])."""
        return self.generate(self.chat_prompt(messages), max_new_tokens, **kwargs)


# NOTE: a loaded byte-level BPE tokenizer holds its vocabulary and merges in Rust structures that
# torch never sees. Measured here for SmolLM2's 49152 tokens: 38.7-43 MB of anonymous RSS on a
# process's first load (less on a second load, which reuses freed heap), about 880 bytes per
# token. A measurement per open would make the minimum budget vary between opens, so the budget
# uses this calibrated, deterministic estimate instead.
TOKENIZER_BYTES_PER_TOKEN = 900


def _load_tokenizer(container: Container, source) -> tuple[Tokenizer, int]:
    """The tokenizer (given, carried by the container, or colibri-model's bundled one) and the
    RAM it is estimated to hold."""
    if isinstance(source, Tokenizer):
        tokenizer = source
    elif source is None:
        carried = container.read_tokenizer_json()
        tokenizer = Tokenizer.from_str(carried) if carried else load_tokenizer(None)
    else:
        tokenizer = load_tokenizer(source)
    return tokenizer, TOKENIZER_BYTES_PER_TOKEN * tokenizer.get_vocab_size(with_added_tokens=True)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# Prefetch pays once reading an expert takes long enough to hide behind the compute of a layer,
# and only when a CPU is free for the workers (CRC and repack are CPU work). Measured
# (bench/RESULTS.md, issue 9), prefetch on / off:
#   16 KB experts, 1 torch thread on 2 cores:               x0.75 (a handoff costs more than the read)
#   0.84 MB (NanoColibri), 1 torch thread on 2 cores:       x1.02-1.04
#   1.88 MB (Micro), 1 torch thread on 2 cores:             x1.14
#   0.84 MB, 2 torch threads on 2 cores (no CPU to spare):  x0.63
# So "auto" turns it on from this blob size, with at least one CPU beyond torch's threads.
PREFETCH_AUTO_MIN_BLOB = 512 * 1024


def _spare_cpus(device: torch.device) -> int:
    """CPUs this process may use beyond torch's intra-op threads (an accelerator computes
    elsewhere, so there the CPUs are all free for reads)."""
    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        available = os.cpu_count() or 1
    return available if device.type != "cpu" else available - torch.get_num_threads()


def _choose_prefetch(
    plan: Callable[[int], Budget], blob_length: int, threads: int, device: torch.device
) -> tuple[str, Budget]:
    """Resolve prefetch "auto" to "on" or "off", with the budget planned for that choice.

    On only for large experts, with a CPU to spare for the workers, when the budget can also
    hold the workers' buffers, and when the cache cannot already hold every expert (then there
    is nothing left to read ahead)."""
    if blob_length >= PREFETCH_AUTO_MIN_BLOB and _spare_cpus(device) >= 1:
        try:
            budget = plan(threads)
        except BudgetError:
            budget = None
        if budget is not None and budget.slots < budget.total_experts:
            return "on", budget
    return "off", plan(0)


def _choose_compute(opts: EngineOptions, layout, config) -> str:
    """int4 where asked or where it is possible and timed faster here (compute_choice.py)."""
    if layout is None or opts.compute == "dequant":
        return "dequant"
    reason = int4_supported(layout, config.d_model, config.expert_dim)
    if opts.device.type != "cpu":
        reason = reason or f"the int4 kernels used here are CPU kernels (device {opts.device})"
    if opts.compute == "int4" and reason:
        raise ValueError(f"compute='int4' is not possible: {reason}")
    if reason:
        return "dequant"
    if opts.compute == "auto":
        return time_compute(config.d_model, config.expert_dim, opts.dtype, opts.kernel_dtype).choice
    return "int4"
