"""Measure what one forward saves for backward: bytes of unique storages, by kind of module.

`measure_saved_bytes(model, input_ids, targets)` runs the eager forward under
`torch.autograd.graph.saved_tensors_hooks` and sorts every saved tensor into:

- parameters: the weights themselves (saving a reference allocates nothing; counted as params);
- compute copies: autocast's bf16 casts of parameters (found by their autograd history: a
  `ToCopyBackward0` whose input is a parameter's `AccumulateGrad`, through any view);
- activations, by the kind of the innermost module running when they were saved (names as in
  activations.py: attention, mlp_norm, dense_ffn, router, shared_expert, experts, head,
  embedding).

A storage saved by several ops (a view, a tensor two matmuls share) counts once. Under full
activation checkpointing, `torch.utils.checkpoint` keeps its inputs alive outside autograd's
saved tensors (its own hooks, innermost, take the block's saved tensors and keep nothing), so
the tensor arguments of each `torch.utils.checkpoint.checkpoint(...)` call are counted too, as
`checkpoint_inputs`.

This is the yardstick of the memory planner (tests/test_memory_plan.py); it measures the eager
model (torch.compile's partitioner saves less), and costs one forward.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint

_KIND_BY_NAME = (
    (re.compile(r"^layers\.\d+\.(attn_norm|attn)(\.|$)"), "attention"),
    (re.compile(r"^layers\.\d+\.ffn_norm(\.|$)"), "mlp_norm"),
    (re.compile(r"^layers\.\d+\.ffn(\.|$)"), "dense_ffn"),
    (re.compile(r"^layers\.\d+\.moe\.router(\.|$)"), "router"),
    (re.compile(r"^layers\.\d+\.moe\.shared(\.|$)"), "shared_expert"),
    (re.compile(r"^layers\.\d+\.moe(\.|$)"), "experts"),
    (re.compile(r"^embed(\.|$)"), "embedding"),
)


def kind_of_module(name: str) -> str:
    name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")  # compile/AC wrappers
    for pattern, kind in _KIND_BY_NAME:
        if pattern.search(name):
            return kind
    return "head"  # the final norm, the LM head and the loss in the model's own forward


@dataclass
class SavedBytes:
    activations: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    compute_copies: int = 0
    parameters: int = 0
    checkpoint_inputs: int = 0

    @property
    def activations_total(self) -> int:
        return sum(self.activations.values()) + self.checkpoint_inputs


def _is_parameter_cast(tensor: torch.Tensor, param_ids: set[int]) -> bool:
    node = tensor.grad_fn
    while node is not None:  # walk back through views to the cast
        name = type(node).__name__
        if name == "ToCopyBackward0":
            return any(getattr(f, "variable", None) is not None and id(f.variable) in param_ids
                       for f, _ in node.next_functions if f is not None)
        if not name.startswith(("TBackward", "ViewBackward", "TransposeBackward", "PermuteBackward",
                                "ExpandBackward", "UnsqueezeBackward", "SqueezeBackward")):
            return False
        node = node.next_functions[0][0] if node.next_functions else None
    return False


def measure_saved_bytes(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                        autocast_dtype: torch.dtype | None = None) -> SavedBytes:
    """Run `model(input_ids, targets=targets)` once and account its saved tensors (see above)."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ids = {id(p) for p in model.parameters()}
    result = SavedBytes()
    seen: set[int] = set()
    running: list[str] = [""]
    handles = []

    def enter(name: str):
        def hook(_module, _args) -> None:
            running.append(name)
        return hook

    def leave(_module, _args, _output) -> None:  # returning None keeps the output
        running.pop()

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))

    def count_storage(tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() in param_storages:
            result.parameters += count_storage(tensor)
        elif _is_parameter_cast(tensor, param_ids):
            result.compute_copies += count_storage(tensor)
        else:
            result.activations[kind_of_module(running[-1])] += count_storage(tensor)
        return tensor

    original_checkpoint = torch.utils.checkpoint.checkpoint

    def counting_checkpoint(function, *args, **kwargs):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                result.checkpoint_inputs += count_storage(arg)
        return original_checkpoint(function, *args, **kwargs)

    autocast = (torch.autocast(input_ids.device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    torch.utils.checkpoint.checkpoint = counting_checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
            out = model(input_ids, targets=targets)
        del out
    finally:
        torch.utils.checkpoint.checkpoint = original_checkpoint
        for handle in handles:
            handle.remove()
    result.activations = dict(result.activations)
    return result
