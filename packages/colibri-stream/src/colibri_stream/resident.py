"""Building colibri-model's `ColibriForCausalLM` from a container's resident region.

The model is constructed on the meta device with a `StreamedExperts` backend per MoE layer (so
the stacked routed-expert parameters never exist), then every resident tensor is dequantized
one at a time from the container's encoding (q8/q4/bf16/f32) to the engine dtype and assigned
(`load_state_dict(assign=True)`). Peak memory is the raw resident region plus the materialised
tensors plus one fp32 temporary, never a second full fp32 copy.

The container carries the checkpoint's `config.json` verbatim (FORMAT.md), so the config is
checked like colibri-model's reader does: `format_version` major 1, `model_type` "colibri".
"""

from __future__ import annotations

import ctypes

import torch
from colibri_int4 import Container
from colibri_model import ColibriConfig, ColibriForCausalLM, ExpertBackend
from colibri_model.checkpoint import CheckpointFormatError, parse_checkpoint_config

from .errors import ContainerConfigError


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
) -> ColibriForCausalLM:
    """An eval-mode model whose resident weights come from `container` and routed experts from
    `backends` (one per MoE layer)."""
    with torch.device("meta"):
        model = ColibriForCausalLM(config, expert_backends=backends)
    state = {}
    for name, raw in container.read_resident(dequantize=False).items():
        # 1-D tensors (norms, expert_bias) stay fp32 like colibri-model keeps them.
        target = torch.float32 if (len(raw.shape) == 1 or name.endswith("expert_bias")) else dtype
        state[name] = torch.from_numpy(raw.dequantize()).to(device=device, dtype=target)
    expected = set(model.state_dict())
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
    del state, raw
    release_free_heap()
    return model.eval()


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`).

    NOTE: materialising the resident tensors frees the raw region and many fp32 temporaries;
    glibc keeps much of that heap mapped (measured: 31 MB of a 321 MB NanoColibri slice), which
    would sit outside the budget. A no-op where glibc is not the allocator."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
