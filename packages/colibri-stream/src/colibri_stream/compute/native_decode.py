"""One decode token of one session with less torch glue: colibri-model's block
(`NativeDecodeBlock`), grouped-query attention (`NativeDecodeAttention`) and RMSNorm
(`NativeRowNorm`) with a fast path for that case; routing row by row (`RowwiseRouter`), so a
decode row of a step that serves several sessions gets the bits it gets alone; and a swiglu on
native projections (`NativeSwiGLU`: a dense FFN, a shared expert) whose activation is the one
the decode call computes, so that call may run those FFNs too (native_stack.py).

A decode step of a 24-layer MoE spent about as long in the torch calls and Python module calls
around attention and routing (norms, views, rotations of one row, the cache write, a [1, S] mask,
SDPA, the router's dozen ops: each a dispatch and an allocation) as in the projections themselves.
For one query row of one session, a layer runs as one C call (compute/native/decode_layer.c): the
input norm, the q/k/v projections of one quantized input and q/k's per-head norm and rotation; the
key and value written into the session's cache; the attention over it, unmasked, since the newest
position sees every cached column (compute/native/attention.c: torch's SDPA cost more in dispatch
than in arithmetic at the short contexts of most steps); the output projection, the residual and
the FFN's norm; the row's routing; and, where every chosen expert is cached and stays cached (full
RAM), the experts themselves. Otherwise the experts run in one more call once the cache has them
(streamed_experts.py). Each step is the kernel the per-module path runs, in its order, so the two
give the same bits (tested); a layer whose modules carry forward hooks (a prefetcher's) takes the
per-module path, which keeps the q/k and norm calls of its own.

Every other case runs colibri-model's own forward, unchanged: batches, prefill chunks, masks,
sliding windows, sinks, an OLMoE-style norm over the whole projection, interleaved rotary, a
non-f32 engine, projections with biases. The C paths equal that forward to float rounding (sums in
another order), tested against it (tests/test_native_decode.py).
"""

from __future__ import annotations

import torch
from colibri_model import Attention, Block, ColibriConfig, MoELayer, RMSNorm, Router, SwiGLU
from torch import nn

from .native_kernel import (
    FFN_DENSE,
    FFN_OUTSIDE,
    FFN_SHARED,
    MAX_HEAD_DIM,
    LayerFront,
    Projection,
    RowRoute,
    attend_row,
    attention_in,
    attention_out,
    decode_layer_front,
    norm_rope,
    rms_norm,
    route_row,
    route_row_lists,
    swiglu_rows,
)
from .native_linear import NativeLinear

ROWWISE_ROUTING_ROWS = 16
"""Up to this many rows, `RowwiseRouter` routes each row alone (a combined decode step of that many
sessions keeps every row's bits; beyond it they agree to float rounding)."""


def decode_attention_supported(config: ColibriConfig) -> bool:
    """Whether this config's attention layers have the decode fast path (the rest never change)."""
    return (config.attention_kind == "gqa" and not config.attn_sinks and not config.rope_interleave
            and not (config.qk_norm and config.qk_norm_scope == "projection")
            and config.head_dim % 8 == 0 and config.head_dim <= MAX_HEAD_DIM)


