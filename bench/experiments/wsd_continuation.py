"""Finding 3: WSD beats a spent cosine when training continues.

At equal tokens, per seed (N steps, decays over the last 20% of a target):
  - cosine to N (warmup, half a cosine down to 0.1 x peak at N);
  - WSD to N: a stable trunk, its checkpoint at 0.8 N resumed with `decay_start` = 0.8 N, decayed
    (1-sqrt) to N;
then N/2 more steps for each:
  - the cosine run continued the way a user would: a new cosine run of N/2 steps initialised
    from the cosine checkpoint at N (`init_from`: fresh AdamW, re-warmed over the same warmup,
    back to peak, down to the floor again);
  - WSD resumed from the trunk's stable checkpoint at 1.2 N (weights, AdamW moments, loader) and
    decayed from 1.2 N to 1.5 N; the trunk is the same run that gave the 0.8 N checkpoint.
Every run goes through the Trainer (`resume_from` / `init_from` are its own options).

    python bench/experiments/wsd_continuation.py         # ~15 min on 2 vCPUs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import runs  # noqa: E402

EXPERIMENT = "wsd_continuation"
FINDING = "WSD beats a spent cosine for continuation"


def checkpoint_at(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: the trunk has no checkpoint at step {step}")
    return path


def series(records, offset: int = 0) -> dict:
    val = runs.val_curve(records)
    lr = [(r.step + offset, r.lr) for r in records if r.loss is not None]
    return {"val": {"step": [s + offset for s in val["step"]], "val_loss": val["val_loss"]},
            "lr": {"step": [s for s, _ in lr], "lr": [v for _, v in lr]}}


def seed_runs(args, data: Path, seed: int) -> list[dict]:
    scale = args.scale
    n = scale.steps
    decay_n, decay_long, long = round(0.8 * n), round(1.2 * n), n + n // 2
    model_cfg = runs.model_config(scale)
    base = args.work / EXPERIMENT / f"seed{seed}"
    warmup = max(2, n // 20)
    out = []

    def record(name, records, began, offset=0, **extra):
        curves = series(records, offset)
        final = {"val_loss": curves["val"]["val_loss"][-1], "step": curves["val"]["step"][-1],
                 "seconds": round(time.time() - began, 1)}
        out.append({"name": name, "seed": seed, "curves": curves, "final": final, **extra})

    began = time.time()
    cos_records, cos_ckpt = runs.train_run(base / "cosine", data, model_cfg, runs.train_config(
        scale, seed=seed, steps=n, schedule="cosine", warmup_steps=warmup))
    record("cosine_N", cos_records, began)

    began = time.time()
    cont_records, _ = runs.train_run(base / "cosine-continued", data, None, runs.train_config(
        scale, seed=seed, steps=n // 2, schedule="cosine", warmup_steps=warmup), init_from=cos_ckpt)
    # the continuation counts its steps from 0; on the common axis it starts at N
    record("cosine_continued_1.5N", [r for r in cont_records if r.step > 0], began, offset=n)

    began = time.time()
    trunk_dir = base / "wsd-trunk"
    trunk_records, _ = runs.train_run(trunk_dir, data, model_cfg, runs.train_config(
        scale, seed=seed, steps=decay_long, warmup_steps=warmup, save_every=decay_n))
    record("wsd_stable_trunk", trunk_records, began)

    began = time.time()
    short_records, _ = runs.train_run(base / "wsd-decay-N", data, model_cfg, runs.train_config(
        scale, seed=seed, steps=n, warmup_steps=warmup, decay_start=decay_n),
        resume_from=checkpoint_at(trunk_dir, decay_n))
    record("wsd_N", short_records, began, decay_from=decay_n)

    began = time.time()
    long_records, _ = runs.train_run(base / "wsd-decay-1.5N", data, model_cfg, runs.train_config(
        scale, seed=seed, steps=long, warmup_steps=warmup, decay_start=decay_long),
        resume_from=checkpoint_at(trunk_dir, decay_long))
    record("wsd_resumed_1.5N", long_records, began, decay_from=decay_long)
    return out


def summarize(results: list[dict]) -> dict:
    by = {}
    for r in results:
        by.setdefault(r["name"], []).append(r["final"]["val_loss"])
    summary = {name: report.spread(values) for name, values in by.items()}
    for a, b in (("cosine_N", "wsd_N"), ("cosine_continued_1.5N", "wsd_resumed_1.5N")):
        diffs = [x - y for x, y in zip(by[a], by[b])]  # seeds in the same order
        summary[f"{a}_minus_{b}"] = {**report.spread(diffs), "exceeds_seed_spread": report.exceeds_spread(by[a], by[b]),
                                     "same_sign_every_seed": report.same_sign_every_seed(diffs)}
    return summary


def plot(results: list[dict], out: Path, title: str, n: int) -> Path:
    fig, axes = report.figure(1, 3, title)
    colors = {"cosine_N": "tab:red", "cosine_continued_1.5N": "tab:orange", "wsd_stable_trunk": "tab:gray",
              "wsd_N": "tab:blue", "wsd_resumed_1.5N": "tab:green"}
    first_seed = results[0]["seed"]
    for r in results:
        c = colors[r["name"]]
        label = r["name"] if r["seed"] == first_seed else None
        axes[0][0].plot(r["curves"]["lr"]["step"], r["curves"]["lr"]["lr"], color=c, label=label)
        for ax in axes[0][1:]:
            ax.plot(r["curves"]["val"]["step"], r["curves"]["val"]["val_loss"], color=c, marker=".", label=label)
    axes[0][0].set_title(f"learning rate (first seed); N = {n}", fontsize=8)
    axes[0][1].set_title("validation loss", fontsize=8)
    axes[0][2].set_title("validation loss, from 0.7 N on", fontsize=8)
    tail = [v for r in results for s, v in zip(r["curves"]["val"]["step"], r["curves"]["val"]["val_loss"])
            if s >= 0.7 * n]
    if tail:
        axes[0][2].set_xlim(0.7 * n, 1.55 * n)
        axes[0][2].set_ylim(min(tail) - 0.02, max(tail) + 0.02)
    return report.save_figure(fig, out, EXPERIMENT)


def main(argv: list[str] | None = None) -> dict:
    args = runs.experiment_args(__doc__.splitlines()[0], argv)
    started = time.time()
    data = runs.prepare_data(args.work)
    results = [r for seed in args.seeds for r in seed_runs(args, data, seed)]
    settings = {"scale": vars(args.scale), "model": runs.model_config(args.scale).model_dump(), "seeds": args.seeds,
                "N": args.scale.steps, "min_lr_ratio": 0.1, "decay": "last 20% of the target, 1-sqrt",
                "cosine_continuation": "init_from the N checkpoint: fresh AdamW, same warmup, cosine over N/2",
                "wsd_continuation": "resume_from the stable trunk at 1.2 N, decay 1.2 N -> 1.5 N"}
    path = report.write_result(args.out, EXPERIMENT, FINDING, settings, results, summarize(results), started)
    plot(results, args.out, f"{FINDING} ({args.scale.name} scale)", args.scale.steps)
    print(path)
    return report.read_result(path)


if __name__ == "__main__":
    main()
