"""Validation: a fixed set of held-out sequences, scored at the training and serving top_k.

The set is the first `eval_batches x batch_size` (global) windows of the validation stream in
file order, so it is the same whatever the world size or micro-batch. Under DDP each rank
scores every world_size-th sequence and the sums are all-reduced. NOTE: under FSDP2 a forward
is a collective, so every rank must run the same number of batches: each scores all of them
(the same result everywhere, no all-reduce). Routers stop counting tokens meanwhile, so
validation never leaks into the balancer's load counts.
"""

from __future__ import annotations

import torch

from ..data.loader import IGNORE_INDEX, TokenSource, fixed_batches
from .distributed import DistributedContext


def build_val_batches(source: TokenSource, seq_len: int, micro_batch: int, n_sequences: int,
                      ctx: DistributedContext, every_rank_all: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    val = fixed_batches(source, seq_len, 1, n_sequences)
    mine = val if every_rank_all else val[ctx.rank::ctx.world_size]
    return [(torch.cat([x for x, _ in mine[i:i + micro_batch]]), torch.cat([y for _, y in mine[i:i + micro_batch]]))
            for i in range(0, len(mine), micro_batch)]


@torch.no_grad()
def validation_loss(model, batches, device: torch.device, autocast: bool, ctx: DistributedContext,
                    reduce: bool, top_k: int | None = None) -> float:
    """Token-weighted mean LM loss over `batches` (eval mode; top_k pinned if given)."""
    model.eval()
    model.set_top_k(top_k)
    routers = [layer.router for layer in model.moe_layers()]
    for r in routers:
        r.count_tokens = False
    total = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            n = float((y != IGNORE_INDEX).sum())
            if n == 0:
                continue
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = model(x, targets=y)
            total += torch.tensor([out.lm_loss.double().item() * n, n], dtype=torch.float64, device=device)
    finally:
        for r in routers:
            r.count_tokens = True
        model.set_top_k(None)
        model.train()
    if reduce:
        total = ctx.all_reduce_sum(total)
    return (total[0] / total[1]).item() if total[1] > 0 else float("nan")
