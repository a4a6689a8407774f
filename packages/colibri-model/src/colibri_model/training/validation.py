"""Validation: a fixed set of held-out sequences, scored at the training and serving top_k.

The set is the first `eval_batches x batch_size` (global) windows of the validation stream in
file order, so it is the same whatever the world size or micro-batch. Each rank scores every
world_size-th sequence (DDP and FSDP2 alike) and the token-weighted loss sums are all-reduced
once, so the result is the one-process loss up to fp32 summation order
(tests/test_train_fsdp.py).

NOTE: under FSDP2 a forward is a collective, so every rank must run the same number of
forwards. When the set does not divide by the world size, the ranks that are one sequence
short score a filler sequence whose targets are all ignored (weight 0), and a batch without
targets is still run, never skipped. The sums stay on the device: one host read per
evaluation, whatever the number of batches (tests/test_train_validation.py). Routers stop counting tokens meanwhile, so validation never leaks into the
balancer's load counts.
"""

from __future__ import annotations

import torch

from ..data.loader import IGNORE_INDEX, TokenSource, fixed_batches
from .distributed import DistributedContext


def build_val_batches(source: TokenSource, seq_len: int, micro_batch: int, n_sequences: int,
                      ctx: DistributedContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of the validation set, in micro-batches; the same count on every rank."""
    val = fixed_batches(source, seq_len, 1, n_sequences)
    mine = val[ctx.rank::ctx.world_size]
    per_rank = -(-len(val) // ctx.world_size)  # ceil: rank 0's share, the largest
    if val and len(mine) < per_rank:
        filler_x, filler_y = val[0]
        mine = mine + [(filler_x, torch.full_like(filler_y, IGNORE_INDEX))] * (per_rank - len(mine))
    return [(torch.cat([x for x, _ in mine[i:i + micro_batch]]), torch.cat([y for _, y in mine[i:i + micro_batch]]))
            for i in range(0, len(mine), micro_batch)]


@torch.no_grad()
def validation_loss(model, batches, device: torch.device, autocast: bool, ctx: DistributedContext,
                    top_k: int | None = None) -> float:
    """Token-weighted mean LM loss over every rank's `batches` (eval mode; top_k pinned if given)."""
    model.eval()
    model.set_top_k(top_k)
    routers = [layer.router for layer in model.moe_layers()]
    for r in routers:
        r.count_tokens = False
    total = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            n = (y != IGNORE_INDEX).sum().double()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = model(x, targets=y)
            # a batch without targets has a NaN mean loss and weight 0: keep the NaN out
            loss_sum = torch.where(n > 0, out.lm_loss.double() * n, torch.zeros_like(n))
            total += torch.stack([loss_sum, n])
    finally:
        for r in routers:
            r.count_tokens = True
        model.set_top_k(None)
        model.train()
    # one host read for the whole run: both sums at once (`if total[1] > 0` would be a second)
    loss_sum, tokens = ctx.all_reduce_sum(total).tolist()
    return loss_sum / tokens if tokens > 0 else float("nan")
