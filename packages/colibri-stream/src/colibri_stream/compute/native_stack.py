"""One decode token of one session through the model's layers in one C call
(compute/native/decode_layer.c's `colibri_decode_layers`), where native_decode.py's paths make a
call per layer.

With a layer in one C call, what was left of a decode step at full RAM was Python: a module call,
a rotation lookup, the cache slot, the counters and a dozen attribute reads per layer, about 2 ms
of a 17 ms token on a 24-layer model (bench/decode_split.py). Here the model's forward, for one
token [1, 1] of a session whose cache has no sliding layers, hands the layers to C as an array
built once (`DecodeStack`): each layer's constants, its cached experts' table, where its key and
value go this token, this position's rotation rows. The call runs layer after layer, each as
`colibri_decode_layer_front` with its experts, and adds the experts' sum to the residual (with an
ungated shared expert's output, run in the call; a dense layer's swiglu runs there too), until a
layer needs Python: a chosen expert not cached (the cache reads it), a gated shared expert,
forward hooks, a layer with no C path. That layer is finished as `NativeDecodeBlock` finishes it
(or runs as its module), and the call resumes after it. The arithmetic is each layer's own call in
the order the per-layer path makes it: the same bits (tested).

A block with a forward hook of its own (or under a global module hook: every block) runs as its
module inside the token, the layers around it in the call. Everything else (prefill, batches,
masks, explicit positions, a bf16 or sliding-window cache) runs colibri-model's forward.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn.functional as F
from colibri_model import CausalLMOutput, ColibriConfig, ColibriForCausalLM
from torch import nn

from .native_decode import (
    NativeDecodeAttention,
    NativeDecodeBlock,
    NativeDecodeMoE,
    block_plan,
    decode_attention_supported,
)
from .native_kernel import FFN_DENSE, FFN_SHARED, DecodeLayer, decode_layers


class NativeDecodeModel(ColibriForCausalLM):
    """A `ColibriForCausalLM` whose one decode token of one session runs its layers through
    `DecodeStack` (module docstring); every other call is colibri-model's forward."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, cache=None,
                return_logits: bool = False, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        stack = self.__dict__.get("_decode_stack", False)
        if stack is False:
            stack = self.__dict__["_decode_stack"] = DecodeStack.build(self)
        if (stack is None or targets is not None or positions is not None or attention_mask is not None
                or self.training or input_ids.shape != (1, 1) or not stack.takes(cache)):
            return super().forward(input_ids, targets, cache, return_logits, positions, attention_mask)
        h = stack.run(self, input_ids, cache)
        cache.length += 1
        h = self.norm(h)
        # the model's head, as its forward applies it (tied: the embedding's weight)
        logits = F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)
        return CausalLMOutput(logits=logits)


