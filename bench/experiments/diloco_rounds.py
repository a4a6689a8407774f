"""Finding 5: parallel DiLoCo rounds against sequential training at equal tokens and wall-clock.

At equal total tokens, per seed, on the "cpu" model and data of runs.py:
  - K=1: sequential training, the plain Trainer (AdamW, warmup then WSD decay over the last 20%);
  - K=2, K=4: DiLoCo rounds, H inner AdamW steps per worker per round, then the outer Nesterov
    step (lr 0.7, momentum 0.9 unless --outer-lr says otherwise). Each worker's schedule is the
    same shape over its N/K steps (the app's: a run of R rounds is a TrainConfig of R*H steps).
Then, for K=4 on the first seed: fp32 pseudo-gradients instead of int8 (bytes and loss), and a
worker that is one round late every round (its round r-1 work, trained on base r-1, arrives for
round r): (a) rejected, (b) folded with a discount, (c) folded as is.

What runs is the app's own code: `ColibriRounds.train` (resume from the base with the worker's
OWN AdamW state, the data slice (r*K + slot)*H*B of the run's order, int8 pseudo-gradient with
error feedback, router biases and token counts) and `ColibriRounds.merge` (per-expert mean over
the workers that routed to it, the biases' mean, torch.optim.SGD-exact Nesterov step). Only the
relay is left out: the K workers of a round run one after another in this process, which changes
nothing the learning question depends on (the protocol around it is tested by the round chaos
test). The wall-clock of K machines is SIMULATED: a round costs the slowest worker's measured
training time, plus the merge, plus moving the bytes (the worker pulls the whole base payload and
posts its contribution) at --bandwidth MB/s; K=1 costs its measured training time.

Every merged base (and the K=1 model every 4H steps) is scored by the same forward on fixed
validation windows in eval mode, at top-2 (as trained) and top-1 (as served): validation loss,
and MaxVio (max expert load / mean load - 1, worst layer) and dead experts (all layers) of that
forward's routing, next to the ledger's MaxVio from the workers' training token counts.

    python bench/experiments/diloco_rounds.py          # 42 min on 2 busy vCPUs
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import runs  # noqa: E402
import torch  # noqa: E402
from colibri_model import ColibriForCausalLM  # noqa: E402
from colibri_model.data.loader import IGNORE_INDEX, fixed_batches  # noqa: E402
from colibri_model.data.manifest import open_data_dir  # noqa: E402
from colibri_model.training import Trainer, read_training_state  # noqa: E402
from colibri_relay.round_loop import MergeInput  # noqa: E402
from colibri_relay.round_state import RoundsConfig  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from colibri import parallel_round  # noqa: E402
from colibri.parallel_round import ColibriRounds, ParallelOptions  # noqa: E402
from colibri.pseudograd import PSEUDOGRAD_FILE  # noqa: E402

EXPERIMENT = "diloco_rounds"
FINDING = "parallel DiLoCo rounds vs sequential training"
DECAY_FRACTION = 0.2
VAL_WINDOWS = 64  # the fixed validation windows every model is scored on, whatever the batch
VAL_BATCH = 8


# --- scoring ---------------------------------------------------------------------------------
def validation_set(data: Path, scale) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, val, _ = open_data_dir(data)
    return fixed_batches(val, scale.seq_len, VAL_BATCH, VAL_WINDOWS // VAL_BATCH)


@torch.no_grad()
def score(model: torch.nn.Module, batches) -> dict:
    """Validation loss, MaxVio and dead experts of one forward at top-2 and at top-1 (eval mode,
    expert bias included, routers not counting: the model is left as it was)."""
    was_training = model.training
    layers = model.moe_layers()
    n_experts = model.config.n_experts
    model.eval()
    for layer in layers:
        layer.router.count_tokens, layer.record_routing = False, True
    out = {}
    try:
        for k in (2, 1):
            model.set_top_k(k)
            loss_sum, tokens = 0.0, 0
            loads = None
            for x, y in batches:
                result = model(x, targets=y)
                n = int((y != IGNORE_INDEX).sum())
                loss_sum += float(result.lm_loss) * n
                tokens += n
                ids = [layer.last_expert_ids.reshape(-1) for layer in layers]
                batch_loads = torch.stack([torch.bincount(i, minlength=n_experts) for i in ids]).double()
                loads = batch_loads if loads is None else loads + batch_loads
            max_vio = float((loads.amax(dim=1) / loads.mean(dim=1) - 1.0).max())
            out[f"top{k}"] = {"val_loss": round(loss_sum / tokens, 5), "max_vio": round(max_vio, 4),
                              "dead_experts": int((loads == 0).sum())}
    finally:
        for layer in layers:
            layer.router.count_tokens, layer.record_routing, layer.last_expert_ids = True, False, None
        model.set_top_k(None)
        model.train(was_training)
    return out


def score_checkpoint(directory: Path, batches) -> dict:
    return score(ColibriForCausalLM.from_pretrained(directory), batches)


def point(step: int, tokens: int, sim_s: float, scores: dict, **extra) -> dict:
    return {"step": step, "tokens": tokens, "sim_wall_s": round(sim_s, 2), **scores, **extra}


def curves_of(points: list[dict]) -> dict:
    """The runs' curves (EXPERIMENT_JSON.md: equal-length series keyed by `step`)."""
    def col(key, sub=None):
        return [p[key][sub] if sub else p[key] for p in points]
    return {
        "val": {"step": col("step"), "tokens": col("tokens"), "sim_wall_s": col("sim_wall_s"),
                "val_loss": col("top2", "val_loss"), "val_loss_infer": col("top1", "val_loss")},
        "served_balance": {"step": col("step"), "max_vio_top1": col("top1", "max_vio"),
                           "dead_top1": col("top1", "dead_experts"), "max_vio_top2": col("top2", "max_vio"),
                           "dead_top2": col("top2", "dead_experts")},
    }


