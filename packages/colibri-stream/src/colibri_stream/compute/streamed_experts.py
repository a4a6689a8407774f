"""`StreamedExperts`: colibri-model's `ExpertBackend` for one MoE layer, fed by the expert cache.

    forward(x [N, d], expert_ids [N, k], gates [N, k]) -> [N, d]

Batch-union: the distinct experts of all N tokens (a prefill chunk, or one decode token) are
fetched once each, in ascending id order, and each computes all of its rows at once; so a
prefill reads every distinct expert of a layer exactly once. Experts are used one at a time
and the result accumulated, so a prefill needs only one slot at a time beyond what is cached; a
decode token holds its top_k experts at once (the budget reserves top_k slots for that). Where a
prefill chunk's experts are all cached, consecutive ones run together (as many as the chunk's
tokens' rows allow), with the same bits.

One decode token (N = 1) takes a shorter path with the same arithmetic: its top-k experts are
distinct, so there is no union to find or rows to gather, and each expert's output is added in
the same ascending order (bitwise the batched result). With the native kernel (`quantize` set),
the token's input is quantized once and its experts run together (`NativeQ4Expert.forward_each`:
three kernel calls per layer, not two matmuls and a quantization per expert).

A few tokens (a decode step of several sessions, `GROUPED_ROWS`) with the native kernel: the
input quantized once, the distinct experts taken top_k at a time (the slots the budget holds at
once), each group in three kernel calls on the tokens routed to its experts
(`NativeQ4Expert.forward_grouped`), each token's outputs added in the same ascending order.

`reference_forward` is the obvious per-(token, slot) loop, kept to test the batched path.
"""

from __future__ import annotations

import time

import torch
from colibri_model import ExpertBackend

from ..cache.expert_cache import ExpertCache
from ..stats import StreamStats
from ..traces.events import TraceEvent
from .native_kernel import TokenTable, add_weighted_rows

GROUPED_ROWS = 16
"""Up to this many tokens (a decode step of several sessions) take `_few_tokens`; more (a prefill
chunk) run each expert on its rows in turn. The same bits either way (tested): this only
chooses the faster way, fewer calls per expert for a few rows, fewer per token for many."""


