"""Cross-entropy over the LM head in row chunks, so the whole batch's logits never exist at once.

At nano's `--micro-batch 8`, seq 2048 and vocab 49152, the plain path keeps bf16 logits (1.6 GB),
their fp32 copy and the fp32 log-softmax saved for backward (3.2 GB each) alive from the forward
to the backward. `chunked_cross_entropy` runs the LM head and an fp32 cross-entropy on
`chunk_rows` rows at a time and, while a chunk's logits exist, also computes that chunk's
gradient (`softmax - one_hot`, then through the LM head): the backward only scales the two stored
gradients (hidden states [N, d], LM head [V, d] in fp32) by the incoming one. Peak: one chunk's
logits (2048 rows x 49152: 0.2 GB bf16 + 0.4 GB fp32), no recomputation, and the same matmul
FLOPs as the plain path (forward 2NVd, gradients 4NVd). Checkpointing each chunk instead would
run the LM head forward twice (about 5% more FLOPs on nano, 11% measured on tiny).

The loss is the mean over targets != IGNORE_INDEX, in fp32, as
`F.cross_entropy(logits.float(), targets, ignore_index=-100)` computes it (NaN when nothing is a
target). Matmuls run in the compute dtype (autocast's, e.g. bf16; else h's), the softmax and the
loss in fp32. Without grad (validation) it only computes the loss, chunk by chunk.
"""

from __future__ import annotations

import torch

from .experts import compute_dtype

IGNORE_INDEX = -100
DEFAULT_CHUNK_ROWS = 2048


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over valid rows of CE(h @ weight^T, targets); the gradients are made in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows: int, dtype: torch.dtype, need_grads: bool):
        w = weight.to(dtype)
        valid = targets != IGNORE_INDEX
        safe_targets = torch.where(valid, targets, 0).unsqueeze(1)  # ignored rows: any class, masked
        grad_h = torch.empty_like(h) if need_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h_c, t_c, keep = h[rows].to(dtype), safe_targets[rows], valid[rows].unsqueeze(1)
            log_probs = torch.log_softmax((h_c @ w.t()).float(), dim=1)  # [C, V] fp32
            total = total - (log_probs.gather(1, t_c) * keep).sum()
            if need_grads:
                # d(sum of CE)/d(logits) = softmax - one_hot(target); ignored rows get zero, applied
                # to the [C, d] factors rather than to the [C, V] matrix (one pass less over it).
                d_logits = log_probs.exp_()
                d_logits.scatter_add_(1, t_c, torch.full(t_c.shape, -1.0, device=h.device))
                d_logits = d_logits.to(dtype)
                grad_h[rows] = ((d_logits @ w) * keep).to(h.dtype)
                grad_w += (d_logits.t() @ (h_c * keep)).float()
        if need_grads:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_total.to(grad_h.dtype), (grad_w * grad_total).to(ctx.weight_dtype), None, None, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Mean fp32 cross-entropy of `F.linear(h, weight)` against `targets`.

    h: [N, d] final hidden states; weight: [V, d] LM head; targets: [N] (IGNORE_INDEX = no loss).
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    need_grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    dtype = compute_dtype(h)
    with torch.autocast(h.device.type, enabled=False):  # dtypes are explicit inside
        total = _LinearCrossEntropy.apply(h, weight, targets, chunk_rows, dtype, need_grads)
    return total / (targets != IGNORE_INDEX).sum()
