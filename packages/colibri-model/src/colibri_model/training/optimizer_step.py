"""One optimizer step of the Trainer (mixed into trainer.Trainer, whose attributes it uses).

Per optimizer step:
  1. draw the GLOBAL batch from the packed loader; this rank takes its slice and splits it into
     `grad_accum` micro-batches;
  2. forward/backward each micro-batch (bf16 autocast on CUDA; DDP or FSDP2 syncs gradients
     only on the last one). Each micro loss is weighted by its share of the global count of
     target tokens, so the gradient is the token-weighted mean over the global batch whatever
     the world size or the SFT masks;
  3. all-reduce the loss; clip; if the loss or the gradient norm is not finite, skip the update
     (and log it), stopping with `TrainingDivergedError` after `max_bad_steps` in a row;
  4. set the scheduled lr and step AdamW. The expert-bias balancer runs as an optimizer
     pre-hook over the counts of the whole accumulated batch (balancing.py);
  5. (trainer.py's loop) log metrics, validate every `eval_every`, checkpoint every
     `save_every` and at the end.

Host syncs: none inside a micro-batch's forward and backward (the target counts are taken on the
host before the batch moves to the device); ONE device-to-host read per step, after the last
backward, carries the loss, aux loss and gradient norm the divergence guard needs; the router
statistics are copied to the host only for steps that are logged. `--compile` compiles each block
with fullgraph=True (model.compile_blocks).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from ..data.loader import IGNORE_INDEX
from .metrics import MetricsRecord, RouterLayerMetrics
from .schedules import lr_at


class OptimizerStep:
    """`train_step`: micro-batches, accumulation, the divergence guard and the AdamW step."""

    def _reset_router_counts(self) -> None:
        for layer in self.model.moe_layers():
            layer.router.tokens_per_expert.zero_()

    def train_step(self, router_stats: bool = True) -> MetricsRecord:
        """One optimizer step. `router_stats=False` leaves `record.router` empty (train() fills it
        only for logged steps, sparing a host copy of the counts on the others)."""
        cfg, ctx = self.cfg, self.ctx
        windows = self.loader.next_windows(cfg.batch_size)
        per_rank = cfg.batch_size // ctx.world_size
        inputs, targets = self.loader.gather(windows[ctx.rank * per_rank:(ctx.rank + 1) * per_rank])
        # Target counts per sequence, read on the host before the batch moves to the device: no sync.
        valid = (targets != IGNORE_INDEX).sum(dim=1).tolist()
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        local_valid = float(sum(valid))
        global_valid = ctx.all_reduce_sum(torch.tensor(local_valid, dtype=torch.float64, device=self.device)
                                          ).item() if ctx.enabled else local_valid
        lr, phase = lr_at(self.step, cfg)

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        mb = cfg.micro_batch
        for micro in range(self.grad_accum):
            x, y = inputs[micro * mb:(micro + 1) * mb], targets[micro * mb:(micro + 1) * mb]
            n_valid = float(sum(valid[micro * mb:(micro + 1) * mb]))
            last = micro == self.grad_accum - 1
            if self.sharded:
                self.model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last or not ctx.enabled else self.forward_model.no_sync()
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
            with sync, autocast:
                out = self.forward_model(x, targets=y)
                weight = n_valid / global_valid * ctx.world_size if global_valid else 0.0
                # NOTE: a micro-batch with no target gives NaN mean loss; its weight is 0 and we
                # must not let 0 * NaN poison the gradient, hence the nan_to_num.
                lm = torch.nan_to_num(out.lm_loss, nan=0.0) if n_valid == 0 else out.lm_loss
                loss = lm * weight
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss / self.grad_accum
                    aux_sum += out.aux_loss.detach().double() / self.grad_accum
                loss.backward()
            loss_sum += lm.detach().double() * n_valid
        stats = ctx.all_reduce_sum(torch.stack([loss_sum, aux_sum]))
        # max_norm=inf measures without clipping; under FSDP2 the norm is a DTensor
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # The step's one host read: the divergence guard below needs these three numbers.
        loss_total, aux_total, grad_norm = torch.stack([stats[0], stats[1], norm.double()]).tolist()
        mean_loss = loss_total / global_valid if global_valid else float("nan")
        aux = aux_total / ctx.world_size if self.config.aux_loss_alpha > 0 else None
        skip_reason = None
        if global_valid == 0:
            skip_reason = "no target tokens in the batch"
        elif not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            skip_reason = f"non-finite {'loss' if not math.isfinite(mean_loss) else 'gradient norm'}"
        if skip_reason is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()  # the balancer's pre-hook updates the expert biases first
            self.bad_in_row = 0
        else:
            self._reset_router_counts()
            self.skipped_steps += 1
            if global_valid:
                self.bad_in_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.batch_size * cfg.seq_len
        router = [] if skip_reason or not router_stats else self._router_metrics()
        return MetricsRecord(step=self.step, time=time.time(), kind=self.kind,
                             loss=None if skip_reason else mean_loss, aux_loss=aux, lr=lr, phase=phase,
                             grad_norm=grad_norm if math.isfinite(grad_norm) else None,
                             tokens_seen=self.tokens_seen, tokens_per_s=0.0, mfu=None,
                             skipped=skip_reason is not None, skip_reason=skip_reason, router=router)

    def _router_metrics(self) -> list[RouterLayerMetrics]:
        return [RouterLayerMetrics.from_stats(s) for s in self.balancer.last_stats]