# --- K = 1: the trainer as it is ---------------------------------------------------------------
def sequential_run(work: Path, data: Path, scale, seed: int, steps: int, every: int, batches) -> dict:
    """Plain training, scored every EVERY steps; its clock is the training time without the scoring."""
    points: list[dict] = []
    clock = {"train_s": 0.0, "since": None}
    tokens_per_step = scale.batch_size * scale.seq_len

    def probe(step: int, model) -> None:
        now = time.monotonic()
        if clock["since"] is not None:
            clock["train_s"] += now - clock["since"]
        points.append(point(step, step * tokens_per_step, clock["train_s"], score(model, batches)))
        clock["since"] = time.monotonic()

    cfg = worker_train_config(scale, seed, steps)
    runs.train_run(work / "k1" / f"seed{seed}", data, runs.model_config(scale), cfg, probe=probe, probe_every=every)
    return {"name": "k1", "seed": seed, "workers": 1, "curves": curves_of(points), "points": points,
            "final": final_of(points)}


def worker_train_config(scale, seed: int, steps: int):
    # eval_every 0 / one batch: the trainer's own end-of-call evaluation is not what is measured
    # here (every model is scored by `score`), so it should cost the clocks as little as possible.
    return runs.train_config(scale, seed=seed, steps=steps, warmup_steps=max(1, steps // 20),
                             decay_fraction=DECAY_FRACTION, eval_every=0, eval_batches=1, eval_both_top_k=False)


def final_of(points: list[dict]) -> dict:
    last = points[-1]
    return {"val_loss": last["top2"]["val_loss"], "val_loss_infer": last["top1"]["val_loss"],
            "tokens": last["tokens"], "sim_wall_s": last["sim_wall_s"], "step": last["step"]}


# --- K workers: the app's rounds, in one process -----------------------------------------------
@contextlib.contextmanager
def uncompressed_pseudograds():
    """fp32 pseudo-gradients in place of the int8 codec, for the comparison arm only: the app's
    train/merge call `write_pseudograd`/`read_pseudograd` through parallel_round's names, which
    are swapped here and restored after. No rounding, so no error feedback."""
    def write(path: Path, deltas: dict, feedback) -> int:
        save_file({n: d.to(torch.float32).contiguous() for n, d in deltas.items()}, str(path))
        return path.stat().st_size

    def read(path: Path, expected: dict) -> dict:
        raw = load_file(str(path))
        return {name: raw[name] for name in expected}

    saved = parallel_round.write_pseudograd, parallel_round.read_pseudograd
    parallel_round.write_pseudograd, parallel_round.read_pseudograd = write, read
    try:
        yield
    finally:
        parallel_round.write_pseudograd, parallel_round.read_pseudograd = saved


def discount_contribution(directory: Path, weight: float) -> None:
    """Scale an int8 pseudo-gradient by WEIGHT in place: its per-block scales (exact for 1/2)."""
    path = directory / PSEUDOGRAD_FILE
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = {n: (t * weight if n.endswith(".scale") else t) for n, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata=metadata)


def make_base(root: Path, data: Path, scale, seed: int, steps: int, lr: float | None = None) -> Path:
    """Round 0's base: a fresh model's checkpoint at step 0, as `parallel_round.start_base` makes one
    (a TrainConfig of R*H steps), for this experiment's model rather than a preset. Its TrainConfig
    is every worker's, so `lr` (None: K=1's) is the workers' inner lr."""
    cfg = worker_train_config(scale, seed, steps)
    if lr is not None:
        cfg = cfg.model_copy(update={"lr": lr})
    trainer = Trainer.for_pretraining(root / "start-run", data, runs.model_config(scale), cfg)
    checkpoint = trainer.save_checkpoint()
    trainer.close()
    base = root / "base-0"
    shutil.copytree(checkpoint, base)
    shutil.rmtree(root / "start-run")
    return base


def dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


@dataclass(frozen=True)
class Arm:
    name: str
    workers: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    split_batch: bool = False  # each worker takes batch_size / K windows a step: K=1's steps, K=1's tokens
    codec: str = "int8"  # or "fp32"
    inner_lr: float | None = None  # the workers' AdamW lr; None: K=1's
    late: str | None = None  # one worker one round late: "reject", "discount", "as_is"
    discount: float = 0.5


def diloco_run(work: Path, data: Path, scale, seed: int, arm: Arm, h: int, rounds: int, bandwidth: float,
               batches) -> dict:
    k = arm.workers
    root = work / arm.name / f"seed{seed}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if arm.split_batch:
        if scale.batch_size % k:
            raise SystemExit(f"{arm.name}: batch size {scale.batch_size} does not split over {k} workers")
        scale = replace(scale, batch_size=scale.batch_size // k)
    bases = {0: make_base(root, data, scale, seed, rounds * h, lr=arm.inner_lr)}
    inner_lr = read_training_state(bases[0]).train_config["lr"]  # what every worker's AdamW runs at
    config = RoundsConfig(companion="in-process", workers=k, inner_steps=h, round_s=1.0, outer_lr=arm.outer_lr,
                          outer_momentum=arm.outer_momentum)
    apps = [ColibriRounds(ParallelOptions(relay="in-process", work_dir=root / f"w{slot}", data_dir=data, slot=slot,
                                          rounds=rounds, log=lambda _msg: None)) for slot in range(k)]
    late_slot = k - 1 if arm.late else None
    points = [point(0, 0, 0.0, score_checkpoint(bases[0], batches))]
    tokens, sim_s, rounds_log = 0, 0.0, []
    codec = uncompressed_pseudograds() if arm.codec == "fp32" else contextlib.nullcontext()
    with codec:
        for r in range(rounds):
            contributions, train_s, up = [], [], 0
            for slot in range(k):
                trained_on = r
                if slot == late_slot:
                    if arm.late == "reject" or r == 0:
                        # rejected: never merged, so its training changes nothing here and is skipped;
                        # round 0: its first contribution has not arrived yet
                        continue
                    trained_on = r - 1  # its round r-1 slice, on base r-1, arriving now
                out = root / f"contrib-{r}-{slot}"
                out.mkdir()
                view = SimpleNamespace(round=trained_on, rounds=config)
                summary = apps[slot].train(view, bases[trained_on], out)
                if slot == late_slot and arm.late == "discount":
                    discount_contribution(out, arm.discount)
                contributions.append((SimpleNamespace(slot=slot, summary=summary), out))
                train_s.append(summary["train_s"])
                up = max(up, dir_bytes(out))
            new = root / f"base-{r + 1}"
            new.mkdir()
            t0 = time.monotonic()
            result = apps[0].merge(MergeInput(r, config, bases[r], contributions, new))
            merge_s = time.monotonic() - t0
            if result.failed:
                raise RuntimeError(f"{arm.name} round {r}: the merge refused {result.failed}")
            comm_s = (dir_bytes(bases[r]) + up) / (bandwidth * 1e6)
            sim_s += max(train_s) + merge_s + comm_s
            tokens += sum(int(m.summary["tokens"]) for m, _ in contributions)
            bases[r + 1] = new
            points.append(point((r + 1) * h, tokens, sim_s, score_checkpoint(new, batches), round=r))
            rounds_log.append({"round": r, "train_s": [round(t, 2) for t in train_s], "merge_s": round(merge_s, 2),
                               "comm_s": round(comm_s, 3), "contribution_bytes": up,
                               "base_bytes": dir_bytes(bases[r]), "ledger_max_vio": result.stats.get("max_vio"),
                               "ledger_dead": result.stats.get("dead_experts")})
            for _, out in contributions:
                shutil.rmtree(out)
            if r - 1 in bases and r - 1 > 0:  # the late worker needs base r until round r+1
                shutil.rmtree(bases.pop(r - 1))
    return {"name": arm.name, "seed": seed, "workers": k, "outer_lr": arm.outer_lr,
            "outer_momentum": arm.outer_momentum, "inner_lr": inner_lr, "worker_batch": scale.batch_size,
            "codec": arm.codec,
            "late": arm.late, "curves": curves_of(points), "points": points, "rounds": rounds_log,
            "final": final_of(points)}


# --- summary and plot ----------------------------------------------------------------------------
def loss_at(run: dict, key: str, x: float) -> float | None:
    """Validation loss at X on the axis KEY (tokens or sim_wall_s), linear between the points."""
    pts = [(p[key], p["top2"]["val_loss"]) for p in run["points"]]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def summarize(results: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["name"], []).append(r)
    summary: dict = {}
    for name, group in by.items():
        finals = [g["final"]["val_loss"] for g in group]
        entry = {"val_loss": report.spread(finals), "tokens": group[0]["final"]["tokens"],
                 "sim_wall_s": report.spread([g["final"]["sim_wall_s"] for g in group]),
                 "served_top1_max_vio": [g["points"][-1]["top1"]["max_vio"] for g in group],
                 "served_top1_dead": [g["points"][-1]["top1"]["dead_experts"] for g in group]}
        if group[0].get("rounds"):
            entry["contribution_bytes"] = group[0]["rounds"][-1]["contribution_bytes"]
            entry["base_bytes"] = group[0]["rounds"][-1]["base_bytes"]
            entry["ledger_max_vio_last"] = [g["rounds"][-1]["ledger_max_vio"] for g in group]
        summary[name] = entry
    seq = {r["seed"]: r for r in by.get("k1", [])}
    for name, group in by.items():
        if name == "k1" or not seq:
            continue
        paired = [g for g in group if g["seed"] in seq]
        ratios = [g["final"]["val_loss"] / seq[g["seed"]]["final"]["val_loss"] - 1.0 for g in paired]
        # at equal wall-clock: the sequential run's loss when this run finished (its clock is longer)
        at_wall = [(g["final"]["val_loss"], loss_at(seq[g["seed"]], "sim_wall_s", g["final"]["sim_wall_s"]))
                   for g in paired]
        summary[name]["vs_k1_equal_tokens"] = {"relative": [round(x, 4) for x in ratios],
                                               "within_3pct": all(abs(x) <= 0.03 for x in ratios) if ratios else None}
        summary[name]["vs_k1_equal_wall"] = [
            {"this": a, "k1_at_same_wall": None if b is None else round(b, 5),
             "speedup_wall": round(seq[g["seed"]]["final"]["sim_wall_s"] / g["final"]["sim_wall_s"], 2)}
            for (a, b), g in zip(at_wall, paired)]
    return summary


def plot(results: list[dict], out: Path, title: str) -> Path:
    fig, axes = report.figure(1, 3, title)
    colors = {"k1": "tab:gray", "k2": "tab:blue", "k4": "tab:green", "k4_fp32": "tab:olive",
              "k4_late_reject": "tab:red", "k4_late_discount": "tab:orange", "k4_late_as_is": "tab:purple"}
    seen = set()
    for r in results:
        c = colors.get(r["name"], None)
        label = None if r["name"] in seen else r["name"]
        seen.add(r["name"])
        v = r["curves"]["val"]
        style = "-" if r["name"] in ("k1", "k2", "k4") else "--"
        axes[0][0].plot(v["tokens"], v["val_loss"], style, color=c, marker=".", label=label)
        if style == "-":
            axes[0][1].plot(v["sim_wall_s"], v["val_loss"], style, color=c, marker=".", label=label)
        b = r["curves"]["served_balance"]
        axes[0][2].plot(v["tokens"], b["max_vio_top1"], style, color=c, label=label)
    axes[0][0].set_title("validation loss (top-2) vs tokens", fontsize=8)
    axes[0][1].set_title("vs simulated wall-clock (K machines), s", fontsize=8)
    axes[0][2].set_title("served MaxVio (top-1, forward on val)", fontsize=8)
    tail = [y for r in results for y in r["curves"]["val"]["val_loss"][len(r["curves"]["val"]["val_loss"]) // 3:]]
    if tail:
        for ax in axes[0][:2]:
            ax.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
    return report.save_figure(fig, out, EXPERIMENT)


def main(argv: list[str] | None = None) -> dict:
    import argparse

    extra = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    extra.add_argument("--inner-steps", type=int, default=20)
    extra.add_argument("--outer-lr", type=float, default=0.7)
    extra.add_argument("--outer-momentum", type=float, default=0.9)
    extra.add_argument("--split-batch", action="store_true",
                       help="each of K workers takes batch/K windows a step (K=1's steps and tokens); "
                            "default: the full batch, N/K steps each")
    extra.add_argument("--inner-lr", type=float, default=None,
                       help="the workers' AdamW lr (default: K=1's); K=1 keeps its own")
    extra.add_argument("--batch-size", type=int, default=None,
                       help="K=1's sequences per step, the global batch (default: the scale's, 8); with "
                            "--split-batch each worker takes batch/K")
    extra.add_argument("--workers", default="2,4", help="the K > 1 arms to run besides K=1")
    extra.add_argument("--bandwidth", type=float, default=100.0, help="MB/s each way per machine")
    extra.add_argument("--ablations", default="fp32,late", help="K=4 extra arms on the first seed ('' for none)")
    known, rest = extra.parse_known_args(argv)
    if known.batch_size is not None and known.batch_size < 1:
        extra.error(f"--batch-size {known.batch_size}: need at least one sequence a step")
    args = runs.experiment_args(__doc__.splitlines()[0], rest)
    scale, h = args.scale, known.inner_steps
    if known.batch_size is not None:
        scale = replace(scale, batch_size=known.batch_size)
    steps = scale.steps
    if steps % (4 * h):
        raise SystemExit(f"--steps {steps} must be a multiple of 4 x --inner-steps ({4 * h})")
    started = time.time()
    data = runs.prepare_data(args.work)
    batches = validation_set(data, scale)
    work = args.work / EXPERIMENT
    results = []
    ablations = {a.strip() for a in known.ablations.split(",") if a.strip()}
    outer = dict(outer_lr=known.outer_lr, outer_momentum=known.outer_momentum, split_batch=known.split_batch,
                 inner_lr=known.inner_lr)
    worker_counts = [int(k) for k in known.workers.split(",") if k.strip()]

    def rounds_of(k: int) -> int:
        return steps // h if known.split_batch else steps // (k * h)
    for seed in args.seeds:
        results.append(sequential_run(work, data, scale, seed, steps, 4 * h, batches))
        print(f"k1 seed {seed}: {results[-1]['final']}", flush=True)
        for k in worker_counts:
            arm = Arm(f"k{k}", k, **outer)
            results.append(diloco_run(work, data, scale, seed, arm, h, rounds_of(k), known.bandwidth, batches))
            print(f"{arm.name} seed {seed}: {results[-1]['final']}", flush=True)
    first = args.seeds[0]
    arms = []
    if "fp32" in ablations:
        arms.append(Arm("k4_fp32", 4, **outer, codec="fp32"))
    if "late" in ablations:
        arms += [Arm(f"k4_late_{how}", 4, **outer, late=how) for how in ("reject", "discount", "as_is")]
    if "lr" in ablations:
        arms += [Arm(f"k4_outer_lr{lr:g}", 4, **{**outer, "outer_lr": lr}) for lr in (0.4, 1.0) if lr != known.outer_lr]
    for arm in arms:
        results.append(diloco_run(work, data, scale, first, arm, h, rounds_of(4), known.bandwidth, batches))
        print(f"{arm.name} seed {first}: {results[-1]['final']}", flush=True)
    settings = {"scale": vars(scale), "model": runs.model_config(scale).model_dump(), "seeds": args.seeds,
                "total_steps_equivalent": steps, "tokens_per_step": scale.batch_size * scale.seq_len,
                "inner_steps": h, "outer_lr": known.outer_lr, "outer_momentum": known.outer_momentum,
                "split_batch": known.split_batch, "inner_lr": known.inner_lr or "K=1's",
                "bandwidth_MB_s": known.bandwidth, "decay_fraction": DECAY_FRACTION,
                "val_windows": VAL_WINDOWS, "batch_size": scale.batch_size,
                "late_discount": 0.5, "workers_run": "one after another in one process (simulated clock)"}
    path = report.write_result(args.out, EXPERIMENT, FINDING, settings, results, summarize(results), started)
    plot(results, args.out, f"{FINDING} ({scale.name} scale, H={h})")
    print(path)
    return report.read_result(path)


if __name__ == "__main__":
    main()
