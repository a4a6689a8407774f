"""Training throughput: tokens/s and MFU of the colibri-model Trainer, and its overhead.

Runs the real Trainer (`train_step`: loader, accumulation, clipping, balancer, metrics) for a
preset on synthetic tokens, interleaved with a bare loop (forward, backward, AdamW step on the
same model and batch shape), and prints medians as JSON:

    tokens_per_s     trainer tokens/s (global batch x seq_len / step time)
    mfu              tokens_per_s x (6 x active params + attention FLOPs) / peak  (None if peak unknown)
    trainer_over_bare  time(trainer step) / time(bare step)    goal <= 1.05

MFU needs a peak: known GPUs are looked up (bf16 dense), otherwise pass --peak-tflops.

Usage: python bench/train_throughput.py --preset tiny --seq-len 128 --batch-size 8 [--steps 6]
       python bench/train_throughput.py --preset nano --seq-len 2048 --batch-size 16 --micro-batch 8 \
           --precision bf16 --compile           (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.training import TrainConfig, Trainer
from colibri_model.training.metrics import flops_per_token


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
    args = parser.parse_args()

    config = get_preset(args.preset)
    rng = np.random.default_rng(0)
    n_tokens = (args.steps + args.warmup) * 2 * args.batch_size * args.seq_len + args.seq_len + 1
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
        timed_trainer, timed_bare = [], []
        for _ in range(args.steps):  # interleaved, so machine noise hits both alike
            timed_trainer.append(trainer_step())
            timed_bare.append(bare_step())
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
            "steps": args.steps, "torch": torch.__version__, "threads": torch.get_num_threads(),
        }
        trainer.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
