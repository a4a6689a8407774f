"""The routed experts' grouped matmul as a torch custom op, and a warning when it will be slow.

`grouped_linear(x_MD, weight_EFD, offsets_E)` computes, for each expert e, the rows of `x` from
`offsets[e-1]` to `offsets[e]` times `weight[e]^T`: one `torch._grouped_mm` per projection
instead of one matmul per expert. Shape suffixes: M rows (token-slots sorted by expert),
D input width, F output width, E experts.

Why a custom op (`torch.library.custom_op`) rather than calling `torch._grouped_mm` directly:
- the weight arrives as the fp32 master and is cast to the activations' dtype INSIDE the op, in
  forward and again in backward, so a bf16 copy of every expert is never saved for backward
  (nano: ~4.6 GB over 23 MoE layers) and the gradient reaching the master is fp32;
- `torch.compile` sees one opaque node with a fake (shape-only) implementation. Traced directly,
  `_grouped_mm`'s meta check refuses fp32 inputs ("Expected inputs of BF16 type", so the CPU's fp32
  training could not compile), and inductor on CPU materialises the transposed gradient of the
  weight-gradient product contiguously, which breaks `_grouped_mm`'s 16-byte stride rule
  ("strides should be multiple of 16 bytes") whenever the row count is not a multiple of 8. Inside
  the op the layouts are ours: the gradient is made contiguous and transposed as a view;
- the backward is hand-written: autograd's generic one for `_grouped_mm` on CPU costs about 3x
  the forward (0.135 s vs 0.045 s for 8192x1024 -> 64x512); here the input gradient is one
  forward-shaped grouped matmul and the weight gradient one 2d x 2d grouped matmul (row groups
  become the reduction dimension): 0.107 s.

`warn_if_slow_grouped_mm(device, dtype)` logs ONE warning per cause when the routed experts will
run far below speed: a torch without `_grouped_mm`, a CUDA GPU below sm90 (no fast grouped
kernel: `_grouped_mm` falls back to one GEMM per expert, copying the offsets to the host), or
CUDA with fp32 activations (the fast kernel is bf16-only).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("colibri_model")

_warned: set[str] = set()

# The estimate for nano on an H100 when every routed-expert matmul takes the fallback:
# ~13k small GEMMs and ~207 host syncs per micro-batch, capping MFU near 17% (vs >= 30% goal).
FALLBACK_COST = ("about 13k small GEMMs and 200 host syncs per nano micro-batch: expect the step to take "
                 "roughly 2x longer (MFU capped near 17% on nano)")


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


@torch.library.custom_op("colibri_model::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, D] (rows sorted by expert), weight [E, F, D] any float dtype, offsets [E] int32 cumulative
    row counts -> [M, F] in x's dtype."""
    return torch._grouped_mm(x.contiguous(), weight.to(x.dtype).transpose(-2, -1), offs=offsets)


@grouped_linear.register_fake
def _grouped_linear_fake(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("colibri_model::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x [M, D] in x's dtype, grad_weight [E, F, D] in weight's dtype)."""
    grad_out = grad_out.contiguous()
    grad_x = torch._grouped_mm(grad_out, weight.to(x.dtype), offs=offsets)
    # [F, M] view (strides 1, F) x [M, D]: the M rows of each group are the reduction dimension.
    grad_w = torch._grouped_mm(grad_out.t(), x.contiguous(), offs=offsets)
    return grad_x, grad_w.to(weight.dtype)


@grouped_linear_backward.register_fake
def _grouped_linear_backward_fake(grad_out, x, weight, offsets):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, offsets = inputs
    ctx.save_for_backward(x, weight, offsets)


def _backward(ctx, grad_out):
    x, weight, offsets = ctx.saved_tensors
    grad_x, grad_w = grouped_linear_backward(grad_out, x, weight, offsets)
    return grad_x, grad_w, None


grouped_linear.register_autograd(_backward, setup_context=_setup_context)


def _warn_once(cause: str, message: str) -> None:
    if cause not in _warned:
        _warned.add(cause)
        logger.warning(message)


def warn_if_slow_grouped_mm(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Log one warning per cause (per process) when the routed experts will run far below speed.

    `dtype` is the experts' compute dtype (bf16 under autocast). Returns the cause, or None when
    the fast path applies (any CPU with `_grouped_mm`; a CUDA GPU of sm90 or newer in bf16).
    """
    device = torch.device(device)
    if not has_grouped_mm():
        _warn_once("no_grouped_mm", (
            f"torch {torch.__version__} has no torch._grouped_mm: the routed experts run the per-expert "
            f"reference loop (a nonzero() host sync and three matmuls per expert per layer) and a block "
            f"cannot compile with fullgraph=True; {FALLBACK_COST}. Install torch>=2.13."))
        return "no_grouped_mm"
    if device.type != "cuda" or torch.version.hip:
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        name = torch.cuda.get_device_name(device)
        _warn_once("slow_gpu", (
            f"{name} (sm{capability[0]}{capability[1]}) has no fast torch._grouped_mm kernel (it needs sm90+, "
            f"e.g. H100/H200): each routed-expert matmul falls back to one GEMM per expert with the "
            f"offsets copied to the host; {FALLBACK_COST}."))
        return "slow_gpu"
    if dtype != torch.bfloat16:
        _warn_once("fp32_on_cuda", (
            f"routed experts in {dtype} on CUDA: torch._grouped_mm's fast kernel is bf16-only, so every "
            f"expert matmul takes the per-expert fallback; {FALLBACK_COST}. Train with --dtype bf16."))
        return "fp32_on_cuda"
    return None