class DecodeStack:
    """The model's layers as `decode_layers` takes them, built once: per layer a `DecodeLayer`
    whose constants are set here and whose per-token fields (`table`, the cache's addresses, the
    rotation rows, `top_k`) `run` refreshes; and, per layer, whether it may run in the call at all
    (a `NativeDecodeBlock` with a block plan whose call routes its row)."""

    def __init__(self, model: ColibriForCausalLM):
        self.blocks = list(model.layers)
        self.plans = [block_plan(b) if type(b) is NativeDecodeBlock else None for b in self.blocks]
        self.routed = [p is not None and p.routes and type(p.ffn) is NativeDecodeMoE for p in self.plans]
        self.dense = [p is not None and p.ffn_kind == FFN_DENSE for p in self.plans]  # its swiglu in the call
        self.callable = [routed or dense for routed, dense in zip(self.routed, self.dense)]
        count, d = len(self.blocks), model.config.d_model
        self.layers = (DecodeLayer * count)()
        for layer, plan, callable_ in zip(self.layers, self.plans, self.callable):
            if not callable_:
                continue
            layer.front = ctypes.addressof(plan.front)
            layer.ids, layer.gates = plan.route.addresses[1], plan.route.addresses[2]
            layer.experts_out = plan.experts_out.data_ptr()
            moe = plan.ffn
            # a shared expert the call does not add (a gated one) leaves the layer to Python
            layer.finish = int(isinstance(moe, NativeDecodeMoE) and plan.ffn_kind != FFN_SHARED
                               and (moe.shared is not None or moe.shared_gate is not None))
        # the rotation tables: layers whose rotary embeddings are built alike share one lookup a token
        self.ropes = [b.attn.rope for b in self.blocks]
        kinds: dict[tuple, int] = {}
        self.rope_of = [kinds.setdefault((r.head_dim, r.theta, repr(r.scaling), r.interleave, r.max_len), i)
                        for i, r in enumerate(self.ropes)]
        self.rope_owners = sorted(set(self.rope_of))
        self.ensured = 0  # positions every rotation table holds
        # the running residual and one layer's outputs: a layer's results are read before the next call
        self.h, self.h_out, self.x_out = (torch.empty(1, 1, d) for _ in range(3))
        self.stopped = ctypes.c_int64()
        self.kv: weakref.ref | None = None  # the session cache whose addresses `layers` holds
        self.kv_storage = -1

    @classmethod
    def build(cls, model: ColibriForCausalLM) -> DecodeStack | None:
        """The stack, or None when no layer of `model` may run in the call."""
        stack = cls(model)
        return stack if any(stack.callable) else None

    def takes(self, cache) -> bool:
        """Whether `cache` is a session's cache the call may write: f32, no sliding layer."""
        return (getattr(cache, "decode_slot", None) is not None and cache.dtype == torch.float32
                and not any(w is not None for w in cache.windows))

    def run(self, model: ColibriForCausalLM, input_ids: torch.Tensor, kv) -> torch.Tensor:
        """The residual [1, 1, d] after every layer for one token at position kv.length (the
        cache's columns written, its length not advanced: the model's forward does that)."""
        position = kv.length
        kv.reserve(position + 1)
        if position >= kv.capacity:  # (reserve raises first; the call writes column `position`)
            raise ValueError(f"decode stack: a cache of {kv.capacity} columns has no column {position}")
        self._point_at(kv)
        device = input_ids.device
        self._rotations(position, device)
        h = self.h
        h.copy_(model.embed(input_ids))
        in_call = self._in_call()
        count, first, positions = len(self.blocks), 0, None
        while first < count:
            if not in_call[first]:
                if positions is None:
                    positions = torch.arange(position, position + 1, device=device)
                h.copy_(self.blocks[first](h, positions, kv))
                first += 1
                continue
            end = in_call.index(False, first) if False in in_call[first:] else count
            stop = decode_layers(self.layers, first, end, position, h.view(-1), self.h_out.view(-1),
                                 self.x_out.view(-1), self.stopped)
            self._count(first, stop)
            if stop < end:  # that layer's front ran: Python finishes it
                layer, plan = self.layers[stop], self.plans[stop]
                top_k = layer.top_k
                experts_out = plan.experts_out if layer.experts_done else None
                ids, gates = plan.route.ids[:top_k], plan.route.gates[:top_k]
                h.copy_(plan.finish(self.h_out, self.x_out, ids, gates, experts_out, layer.expert_seconds))
                stop += 1
            first = stop
        return h

    def _in_call(self) -> list[bool]:
        """Per layer, whether it runs in the call this token (its table refreshed where it does); a
        hook of its modules' or a global one (`BlockPlan.hooked`), or of the block's, keeps it out."""
        flags = []
        for block, plan, routed, callable_, layer in zip(self.blocks, self.plans, self.routed, self.callable,
                                                          self.layers):
            ok = (callable_ and type(block) is NativeDecodeBlock and isinstance(plan.attn, NativeDecodeAttention)
                  and not plan.hooked() and not block._forward_hooks and not block._forward_pre_hooks)
            if ok and routed:
                moe = plan.ffn
                ok = not moe.training and not moe.record_routing
            if ok and routed:
                layer.top_k = moe.top_k
                table = plan.token_table() if plan.token_table is not None else None
                layer.table = None if table is None else ctypes.addressof(table)
            flags.append(ok)
        return flags

    def _count(self, first: int, stop: int) -> None:
        """Count the experts the call ran for layers [first, stop) (the stopped layer: `finish`)."""
        for i in range(first, stop):
            if self.routed[i]:
                layer = self.layers[i]
                self.plans[i].count_row(layer.top_k, layer.expert_seconds)

    def _rotations(self, position: int, device: torch.device) -> None:
        """Every layer's rotation rows for `position`: one lookup per kind of table."""
        if position + 1 > self.ensured:  # as the model's forward: every table holds the position first
            for rope in self.ropes:
                rope.ensure(position + 1, device)
            self.ensured = max(position + 1, min(r.max_len for r in self.ropes))
        rows = {owner: self.ropes[owner].at(position, device) for owner in self.rope_owners}
        for layer, owner, callable_ in zip(self.layers, self.rope_of, self.callable):
            if callable_:
                cos, sin = rows[owner]
                layer.cos, layer.sin = cos.data_ptr(), sin.data_ptr()
        self._rows = rows  # the tensors the addresses point into, alive through the call

    def _point_at(self, kv) -> None:
        """The cache's addresses and strides in `layers`, again whenever its storage moved."""
        if self.kv is not None and self.kv() is kv and self.kv_storage == kv.storage_version:
            return
        for i, (layer, plan, callable_) in enumerate(zip(self.layers, self.plans, self.callable)):
            if not callable_:
                continue
            keys, values = kv.keys[i], kv.values[i]
            if (keys.dtype != torch.float32 or values.dtype != torch.float32 or keys.stride(3) != 1
                    or values.stride(3) != 1 or keys.shape[1] != plan.kv_heads or keys.shape[3] != plan.dim
                    or values.shape != keys.shape):
                raise ValueError(f"decode stack: layer {i}'s cache {keys.dtype} {tuple(keys.shape)} is not "
                                 f"{plan.kv_heads} heads of {plan.dim} f32")
            layer.keys, layer.values = keys.data_ptr(), values.data_ptr()
            layer.key_head_stride, layer.key_col_stride = keys.stride(1), keys.stride(2)
            layer.value_head_stride, layer.value_col_stride = values.stride(1), values.stride(2)
        self.kv, self.kv_storage = weakref.ref(kv), kv.storage_version


def install_decode_stack(model: nn.Module, config: ColibriConfig) -> bool:
    """Give `model` (a `ColibriForCausalLM` whose blocks have the decode paths,
    native_decode.install_decode_paths) the one-call decode token; whether it took it."""
    if type(model) is not ColibriForCausalLM or not decode_attention_supported(config):
        return False
    model.__class__ = NativeDecodeModel
    return True
