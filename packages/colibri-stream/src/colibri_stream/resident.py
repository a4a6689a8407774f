"""Building colibri-model's `ColibriForCausalLM` from a container's resident region.

The model is constructed on the meta device with a `StreamedExperts` backend per MoE layer (so
the stacked routed-expert parameters never exist), then every resident tensor is dequantized
one at a time from the container's encoding (q8/q4/bf16/f32) to the engine dtype and assigned
(`load_state_dict(assign=True)`). Each tensor is read on its own and dequantized a block of rows
at a time, so the peak while opening is the materialised tensors plus one tensor's stored bytes
plus one block: the budget, which counts the materialised model, holds during the open too.

The container carries the checkpoint's `config.json` verbatim (FORMAT.md); colibri-model's
public reader (`parse_checkpoint_config`) turns it into the `ColibriConfig`, and colibri-model's
`held_dtype` decides each tensor's dtype (1-D tensors fp32), exactly as `load_checkpoint` does.
"""

from __future__ import annotations

import torch
from colibri_int4 import Container
from colibri_model import (
    CheckpointFormatError,
    ColibriConfig,
    ColibriForCausalLM,
    ExpertBackend,
    held_dtype,
    parse_checkpoint_config,
)

from .compute.native_decode import install_decode_paths
from .compute.native_linear import NativeLinear, SharedInput, install, native_linear_name, native_tied_head
from .compute.native_stack import install_decode_stack
from .errors import ContainerConfigError
from .io.heap import release_free_heap
from .io.huge_pages import HugePageArena
from .sizes import aligned
from .stored_embedding import StoredEmbedding, stored_embedding_name


def model_config(container: Container) -> ColibriConfig:
    """The container's model config as a validated `ColibriConfig`."""
    # The container carries the checkpoint's config.json; colibri-model owns its parsing.
    try:
        return parse_checkpoint_config(dict(container.config), f"{container.path}: model config")
    except CheckpointFormatError as exc:
        raise ContainerConfigError(str(exc)) from None


def build_model(
    container: Container,
    config: ColibriConfig,
    backends: dict[int, ExpertBackend],
    dtype: torch.dtype,
    device: torch.device,
    native_linears: bool = False,
    mapped_projections: frozenset[str] = frozenset(),
) -> ColibriForCausalLM:
    """An eval-mode model whose resident weights come from `container` and routed experts from
    `backends` (one per MoE layer). `native_linears`: the q4 projections stay q4 and run on the
    native kernel (compute/native_linear.py), and a decode token's attention runs in C
    (compute/native_decode.py); a tied model's head then runs on the embedding's stored bytes
    (`native_tied_head`). An untied embedding, or one whose tied head is held so, is mapped from
    the file as stored (stored_embedding.py). `mapped_projections` (native only): projections the
    kernel computes on the file's map instead of a copy (the plan's, footprint.Sizing.mappable)."""
    with torch.device("meta"):
        model = ColibriForCausalLM(config, expert_backends=backends)
    state = {}
    expected = set(model.state_dict())
    shared_input = SharedInput()  # q, k, v (gate, up) of a layer read one tensor: quantized once
    group, tied = container.scheme.group_size, config.tie_embeddings
    tied_head = {t.name for t in container.header.tensors
                 if native_linears and native_tied_head(t.name, t.encoding, t.shape, group, tied)}
    mapped = {t.name for t in container.header.tensors
              if stored_embedding_name(t.name, tied, head_apart=t.name in tied_head)}
    # every native projection's bytes in one buffer on huge pages (io/huge_pages.py), the LM head too
    if mapped_projections and not native_linears:
        raise ValueError("mapped projections are computed by the native kernel: native_linears=True")
    arena = HugePageArena(sum(aligned(t.length) for t in container.header.tensors
                              if (native_linear_name(t.name, t.encoding, t.shape, group) or t.name in tied_head)
                              and t.name not in mapped_projections)
                          ) if native_linears else None

    def held_in(name: str) -> HugePageArena | None:
        return None if name in mapped_projections else arena

    for name in mapped:  # the embedding: views of the file as stored, not read into RAM
        raw = container.map_resident(name)
        model.embed = StoredEmbedding(raw, held_dtype(raw.shape, dtype, raw.name), device)
        expected.discard(name)
        if name in tied_head:  # its head: the stored bytes copied once into the arena (or computed on the map)
            model.lm_head = NativeLinear(raw, bias=False, arena=held_in(name), shared_input=shared_input)
    native = [t.name for t in container.header.tensors
              if native_linears and t.name not in mapped and native_linear_name(t.name, t.encoding, t.shape, group)]
    for name in native:
        # copied into the arena from a map of the file: a read buffer would hold a second,
        # anonymous copy of the tensor while it is copied (the LM head's 52 MB at a 49k vocabulary),
        # over the budget the plan counts; the map's pages are clean page cache, reclaimable
        install(model, name, container.map_resident(name), held_in(name), shared_input)
        expected.discard(name)
    for raw in container.iter_resident(skip=mapped | set(native)):
        state[raw.name] = _materialise(raw, held_dtype(raw.shape, dtype, raw.name), device)
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ContainerConfigError(
            f"{container.path}: resident tensors do not match the model config "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    model.load_state_dict(state, strict=True, assign=True)
    for layer in model.moe_layers():
        # Non-persistent counters were created on meta; serving needs no counting at all.
        layer.router.tokens_per_expert = torch.zeros(config.n_experts, device=device)
        layer.router.count_tokens = False
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise ContainerConfigError(f"{container.path}: no weights for {leftover[:3]}")
    del state
    release_free_heap()
    if native_linears:  # the native kernel builds here: a decode token's attention and norms take C too
        install_decode_paths(model, config)
        install_decode_stack(model, config)  # and a decode token's layers one C call
    return model.eval()


# fp32 bytes dequantized at a time. The engine's budget counts the materialised model, not the
# way there: reading the whole resident region and dequantizing each tensor whole put the open's
# peak 0.36 GB over a NanoColibri budget (raw region + the embedding's 0.2 GB fp32 temporary;
# bench/ram_budget.py). One tensor's stored bytes plus this block is all that is added now.
DEQUANT_BLOCK_BYTES = 4 << 20


def _materialise(raw, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`raw` dequantized into a new `dtype` tensor, `DEQUANT_BLOCK_BYTES` of fp32 at a time."""
    if len(raw.shape) != 2:
        return torch.from_numpy(raw.dequantize()).to(device=device, dtype=dtype)
    rows, cols = raw.shape
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    step = max(1, DEQUANT_BLOCK_BYTES // (4 * cols))
    for start in range(0, rows, step):
        out[start : start + step] = torch.from_numpy(raw.rows(start, start + step).dequantize())
    return out


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes held by a module's parameters and buffers (shared tensors counted once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total
