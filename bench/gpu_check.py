"""The first GPU run of the trainer (issue 19), in one go: run by bench/gpu_check.sh.

NanoColibri (bf16, --compile, seq 2048) on random tokens, at the largest micro-batch the memory
planner says fits the GPU, for up to --steps optimizer steps or until --budget-s of wall time
since start. Prints, and writes as JSON to --json-out:

- tokens/s and MFU (median over the steady steps; the peak from the trainer's GPU table);
- the first step's time (compilation) and whether compile worked (else the run goes on eager);
- peak memory: torch.cuda.max_memory_allocated against the planner's peak, and the saved
  activation bytes of one eager forward (saved_tensors_hooks) against the planner's;
- host syncs per step (colibri_model/host_syncs.py: sync-debug warnings and the profiler's count);
- the loss: the mean of the first and the last ten steps (a third of the run if shorter), which
  must go down (by 0.5 nats on the GPU run).

"Random tokens" are learnable on purpose: a Zipf unigram over the vocabulary, in 256-token
documents whose second half repeats the first, so the loss falls fast (unigram, then copying)
and a broken step shows. An out-of-memory at the planner's micro-batch is itself a finding: it is
reported and the run goes on at half the micro-batch. `--cpu-smoke` runs the same code on the
tiny preset on CPU in seconds (repo_tests/test_bench_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.host_syncs import count_host_syncs
from colibri_model.training import TrainConfig, Trainer
from colibri_model.training.activations import MODEL_PATH
from colibri_model.training.memory_plan import largest_fitting_micro_batch, plan_memory
from colibri_model.training.metrics import flops_per_token
from colibri_model.training.saved_tensors import measure_saved_bytes

GIB = 1 << 30
MFU_GOAL = 0.30
START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", flush=True)


def learnable_tokens(vocab: int, n_tokens: int, seed: int = 0, half: int = 128) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(vocab) + 10.0)
    p /= p.sum()
    n_docs = n_tokens // (2 * half) + 1
    first = rng.choice(vocab, size=(n_docs, half), p=p).astype(np.uint16)
    return np.concatenate([first, first], axis=1).reshape(-1)[:n_tokens]


def build_trainer(run_dir, config, source, args, micro_batch: int, compile_model: bool) -> Trainer:
    cfg = TrainConfig(steps=10**6, seq_len=args.seq, batch_size=micro_batch, micro_batch=micro_batch,
                      lr=args.lr, warmup_steps=args.warmup, eval_batches=1, eval_every=0, save_every=0,
                      device=args.device, precision=args.precision, compile=compile_model,
                      peak_tflops=args.peak_tflops, progress=False)
    return Trainer(run_dir, cfg, source, source, config)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU, a few steps")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=None, help="stop stepping after this much wall time")
    parser.add_argument("--micro-batch", type=int, default=None, help="[default: the planner's largest fit]")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="compile in --cpu-smoke too (slow on CPU)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    smoke = args.cpu_smoke
    args.preset = args.preset or ("tiny" if smoke else "nano")
    args.seq = args.seq or (64 if smoke else 2048)
    args.steps = args.steps or (12 if smoke else 300)
    args.budget_s = args.budget_s or (120 if smoke else 330)
    args.device, args.precision = ("cpu", "fp32") if smoke else ("cuda", "bf16")
    if smoke:
        args.lr, args.warmup = 3e-3, 2
    compile_model = args.compile or not (args.no_compile or smoke)  # the smoke run is eager unless asked
    report: dict = {"preset": args.preset, "seq_len": args.seq, "precision": args.precision,
                    "torch": torch.__version__, "python": sys.version.split()[0],
                    "grouped_mm": hasattr(torch, "_grouped_mm"), "planner_compute_path": MODEL_PATH.name}

    if smoke:
        device_name, memory = "cpu", 2 * GIB  # a pretend budget, to exercise the planner's choice
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke on a machine without a GPU", file=sys.stderr)
            return 2
        props = torch.cuda.get_device_properties(0)
        device_name, memory = props.name, props.total_memory
        report.update(cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    report.update(device_name=device_name, device_memory=memory)
    log(f"torch {torch.__version__} on {device_name} ({memory / GIB:.1f} GiB); _grouped_mm: {report['grouped_mm']}")

    # the smoke run's vocabulary is small so that its steps take milliseconds
    config = get_preset(args.preset, **({"vocab_size": 2048} if smoke else {}))
    plan_options = dict(seq_len=args.seq, precision=args.precision, path=MODEL_PATH)
    if args.micro_batch:
        micro_batch = args.micro_batch
    else:
        candidates = (4, 2, 1) if smoke else (32, 16, 8, 4, 2, 1)
        choice = largest_fitting_micro_batch(config, memory, candidates=candidates, **plan_options)
        if choice is None:
            print(f"the planner says {args.preset} at seq {args.seq} does not fit {memory / GIB:.1f} GiB even "
                  f"at micro-batch 1", file=sys.stderr)
            return 1
        micro_batch = choice[0]
    log(f"micro-batch {micro_batch} (planner: largest that fits); compile: {compile_model}")
    n_tokens = (args.steps + 20) * 32 * args.seq + args.seq + 1
    source = TokenSource([learnable_tokens(config.vocab_size, n_tokens)])
    report["oom_at_micro_batch"] = []

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = first = None
        while first is None:
            failure = None
            try:
                trainer = build_trainer(run_dir, config, source, args, micro_batch, compile_model)
                t0 = time.perf_counter()
                first = trainer.train_step()
                first_step_s = time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError:
                failure = "oom"
            except Exception as exc:  # noqa: BLE001 - a compile failure must not cost the run
                if not compile_model:
                    raise
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                failure = f"{type(exc).__name__}: {' | '.join(lines[:4])}"[:600]  # dynamo's cause is on line 2-3
                traceback.print_exc(limit=4)
            if failure is None:
                break
            if trainer is not None:  # free the failed attempt (the exception and its frames are gone by now)
                trainer.close()
                trainer = None
            release_memory()
            if failure == "oom":
                log(f"OUT OF MEMORY at micro-batch {micro_batch} (the planner said it fits); halving")
                report["oom_at_micro_batch"].append(micro_batch)
                micro_batch //= 2
                if micro_batch == 0:
                    return 1
            else:
                log(f"COMPILE FAILED ({failure[:300]}); going on eager")
                report["compile_error"] = failure
                compile_model = False
        report.update(micro_batch=micro_batch, compile=compile_model, first_step_s=round(first_step_s, 2))
        log(f"first step {first_step_s:.1f}s (compilation included), loss {first.loss}")
        device = trainer.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        tokens_per_step = micro_batch * args.seq
        losses, times = [first.loss if first.loss is not None else float("nan")], []
        while len(losses) < args.steps and time.perf_counter() - START < args.budget_s:
            t0 = time.perf_counter()
            record = trainer.train_step()  # its .item() calls sync: the wall time is the step's
            times.append(time.perf_counter() - t0)
            losses.append(record.loss if record.loss is not None else float("nan"))
            if len(losses) % 25 == 0 or smoke:
                window = times[-25:]
                log(f"step {len(losses):4d} loss {losses[-1]:.3f} {tokens_per_step / statistics.median(window):,.0f} tok/s")

        times = times or [first_step_s]  # the budget ran out during the first step (compilation)
        steady = times[min(5, len(times) // 2):] or times
        tokens_per_s = tokens_per_step / statistics.median(steady)
        fpt = flops_per_token(config, args.seq)
        peak = trainer.peak_flops
        mfu = tokens_per_s * fpt / peak if peak else None
        report.update(steps=len(losses), tokens_per_s=round(tokens_per_s, 1), flops_per_token=fpt,
                      peak_tflops=peak / 1e12 if peak else None, mfu=round(mfu, 4) if mfu is not None else None,
                      step_s_median=round(statistics.median(steady), 4))

        plan = plan_memory(config, micro_batch=micro_batch, **plan_options)
        memory_report = {"planned_peak_allocated": plan.peak_allocated, "planned_peak_device": plan.peak_device,
                         "planned_activations": plan.activations}
        if device.type == "cuda":
            measured = torch.cuda.max_memory_allocated(device)
            memory_report.update(max_memory_allocated=measured, max_memory_reserved=torch.cuda.max_memory_reserved(device),
                                 planned_over_measured=round(plan.peak_allocated / measured, 3))
        report["memory"] = memory_report

        try:
            syncs = count_host_syncs(trainer.train_step, device, steps=2)
            report["host_syncs_per_step"] = syncs if syncs is not None else "not countable (CPU)"
        except Exception as exc:  # noqa: BLE001 - the figures above must still be printed
            report["host_syncs_per_step"] = f"counting failed: {type(exc).__name__}: {exc}"[:300]

        # What one EAGER forward saves for backward, against the planner: compiled code (whole
        # model or per block) is forced eager, since the planner models the eager model.
        try:
            x, y = trainer.loader.next_batch(micro_batch)
            trainer.optimizer.zero_grad(set_to_none=True)
            with torch.compiler.set_stance("force_eager"):
                saved = measure_saved_bytes(trainer.model, x.to(device), y.to(device),
                                            torch.bfloat16 if trainer.autocast else None)
            memory_report.update(measured_activations=saved.activations_total,
                                 measured_compute_copies=saved.compute_copies,
                                 planned_compute_copies=plan.compute_copies,
                                 activations_planned_over_measured=round(
                                     memory_report["planned_activations"] / saved.activations_total, 3),
                                 measured_activations_by_kind=saved.activations)
            del saved
        except Exception as exc:  # noqa: BLE001 - out of memory, or hooks a compiled block refuses
            memory_report["measured_activations"] = f"not measured: {type(exc).__name__}: {exc}"[:300]

        window = max(1, min(10, len(losses) // 3))
        first_mean = statistics.fmean(losses[:window])
        last_mean = statistics.fmean(losses[-window:])
        went_down = math.isfinite(last_mean) and last_mean < first_mean - (0.05 if smoke else 0.5)
        report.update(loss_window=window, loss_first=round(first_mean, 4), loss_last=round(last_mean, 4),
                      loss_went_down=went_down,
                      wall_s=round(time.perf_counter() - START, 1))
        trainer.close()

    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text)
    summary(report)
    return 0 if went_down else 1


def summary(r: dict) -> None:
    mem = r["memory"]
    mfu = (f"{r['mfu']:.1%}" if r["mfu"] is not None else
           "not reported (CPU)" if r["device_name"] == "cpu" else "not reported (unknown GPU: pass --peak-tflops)")
    print("\n== gpu_check summary ==")
    print(f"device        {r['device_name']}  torch {r['torch']}  compile {r['compile']}"
          + (f"  (compile failed: {r['compile_error'][:120]})" if "compile_error" in r else ""))
    print(f"run           {r['preset']} seq {r['seq_len']} micro-batch {r['micro_batch']} {r['precision']}, "
          f"{r['steps']} steps, first step {r['first_step_s']}s" +
          (f"; OOM at micro-batch {r['oom_at_micro_batch']}" if r["oom_at_micro_batch"] else ""))
    print(f"throughput    {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}"
          + (f" (goal {MFU_GOAL:.0%}: {'met' if r['mfu'] >= MFU_GOAL else 'NOT met'})" if r["mfu"] is not None else ""))
    if "max_memory_allocated" in mem:
        print(f"peak memory   {mem['max_memory_allocated'] / GIB:.2f} GiB allocated "
              f"({mem['max_memory_reserved'] / GIB:.2f} reserved); planner {mem['planned_peak_allocated'] / GIB:.2f} "
              f"(x{mem['planned_over_measured']}), with margin {mem['planned_peak_device'] / GIB:.2f}")
    else:
        print(f"peak memory   planner {mem['planned_peak_allocated'] / GIB:.3f} GiB (no allocator peak on CPU)")
    if isinstance(mem.get("measured_activations"), int):
        print(f"activations   saved {mem['measured_activations'] / GIB:.3f} GiB; planner "
              f"{mem['planned_activations'] / GIB:.3f} (x{mem['activations_planned_over_measured']})")
    syncs = r["host_syncs_per_step"]
    print("host syncs    " + (syncs if isinstance(syncs, str) else
                              f"{syncs['sync_debug_warnings']:.0f} flagged by sync-debug, "
                              f"{syncs['cuda_sync_calls']:.0f} synchronizing CUDA calls per step"))
    print(f"loss          {r['loss_first']:.3f} (first {r['loss_window']} steps) -> {r['loss_last']:.3f} "
          f"(last {r['loss_window']}): "
          f"{'down' if r['loss_went_down'] else 'NOT down'}; wall {r['wall_s']}s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
