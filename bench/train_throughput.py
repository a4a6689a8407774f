"""Training throughput: tokens/s and MFU of the colibri-model Trainer, and its overhead.

Runs the real Trainer (`train_step`: loader, accumulation, clipping, balancer, metrics) for a
preset on synthetic tokens, interleaved with a bare loop (forward, backward, AdamW step on the
same model and batch shape), and prints medians as JSON:

    tokens_per_s     trainer tokens/s (global batch x seq_len / step time)
    mfu              tokens_per_s x (6 x active params + attention FLOPs) / peak  (None if peak unknown)
    trainer_over_bare  time(trainer step) / time(bare step)    goal <= 1.05
    host_syncs       per trainer step on CUDA (sync-debug warnings and the profiler's count of
                     synchronizing CUDA calls, host_syncs.py); "not countable" on CPU
    memory           the planner's peak for this configuration (training/memory_plan.py, the
                     compute path the model runs today) beside the measured one:
                     torch.cuda.max_memory_allocated on CUDA; on CPU the growth of the peak RSS
                     since before the trainer was built (it also holds the data and the
                     allocator's caches, so it is a loose check)

MFU needs a peak: known GPUs are looked up (bf16 dense), otherwise pass --peak-tflops.

Usage: python bench/train_throughput.py --preset tiny --seq-len 128 --batch-size 8 [--steps 6]
       python bench/train_throughput.py --preset nano --seq-len 2048 --batch-size 16 --micro-batch 8 \
           --precision bf16 --compile           (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import numpy as np
import torch
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.host_syncs import count_host_syncs
from colibri_model.training import TrainConfig, Trainer
from colibri_model.training.activations import MODEL_PATH
from colibri_model.training.memory_plan import plan_memory
from colibri_model.training.metrics import flops_per_token


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--sync-steps", type=int, default=2, help="trainer steps to count host syncs over (CUDA)")
    args = parser.parse_args()

    config = get_preset(args.preset)
    rss_before = _peak_rss()
    rng = np.random.default_rng(0)
    n_tokens = (args.steps + args.warmup + args.sync_steps) * 2 * args.batch_size * args.seq_len + args.seq_len + 1
    source = TokenSource([rng.integers(0, config.vocab_size, size=n_tokens).astype(np.uint16)])
    cfg = TrainConfig(steps=10**6, seq_len=args.seq_len, batch_size=args.batch_size,
                      micro_batch=args.micro_batch or args.batch_size, warmup_steps=0, eval_batches=1,
                      device=args.device, precision=args.precision, compile=args.compile,
                      activation_checkpointing=args.activation_checkpointing, peak_tflops=args.peak_tflops,
                      progress=False)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(run_dir, cfg, source, source, config)
        device = trainer.device

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        def trainer_step() -> float:
            sync()
            start = time.perf_counter()
            trainer.train_step()
            sync()
            return time.perf_counter() - start

        def bare_step() -> float:
            x, y = trainer.loader.next_batch(cfg.batch_size)
            x, y = x.to(device), y.to(device)
            sync()
            start = time.perf_counter()
            for i in range(0, cfg.batch_size, cfg.micro_batch):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=trainer.autocast):
                    out = trainer.forward_model(x[i:i + cfg.micro_batch], targets=y[i:i + cfg.micro_batch])
                out.loss.backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            sync()
            return time.perf_counter() - start

        for _ in range(args.warmup):
            trainer_step()
            bare_step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timed_trainer, timed_bare = [], []
        for _ in range(args.steps):  # interleaved, so machine noise hits both alike
            timed_trainer.append(trainer_step())
            timed_bare.append(bare_step())
        if device.type == "cuda":
            measured_peak = {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
                             "max_memory_reserved": torch.cuda.max_memory_reserved(device)}
        else:
            # the growth of the peak RSS since before the trainer existed: what training added
            measured_peak = {"peak_rss_growth": _peak_rss() - rss_before, "peak_rss": _peak_rss()}
        syncs = count_host_syncs(trainer.train_step, device, steps=args.sync_steps) if args.sync_steps else None
        plan = plan_memory(config, micro_batch=cfg.micro_batch, seq_len=cfg.seq_len,
                           precision="bf16" if trainer.autocast else "fp32",
                           ac="full" if args.activation_checkpointing else "none",
                           grad_accum=trainer.grad_accum, path=MODEL_PATH)
        measured = next(iter(measured_peak.values()))
        tokens = cfg.batch_size * cfg.seq_len
        t_trainer, t_bare = statistics.median(timed_trainer), statistics.median(timed_bare)
        tokens_per_s = tokens / t_trainer
        peak = trainer.peak_flops
        result = {
            "preset": args.preset, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": "bf16" if trainer.autocast else "fp32", "compile": args.compile,
            "seq_len": args.seq_len, "batch_size": args.batch_size, "micro_batch": cfg.micro_batch,
            "tokens_per_s": round(tokens_per_s, 1), "bare_tokens_per_s": round(tokens / t_bare, 1),
            "flops_per_token": flops_per_token(config, args.seq_len),
            "mfu": round(tokens_per_s * flops_per_token(config, args.seq_len) / peak, 4) if peak else None,
            "trainer_over_bare": round(t_trainer / t_bare, 3),
            "host_syncs_per_step": syncs if syncs is not None else "not countable (CPU)",
            "memory": {"planned_peak_allocated": plan.peak_allocated, "planned_peak_device": plan.peak_device,
                       "planner_compute_path": plan.compute_path, **measured_peak,
                       "planned_over_measured": round(plan.peak_allocated / measured, 3)},
            "steps": args.steps, "torch": torch.__version__, "threads": torch.get_num_threads(),
        }
        trainer.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