class NativeDecodeAttention(Attention):
    """An `Attention` whose one decode token of one session skips the torch glue (module docstring)."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if (cache is None or attention_mask is not None or x.shape[0] != 1 or x.shape[1] != 1
                or x.dtype != torch.float32 or positions.dim() != 1 or self.window is not None):
            return super().forward(x, positions, cache, attention_mask)
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(heads, dim).contiguous()
        k = self.k_proj(x).reshape(kv_heads, dim).contiguous()
        v = self.v_proj(x).reshape(1, kv_heads, 1, dim)
        cos, sin = self.rope.at(int(positions[0]), x.device)
        norm_rope(q, self.q_norm, cos, sin)
        norm_rope(k, self.k_norm, cos, sin)
        keys, values = cache.update(self.layer_index, k.view(1, kv_heads, 1, dim), v)
        # one query row at the newest position sees every cached column: no mask to build
        out = torch.empty(heads, dim)
        attend_row(q, keys, values, out)
        return self.o_proj(out.view(1, 1, heads * dim))


    def forward_rows(self, x: torch.Tensor, positions: torch.Tensor, caches: list) -> torch.Tensor | None:
        """One decode token of each of B sessions (x [B, 1, d], positions [B, 1], their own caches):
        the four projections take the B rows at once (each row's bits are its own: the native
        kernel's rows never depend on their neighbours), each row's norm, rotation, cache write and
        attention as alone. None when this layer has no such path (the caller runs rows alone)."""
        if x.dtype != torch.float32 or self.window is not None or not all(
                isinstance(getattr(self, p), NativeLinear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return None
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        rows = x.shape[0]
        q = self.q_proj(x).reshape(rows, heads, dim)
        k = self.k_proj(x).reshape(rows, kv_heads, dim)
        v = self.v_proj(x).reshape(rows, 1, kv_heads, 1, dim)
        out = torch.empty(rows, heads * dim, dtype=x.dtype, device=x.device)
        for i, cache in enumerate(caches):
            qi, ki = q[i].contiguous(), k[i].contiguous()
            cos, sin = self.rope.at(int(positions[i, 0]), x.device)
            norm_rope(qi, self.q_norm, cos, sin)
            norm_rope(ki, self.k_norm, cos, sin)
            keys, values = cache.update(self.layer_index, ki.view(1, kv_heads, 1, dim), v[i])
            attend_row(qi, keys, values, out[i].view(heads, dim))
        return self.o_proj(out.view(rows, 1, heads * dim))


def _projection(linear: NativeLinear) -> Projection:
    return Projection.of(linear.encoding, linear.data, linear.scales, linear.zeros, linear.group, linear.fp16_scales,
                         linear.in_features, linear.tiled)


def _takes_projections(linears) -> bool:
    """Whether the decode calls take these `NativeLinear`s: q4/q8, no bias, whole groups of 32s."""
    return all(isinstance(p, NativeLinear) and p.encoding in ("q4", "q8") and p.bias is None
               and p.in_features % p.group == 0 and p.group % 32 == 0 for p in linears)


class NativeSwiGLU(SwiGLU):
    """A `SwiGLU` (a dense FFN, a shared expert) on `NativeLinear` projections whose activation is
    the native kernel's (`swiglu_rows`, the routed experts' own): the computation a decode token's
    one call makes for such an FFN (decode_layer.c's swiglu_ffn), so the layer gives the same bits
    in the call and as this module. Inputs other than f32 run `SwiGLU.forward`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().forward(x)
        hidden = self.gate_proj.out_features
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        activated = swiglu_rows(gate_up.reshape(-1, 2 * hidden))
        return self.down_proj(activated.view(*x.shape[:-1], hidden))

    @staticmethod
    def covers(module: nn.Module) -> bool:
        return type(module) in (SwiGLU, NativeSwiGLU) and _takes_projections(
            (module.gate_proj, module.up_proj, module.down_proj))

    def projections(self) -> list[NativeLinear]:
        return [self.gate_proj, self.up_proj, self.down_proj]


class NativeRowNorm(RMSNorm):
    """An `RMSNorm` whose decode rows [B, 1, D] (f32: each a decode token's layer input) are one C
    call each, so a row of a combined step (step_combiner.py) gets the bits it gets alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.float32 \
                or self.weight.dtype != torch.float32 or x.shape[2] % 8:
            return super().forward(x)
        if x.shape[0] == 1:
            return rms_norm(x.reshape(-1).contiguous(), self).view(x.shape)
        rows = x.reshape(x.shape[0], -1).contiguous()
        return torch.stack([rms_norm(row, self) for row in rows]).view(x.shape)


class RowwiseRouter(Router):
    """A `Router` that routes a few rows (a decode token, or a decode step of several sessions,
    step_combiner.py) one row at a time, so each picks the experts and gates it gets alone: torch's
    f32 matmul sums N rows in an order that depends on N, and its elementwise sigmoid takes another
    code path for a row's tail than for the middle of a longer tensor (16 experts: another bit),
    either of which could flip a near tie. A row is one C call where the router allows it (a dozen
    torch calls a layer otherwise); longer inputs (a prefill chunk) route in one go, as before."""

    def forward(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 1 <= x.shape[0] <= ROWWISE_ROUTING_ROWS:
            return super().forward(x, top_k)
        route = self._route_row if self._native_routing(x) else super().forward
        if x.shape[0] == 1:
            return route(x, top_k)
        parts = [route(row, top_k) for row in x.split(1)]
        return tuple(torch.cat(column) for column in zip(*parts))

    def _native_routing(self, x: torch.Tensor) -> bool:
        """Whether one C call routes a row here (decode_step.c's colibri_route_row): f32 rows and
        router, no expert groups, no token counts to keep."""
        return (x.dtype == torch.float32 and self.weight.dtype == torch.float32 and self.groups == 1
                and not self.count_tokens and x.shape[-1] % 8 == 0 and self.weight.is_contiguous()
                and all(t is None or (t.dtype == torch.float32 and t.is_contiguous())
                        for t in (self.bias, self.expert_bias)))

    def _route_row(self, row: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return route_row(row.reshape(-1).contiguous(), self.weight, self.bias, self.expert_bias, top_k,
                         self.score == "softmax", self.route_norm, float(self.route_scale))

    def route_lists(self, row: torch.Tensor, top_k: int) -> tuple[list[int], list[float]]:
        """`_route_row` of one row [D] (f32, contiguous) as (ids, gates) lists: the same choice."""
        into = self.__dict__.get("_row_route")
        if into is None or len(into.ids) != self.weight.shape[0]:
            into = self.__dict__["_row_route"] = RowRoute(self.weight.shape[0])
        return route_row_lists(row, self.weight, self.bias, self.expert_bias, top_k, self.score == "softmax",
                               self.route_norm, float(self.route_scale), into)


class NativeDecodeMoE(MoELayer):
    """A `MoELayer` whose one decode row (x [1, 1, d] f32, in eval mode) is routed in one C call
    (`RowwiseRouter`'s) and handed to the expert backend as lists (`forward_row`, which
    `StreamedExperts` has): the same router and experts, the same bits, without the tensors of
    ids and gates built and taken apart again. Every other input runs `MoELayer.forward`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router, forward_row = self.router, getattr(self.experts, "forward_row", None)
        if (forward_row is None or x.shape[0] != 1 or x.shape[1] != 1 or self.training or self.record_routing
                or type(router) is not RowwiseRouter or not router._native_routing(x)):
            return super().forward(x)
        flat = x.reshape(1, x.shape[-1]).contiguous()
        ids, gates = router.route_lists(flat.view(-1), self.top_k)
        return self.routed_row(flat, ids, gates).view(x.shape)

    def routed_row(self, flat: torch.Tensor, ids: list[int], gates: list[float],
                   experts_out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for one routed row flat [1, d]: the shared expert (gated) and the
        chosen experts (`experts_out` [1, d] where a C call already ran them), summed as
        `MoELayer.forward` sums them."""
        shared_out = self.shared(flat) if self.shared is not None else None  # first, as MoELayer (its hooks)
        if self.shared_gate is not None:
            shared_out = torch.sigmoid(self.shared_gate(flat)) * shared_out
        out = self.experts.forward_row(flat, ids, gates) if experts_out is None else experts_out
        if shared_out is not None:
            out = out + shared_out
        if self.aux_loss is not None:
            self.aux_loss = None  # as MoELayer's forward leaves it outside training
        return out


class BlockPlan:
    """What `NativeDecodeBlock` hands the C calls for one layer, built once: the four projections'
    addresses, and the modules they belong to (which keep those tensors alive)."""

    __slots__ = ("qkv", "o", "heads", "kv_heads", "dim", "modules", "tensors", "attn", "attn_norm", "ffn_norm",
                 "ffn", "rope", "q_norm", "k_norm", "layer_index", "q", "k", "v", "attended", "front", "route",
                 "routes", "hook_dicts", "token_table", "count_row", "experts_out")

    def __init__(self, block: Block):
        attn = block.attn
        linears = [getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        self.qkv = (Projection * 3)(*(_projection(p) for p in linears[:3]))
        self.o = _projection(linears[3])
        self.heads, self.kv_heads, self.dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.modules = [block.attn_norm, attn, block.ffn_norm, *linears]
        self.tensors = [(p.data, p.scales, p.zeros) for p in linears]  # what the addresses point into
        # the modules a step reads, held here: each attribute of an nn.Module is a lookup in its dicts
        self.attn, self.attn_norm, self.ffn_norm = attn, block.attn_norm, block.ffn_norm
        self.ffn = block.moe if block.is_moe else block.ffn
        self.rope, self.q_norm, self.k_norm, self.layer_index = attn.rope, attn.q_norm, attn.k_norm, attn.layer_index
        # q, k, v of a step: read by the attention and copied into the session's cache within the step
        self.q, self.k, self.v = (torch.empty(n, self.dim) for n in (self.heads, self.kv_heads, self.kv_heads))
        self.attended = torch.empty(self.heads, self.dim)  # the attention's output, read by attention_out
        self.front, self.route, self.routes = self._front(block)
        experts = getattr(self.ffn, "experts", None) if self.routes else None
        self.token_table = getattr(experts, "token_table", None)  # the backend's, where it has one
        self.count_row = getattr(experts, "count_row", None)
        self.experts_out = torch.empty(1, block.attn_norm.weight.shape[0])  # the call's sum of the experts
        # where forward hooks on those modules live (torch adds to and removes from these dicts in place)
        self.hook_dicts = [hooks for m in self.modules for hooks in (m._forward_hooks, m._forward_pre_hooks)]

    def _front(self, block: Block) -> tuple[LayerFront, RowRoute, bool]:
        """The layer up to its FFN as one C call's constants, with the router where the FFN is a
        routed MoE layer whose row the call may route (`NativeDecodeMoE` whose experts take a row
        as lists); `routes` says which."""
        ffn, d = self.ffn, block.attn_norm.weight.shape[0]
        router = getattr(ffn, "router", None)
        routes = (type(ffn) is NativeDecodeMoE and getattr(ffn.experts, "forward_row", None) is not None
                  and type(router) is RowwiseRouter and router._native_routing(torch.empty(1, d)))
        experts = router.weight.shape[0] if routes else 1
        route = RowRoute(experts)
        norms = (block.attn_norm, self.q_norm, self.k_norm, block.ffn_norm)
        front = LayerFront(
            qkv=self.qkv, o=self.o,
            attn_norm=norms[0].weight.data_ptr(), q_norm=None if norms[1] is None else norms[1].weight.data_ptr(),
            k_norm=None if norms[2] is None else norms[2].weight.data_ptr(), ffn_norm=norms[3].weight.data_ptr(),
            attn_eps=norms[0].eps, q_eps=0.0 if norms[1] is None else norms[1].eps,
            k_eps=0.0 if norms[2] is None else norms[2].eps, ffn_eps=norms[3].eps, attention_scale=self.dim ** -0.5,
            route_scale=float(router.route_scale) if routes else 1.0, D=d, heads=self.heads,
            kv_heads=self.kv_heads, head_dim=self.dim,
            router_weight=router.weight.data_ptr() if routes else None,
            router_bias=router.bias.data_ptr() if routes and router.bias is not None else None,
            expert_bias=router.expert_bias.data_ptr() if routes and router.expert_bias is not None else None,
            experts=experts, softmax=int(routes and router.score == "softmax"),
            route_norm=int(routes and router.route_norm),
            q=self.q.data_ptr(), k=self.k.data_ptr(), v=self.v.data_ptr(), attended=self.attended.data_ptr(),
            scores=route.addresses[0])
        self.tensors.append(tuple(n.weight for n in norms if n is not None))  # what the front's addresses name
        if routes:  # the call stands in for the MoE layer's routing too: its hooks send a row the long way
            self.modules += [ffn, router]
            self.tensors.append(tuple(t for t in (router.weight, router.bias, router.expert_bias) if t is not None))
        # a swiglu the call may run itself: the dense layer's FFN, or a routed layer's ungated shared expert
        swiglu, kind = None, FFN_OUTSIDE
        if not block.is_moe and type(ffn) is NativeSwiGLU:
            swiglu, kind = ffn, FFN_DENSE
        elif routes and type(ffn.shared) is NativeSwiGLU and ffn.shared_gate is None:
            swiglu, kind = ffn.shared, FFN_SHARED
        if swiglu is not None:
            front.ffn = (Projection * 3)(*(_projection(p) for p in swiglu.projections()))
            front.ffn_kind = kind
            self.modules += [swiglu, *swiglu.projections()]
            self.tensors.append(tuple(t for p in swiglu.projections() for t in (p.data, p.scales, p.zeros)
                                      if t is not None))
        return front, route, routes

    @property
    def ffn_kind(self) -> int:
        """What the one call does with this layer's FFN (native_kernel.FFN_DENSE, ...)."""
        return self.front.ffn_kind

    def finish(self, h_out: torch.Tensor, x: torch.Tensor, ids: list[int], gates: list[float],
               experts_out: torch.Tensor | None, expert_seconds: float) -> torch.Tensor:
        """A routed layer after its C call: h_out [1, 1, d] (the attention's residual, the caller's
        own: returned with the layer's output added in place) and x (the MoE layer's input), routed
        to `ids` with `gates`; `experts_out`: the experts' sum where the call ran them (counted here)."""
        if experts_out is not None:  # every chosen expert was cached: the call ran them too
            self.count_row(len(ids), expert_seconds)
        d = h_out.shape[-1]
        out = self.ffn.routed_row(x.view(1, d), ids, gates, experts_out)
        return h_out.add_(out.view(1, 1, d))  # experts_out is read here, before the next layer's call

    @staticmethod
    def covers(block: Block) -> bool:
        """Whether this layer's decode row can take the two calls: the native decode attention with
        q4/q8 projections without biases, f32 norms, a width the kernel takes."""
        attn = block.attn
        if not isinstance(attn, NativeDecodeAttention) or attn.window is not None:
            return False
        linears = [getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        norms = [block.attn_norm, block.ffn_norm] + [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        return (_takes_projections(linears)
                and all(type(n) in (RMSNorm, NativeRowNorm) and n.weight.dtype == torch.float32
                        and n.weight.is_contiguous() for n in norms)
                and block.attn_norm.weight.shape[0] % 32 == 0)

    def hooked(self) -> bool:
        """A forward hook on any module the calls stand in for (a prefetcher's on the FFN norm)."""
        registry = nn.modules.module  # torch keeps the global hooks there (register_module_forward_hook)
        if getattr(registry, "_global_forward_hooks", None) or getattr(registry, "_global_forward_pre_hooks", None):
            return True
        return any(self.hook_dicts)


class NativeDecodeBlock(Block):
    """A `Block` whose one decode token of one session runs its attention's projections in two C
    calls around the attention (compute/native/decode_layer.c: the norm, the three projections of one
    quantized input, q/k norm and rotation; then the output projection, the residual and the FFN's
    norm), the same kernels in the same order as the per-module path, so the same bits. The FFN or
    MoE layer runs as its module. Every other case, and a layer with forward hooks on the modules
    the calls stand in for, runs `Block.forward`."""

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        plan = block_plan(self)
        if (plan is None or cache is None or attention_mask is not None or h.shape[0] != 1 or h.shape[1] != 1
                or h.dtype != torch.float32 or positions.dim() != 1 or plan.hooked()
                or not isinstance(plan.attn, NativeDecodeAttention)):  # (a test may swap the class back)
            return super().forward(h, positions, cache, attention_mask)
        d = h.shape[-1]
        row = h.view(d) if h.is_contiguous() else h.reshape(d).contiguous()
        cos, sin = plan.rope.at(int(positions[0]), h.device)
        decode_slot = getattr(cache, "decode_slot", None)  # a session's cache: the layer in one call
        slot = decode_slot(plan.layer_index) if decode_slot is not None else None
        if slot is not None:
            h_out, x = torch.empty(1, 1, d), torch.empty(1, 1, d)
            moe = plan.ffn
            routed = plan.routes and not moe.training and not moe.record_routing
            table = plan.token_table() if routed and plan.token_table is not None else None
            outcome = decode_layer_front(plan.front, row, cos, sin, *slot, h_out, x, moe.top_k if routed else 0,
                                         plan.route, table, plan.experts_out)
            if outcome is None:
                return h_out + plan.ffn(x)
            return plan.finish(h_out, x, outcome.ids, outcome.gates, outcome.experts_out, outcome.expert_seconds)
        q, k, v = plan.q, plan.k, plan.v
        attention_in(row, plan.attn_norm, plan.qkv, plan.q_norm, plan.k_norm, cos, sin, q, k, v)
        keys, values = cache.update(plan.layer_index, k.view(1, plan.kv_heads, 1, plan.dim),
                                    v.view(1, plan.kv_heads, 1, plan.dim))
        out = plan.attended
        attend_row(q, keys, values, out)
        h_out, x = torch.empty(1, 1, d), torch.empty(1, 1, d)
        attention_out(out.view(-1), plan.o, row, h_out, plan.ffn_norm, x)
        return h_out + plan.ffn(x)


def block_plan(block: NativeDecodeBlock) -> BlockPlan | None:
    """The block's decode plan (built on first use), or None where its layer has no C path."""
    plan = block.__dict__.get("_decode_plan", False)
    if plan is False:
        plan = block.__dict__["_decode_plan"] = BlockPlan(block) if BlockPlan.covers(block) else None
    return plan


def install_decode_paths(model: torch.nn.Module, config: ColibriConfig) -> int:
    """Give `model`'s attention layers (where its config has the path), RMSNorms and routers the
    decode paths; returns how many modules took one. Same parameters, same names: only the class
    of each module changes."""
    count = 0
    attention = decode_attention_supported(config)
    for module in model.modules():
        if attention and type(module) is Block:
            module.__class__ = NativeDecodeBlock
            count += 1
        elif attention and type(module) is Attention:
            module.__class__ = NativeDecodeAttention
            count += 1
        elif type(module) is RMSNorm:
            module.__class__ = NativeRowNorm
            count += 1
        elif type(module) is SwiGLU and NativeSwiGLU.covers(module):
            module.__class__ = NativeSwiGLU
            count += 1
        elif type(module) is Router:
            module.__class__ = RowwiseRouter
            count += 1
        elif type(module) is MoELayer:
            module.__class__ = NativeDecodeMoE
            count += 1
    return count