class StreamedExperts(ExpertBackend):
    def __init__(
        self, layer_index: int, n_experts: int, d_model: int, cache: ExpertCache, stats: StreamStats,
        quantize=None,
    ):
        """`quantize`: turns a layer's input into what the prepared experts take (native kernel's
        `QuantizedActivations`), or None to hand them the tensor."""
        super().__init__()
        self.layer_index, self.n_experts, self.d_model = layer_index, n_experts, d_model
        self.cache, self.stats = cache, stats
        self.quantize = quantize
        self.predictor = None  # prefetch.RoutingPredictor, set by the engine when prefetch is on
        self._table: TokenTable | None = None  # the cached experts' addresses, for the one-call decode path
        self._table_generation = -1

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:  # a decode token: no torch.unique
            return self.forward_row(x, expert_ids[0].tolist(), gates[0].float().tolist())
        distinct = torch.unique(expert_ids).tolist()  # ascending
        pinned, keys, prefetcher = self._begin(x, distinct)
        out = torch.zeros(x.shape[0], self.d_model, dtype=torch.float32, device=x.device)
        if self.quantize is not None and x.shape[0] <= GROUPED_ROWS:
            rows = expert_ids.tolist()
            if all(len(set(r)) == len(r) for r in rows) and self._few_tokens(x, rows, gates, out, pinned, keys,
                                                                            prefetcher):
                return out.to(x.dtype)
        self._each_expert(x, expert_ids, gates, distinct, out, pinned, keys, prefetcher)
        return out.to(x.dtype)

    def forward_row(self, x: torch.Tensor, ids: list[int], weights: list[float]) -> torch.Tensor:
        """`forward` of one token x [1, d] whose experts and gates come as lists (a decode row routed
        in one C call: no tensors to build and take apart), with the same bits."""
        distinct = sorted(set(ids))
        pinned, keys, prefetcher = self._begin(x, distinct)
        out = torch.zeros(1, self.d_model, dtype=torch.float32, device=x.device)
        if len(distinct) == len(ids):
            self._one_token(x, ids, weights, out[0], pinned, keys, prefetcher)
        else:  # an expert picked twice: each pick added, as for many tokens
            self._each_expert(x, torch.tensor([ids]), torch.tensor([weights]), distinct, out, pinned, keys, prefetcher)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def token_table(self) -> TokenTable | None:
        """This layer's cached experts as a decode step's one C call looks them up
        (native_kernel.decode_layer_front), where that call may stand in for `forward_row`: the
        cache's hits are plain counts (`ExpertCache.hits_are_plain`), no trace is recorded and no
        routing predicted. Filled by `forward_row` as experts are used; None until then or where
        the call may not stand in."""
        cache = self.cache
        if (self._table is None or self.predictor is not None or self.stats.record_trace
                or not getattr(cache, "hits_are_plain", False)):
            return None
        if self._table_generation != cache.generation:  # an expert left the cache: its slot is reused
            self._table.clear()
            self._table_generation = cache.generation
        return self._table

    def count_row(self, experts: int, seconds: float) -> None:
        """What `forward_row` counts for a row whose `experts` the one C call found and ran."""
        self.cache.count_hits(self.layer_index, experts)
        self.stats.compute_seconds += seconds

    def _remember(self, ids: list[int], prepared: list) -> None:
        """Keep the addresses of experts that run in one kernel call, for `token_table`."""
        shape = getattr(prepared[0], "one_call", None)
        if shape is None or not getattr(self.cache, "hits_are_plain", False):
            return
        generation = self.cache.generation
        if self._table is None or not self._table.matches(*shape) or self._table_generation != generation:
            self._table = TokenTable(self.n_experts, *shape)
            self._table_generation = generation
        for expert, p in zip(ids, prepared):
            if getattr(p, "one_call", None) == shape:
                self._table.set(expert, p.token_addresses)

    def _each_expert(self, x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor, distinct: list[int],
                     out: torch.Tensor, pinned, keys, prefetcher) -> None:
        """Each distinct expert on the rows routed to it, in ascending order (a prefill chunk). With
        the native kernel the input is quantized once and each expert takes its rows of that (a row
        goes to top_k experts: quantizing it for each cost a fifth of a prefill)."""
        started = time.perf_counter()
        inputs = x if self.quantize is None else self.quantize(x)
        self.stats.compute_seconds += time.perf_counter() - started
        if self._all_cached_together(inputs, expert_ids, gates, distinct, out, pinned, prefetcher):
            return
        for i, expert in enumerate(distinct):
            prepared = self.cache.get(self.layer_index, expert, pinned)
            self._remember([expert], [prepared])
            if prefetcher is not None:  # keep the workers busy with the misses still to come
                prefetcher.issue_needed(keys[i + 1 :])
            self._add_expert(prepared, expert, inputs, expert_ids, gates, out)

    def _add_expert(self, prepared, expert: int, inputs, expert_ids: torch.Tensor, gates: torch.Tensor,
                    out: torch.Tensor) -> None:
        """out += the expert on the rows routed to it, times their gates."""
        started = time.perf_counter()
        tokens, slots = torch.nonzero(expert_ids == expert, as_tuple=True)
        y = prepared.forward(inputs[tokens])
        out.index_add_(0, tokens, y.float() * gates[tokens, slots].unsqueeze(-1).float())
        self.stats.compute_seconds += time.perf_counter() - started

    def _all_cached_together(self, inputs, expert_ids: torch.Tensor, gates: torch.Tensor, distinct: list[int],
                             out: torch.Tensor, pinned, prefetcher) -> bool:
        """`_each_expert` where every distinct expert is cached and none is being read (a prefill
        at full RAM): consecutive experts taken together while their rows add up to no more than
        the chunk's tokens (the activations one expert on every token would hold: the workspace
        the budget counts), each run in three kernel calls (`forward_grouped`, which balances the
        threads by rows), then each expert's rows added as the loop adds them (one `index_add_` per
        expert, ascending: no token twice in one call, so the same bits whatever order torch adds
        a call's rows in). The loop's Python per expert (64 a layer) had been a seventh of a
        prefill on two threads. False, with nothing done, where not every expert is cached or a
        read is under way."""
        get_layer = getattr(self.cache, "get_layer", None)
        if self.quantize is None or prefetcher is not None or get_layer is None \
                or not all((self.layer_index, e) in self.cache for e in distinct):
            return False
        prepared = get_layer(self.layer_index, distinct, pinned)
        self._remember(distinct, prepared)
        kind = type(prepared[0])
        forward_grouped = getattr(kind, "forward_grouped", None)
        if forward_grouped is None or any(type(p) is not kind for p in prepared):  # each on its own
            for expert, one in zip(distinct, prepared):
                self._add_expert(one, expert, inputs, expert_ids, gates, out)
            return True
        started = time.perf_counter()
        tokens_in, top_k = expert_ids.shape
        picks = expert_ids.reshape(-1)
        order = torch.sort(picks, stable=True).indices  # by expert, then by token (then slot)
        tokens, slots = order // top_k, order % top_k
        counts = torch.bincount(picks, minlength=self.n_experts)[distinct].tolist()
        first = row = 0
        while first < len(distinct):
            last, rows = first + 1, counts[first]
            while last < len(distinct) and rows + counts[last] <= tokens_in:
                rows += counts[last]
                last += 1
            picked, their_slots = tokens[row : row + rows], slots[row : row + rows]
            y = (forward_grouped(prepared[first:last], inputs,
                                 [r.tolist() for r in torch.split(picked, counts[first:last])]).float()
                 * gates[picked, their_slots].unsqueeze(-1).float())
            at = 0
            for count in counts[first:last]:
                out.index_add_(0, picked[at : at + count], y[at : at + count])
                at += count
            first, row = last, row + rows
        self.stats.compute_seconds += time.perf_counter() - started
        return True

    def _begin(self, x: torch.Tensor, distinct: list[int]):
        """What every path does first for a layer's distinct experts (ascending): the trace event,
        the pinned keys, the prefetch of its misses and the guess of the next layer's experts."""
        if self.stats.record_trace:
            self.stats.trace.append(TraceEvent(self.stats.steps, self.layer_index, tuple(distinct)))
        layer = self.layer_index
        keys = [(layer, e) for e in distinct]
        pinned = set(keys)
        prefetcher = self.cache.prefetcher if len(distinct) > 1 else None
        if prefetcher is not None:  # the workers start on this layer's misses (prefetch.py)
            prefetcher.issue_needed(keys)
        # then guess the next layer's experts; those reads take whatever workers are left
        if self.predictor is not None:
            self.predictor.before_layer(layer, x, distinct)
        return pinned, keys, prefetcher

    def _few_tokens(self, x: torch.Tensor, rows: list[list[int]], gates: torch.Tensor, out: torch.Tensor, pinned,
                    keys, prefetcher) -> bool:
        """A decode step of several sessions: the layer's input quantized once, its distinct
        experts run top_k at a time (the slots the budget holds at once) on the tokens routed to
        them, three kernel calls per group, and each token's outputs added in ascending expert
        order, as the other paths add them. False (nothing done) when the experts are not all
        the native kernel's."""
        started = time.perf_counter()
        inputs = self.quantize(x)
        weights = gates.float().tolist()
        tokens_of: dict[int, list[tuple[int, float]]] = {}
        for token, experts in enumerate(rows):
            for slot, expert in enumerate(experts):
                tokens_of.setdefault(expert, []).append((token, weights[token][slot]))
        self.stats.compute_seconds += time.perf_counter() - started
        width = len(rows[0])
        together = width <= self._slots_at_once()  # else (a per-layer share under top-k) one at a time
        for first in range(0, len(keys), width):
            group = keys[first : first + width]
            routed = [[t for t, _ in tokens_of[e]] for _, e in group]
            if not together:  # each expert run on its rows as soon as it is got
                outputs = []
                for (_, expert), tokens in zip(group, routed):
                    one = self.cache.get(self.layer_index, expert, pinned)
                    started = time.perf_counter()  # (the read is I/O time, counted by the cache)
                    outputs.append(one.forward(inputs[torch.tensor(tokens)]).float())
                    self.stats.compute_seconds += time.perf_counter() - started
                started = time.perf_counter()
                outputs = torch.cat(outputs)
            else:
                prepared = []
                for i, (_, expert) in enumerate(group):  # each miss holds the group's experts got before it
                    prepared.append(self.cache.get(self.layer_index, expert, pinned, group[:i]))
                    if prefetcher is not None:
                        prefetcher.issue_needed(keys[first + i + 1 :])
                forward_grouped = getattr(type(prepared[0]), "forward_grouped", None)
                if forward_grouped is None or any(type(p) is not type(prepared[0]) for p in prepared):
                    if first == 0:
                        return False
                    raise TypeError("a layer's experts were prepared for different kernels")  # one engine, one kind
                started = time.perf_counter()
                outputs = forward_grouped(prepared, inputs, routed)
            mine: dict[int, tuple[list[int], list[float]]] = {}
            at = 0
            for _, expert in group:  # ascending experts: each token's rows in the order they add
                for token, weight in tokens_of[expert]:
                    picked, ws = mine.setdefault(token, ([], []))
                    picked.append(at)
                    ws.append(weight)
                    at += 1
            for token, (picked, ws) in mine.items():
                add_weighted_rows(out[token], outputs[picked], ws)
            self.stats.compute_seconds += time.perf_counter() - started
        return True

    def _one_token(self, x: torch.Tensor, ids: list[int], weights: list[float], row: torch.Tensor, pinned, keys,
                   prefetcher) -> None:
        slot_of = {expert: slot for slot, expert in enumerate(ids)}
        ordered = [weights[slot_of[expert]] for _, expert in keys]  # accumulated in ascending order
        if len(keys) > self._slots_at_once():  # a per-layer share under top-k: one at a time
            self._one_at_a_time(x, keys, ordered, row, pinned, prefetcher)
            return
        prepared = self._held_together(keys, pinned, prefetcher)
        started = time.perf_counter()
        kind = type(prepared[0])
        same_kind = all(type(p) is kind for p in prepared)
        forward_token = getattr(kind, "forward_token", None)
        if same_kind and forward_token is not None and x.dtype == torch.float32 \
                and forward_token(prepared, x[0].contiguous(), ordered, row):
            pass  # the token's experts and their sum in two kernel calls (native kernel)
        elif same_kind and getattr(kind, "forward_each", None) is not None:
            inputs = x if self.quantize is None else self.quantize(x)
            outputs = kind.forward_each(prepared, inputs)  # the token's experts in one go (native kernel)
            # [E, d] f32: accumulated in ascending order in one call, the batched path's bits
            add_weighted_rows(row, outputs, ordered)
        else:
            inputs = x if self.quantize is None else self.quantize(x)
            outputs = [p.forward(inputs)[0] for p in prepared]
            for (_, expert), y in zip(keys, outputs):  # accumulated in ascending order, as the batched path
                row += y.float() * weights[slot_of[expert]]
        self.stats.compute_seconds += time.perf_counter() - started

    def _slots_at_once(self) -> int:
        """How many of this layer's experts the cache holds at once (`ExpertCache.slots_for_layer`)."""
        slots_for_layer = getattr(self.cache, "slots_for_layer", None)  # (a stand-in cache may not say)
        return self.n_experts if slots_for_layer is None else slots_for_layer(self.layer_index)

    def _held_together(self, keys: list[tuple[int, int]], pinned, prefetcher) -> list:
        """The prepared experts of `keys` (ascending), all cached at once (no more than
        `_slots_at_once`): each miss holds the ones got before it, whose slots it must not refill
        while they are used (`ExpertCache.get`'s `hold`)."""
        get_layer = getattr(self.cache, "get_layer", None)  # (a stand-in cache may have only `get`)
        if prefetcher is None and get_layer is not None:  # ascending, as the batched path
            ascending = [expert for _, expert in keys]
            prepared = get_layer(self.layer_index, ascending, pinned)
            self._remember(ascending, prepared)
            return prepared
        prepared = []
        for i, (_, expert) in enumerate(keys):
            prepared.append(self.cache.get(self.layer_index, expert, pinned, keys[:i]))
            if prefetcher is not None:
                prefetcher.issue_needed(keys[i + 1 :])
        return prepared

    def _one_at_a_time(self, x: torch.Tensor, keys: list[tuple[int, int]], ordered: list[float], row: torch.Tensor,
                       pinned, prefetcher) -> None:
        """`_one_token` where the cache cannot hold the token's experts at once: each computed as
        soon as it is got (its slot may be refilled by the next miss), then their outputs added in
        ascending order as the other paths add them (each output is what `forward_each` gives its
        row: the same bits)."""
        inputs = x if self.quantize is None else self.quantize(x)
        outputs = []
        for i, (_, expert) in enumerate(keys):
            prepared = self.cache.get(self.layer_index, expert, pinned)
            if prefetcher is not None:
                prefetcher.issue_needed(keys[i + 1 :])
            started = time.perf_counter()
            outputs.append(prepared.forward(inputs).float())
            self.stats.compute_seconds += time.perf_counter() - started
        started = time.perf_counter()
        if self.quantize is not None:
            add_weighted_rows(row, torch.cat(outputs), ordered)
        else:
            for y, weight in zip(outputs, ordered):
                row += y[0] * weight
        self.stats.compute_seconds += time.perf_counter() - started

    def reference_forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor
    ) -> torch.Tensor:
        """One (token, slot) pair at a time: slow and obviously right."""
        out = torch.zeros(x.shape[0], self.d_model, dtype=torch.float32, device=x.device)
        for token in range(expert_ids.shape[0]):
            for slot in range(expert_ids.shape[1]):
                prepared = self.cache.get(self.layer_index, int(expert_ids[token, slot]))
                out[token] += prepared.forward(x[token : token + 1])[0].float() * float(gates[token, slot])
        return out.to(x.dtype)
