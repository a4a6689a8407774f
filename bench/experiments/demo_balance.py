"""Why the demo's dashboard showed unbalanced routing, measured on the demo's own training run.

`make demo` pretrains the tiny preset (8 experts x 3 MoE layers, top-2, bundled 49152-token
tokenizer) on the bundled prose for its relay legs with lr 3e-3, warmup 10, seq 128, batch 8:
the same as one uninterrupted run, since a leg resumes exactly. This script trains that run once
per setting and reports, over the last 10% of steps, MaxVio and dead experts per MoE layer, the
spread of the router's scores across experts (what the bias has to overcome) and the largest
|bias| reached (at most gamma x steps: sign updates move it by exactly gamma per step).

    python bench/experiments/demo_balance.py             # ~6 min on 2 vCPUs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from colibri_model import get_preset
from colibri_model.corpus import prose_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import runs  # noqa: E402

EXPERIMENT = "demo_balance"
FINDING = "The demo's 160 pretraining steps: why balancing did not keep up, and the setting that does"
# (label, gamma, lr): the demo's setting and a gamma sized to its 160 steps. A step of this model
# takes ~2.7 s on one thread (the 49152-token head), so each setting costs ~7 min here;
# `--more` adds balancing off and a 3x lower lr (what else could explain it).
SETTINGS = [("demo gamma 1e-3", 1e-3, 3e-3), ("gamma 1e-2", 1e-2, 3e-3)]
MORE_SETTINGS = [("gamma 0", 0.0, 3e-3), ("gamma 1e-3, lr 1e-3", 1e-3, 1e-3)]


def demo_data(work: Path) -> Path:
    data = work / "demo-data"
    if not (data / "manifest.json").is_file():
        runs._run_cli([runs.BIN / "colibri-model", "prepare", *prose_files(), "--out", data, "--no-progress",
                       "--val-fraction", "0.05"])
    return data


@torch.no_grad()
def score_spread(model, ids: torch.Tensor) -> list[float]:
    """Per MoE layer: the mean over tokens of (top-1 score - median score) across experts, the
    margin by which a router prefers its favourite, which the bias must overcome to move a token."""
    spreads = []

    def hook(module, inputs, output):
        scores = output[2]
        spreads.append(float((scores.max(-1).values - scores.median(-1).values).mean()))

    handles = [layer.router.register_forward_hook(hook) for layer in model.moe_layers()]
    was = model.training
    model.eval()
    for layer in model.moe_layers():
        layer.router.count_tokens = False
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
        for layer in model.moe_layers():
            layer.router.count_tokens = True
        model.train(was)
    return spreads


def one_run(args, data: Path, label: str, gamma: float, lr: float, steps: int, probe: torch.Tensor) -> dict:
    model_cfg = get_preset("tiny", bias_update_gamma=gamma) if args.scale.name != "smoke" else \
        get_preset("tiny", bias_update_gamma=gamma, n_layers=2, d_model=64, n_heads=2, head_dim=32)
    seq, batch = (128, 8) if args.scale.name != "smoke" else (32, 2)
    train_cfg = runs.train_config(args.scale, steps=steps, seq_len=seq, batch_size=batch, micro_batch=batch, lr=lr,
                                  warmup_steps=min(10, steps - 1), eval_every=0, eval_batches=1, seed=args.seeds[0])
    extra: dict = {}

    def at_end(step, model):
        if step == steps:
            extra["score_spread"] = score_spread(model, probe)
            extra["max_abs_bias"] = [float(layer.router.expert_bias.abs().max()) for layer in model.moe_layers()]

    began = time.time()
    # fresh=False: a finished run in WORK is reused (the trainer resumes at its last step)
    records, _ = runs.train_run(args.work / EXPERIMENT / label.replace(" ", "_").replace(",", ""), data,
                                model_cfg, train_cfg, probe=at_end, fresh=False)
    curve = runs.router_curve(records, every=max(1, steps // 80))
    tail = [r for r in records if r.router and r.step > 0.9 * steps]
    layers = [layer.layer for layer in tail[0].router]
    final = {"max_vio": [sum(r.router[i].max_vio for r in tail) / len(tail) for i in range(len(layers))],
             "dead_experts": [sum(r.router[i].dead_experts for r in tail) / len(tail) for i in range(len(layers))],
             "dead_total": sum(r.router[i].dead_experts for r in tail for i in range(len(layers))) / len(tail),
             "loss": sum(r.loss for r in tail) / len(tail), **extra, "seconds": round(time.time() - began, 1)}
    return {"name": label, "seed": args.seeds[0], "gamma": gamma, "lr": lr, "curves": {"router": curve},
            "final": final}


def plot(results: list[dict], out: Path, title: str) -> Path:
    fig, axes = report.figure(1, 2, title)
    for r in results:
        c = r["curves"]["router"]
        layers = sorted({k.split("_")[0] for k in c if k.startswith("layer")})
        mean_vio = [sum(c[f"{layer}_max_vio"][i] for layer in layers) / len(layers) for i in range(len(c["step"]))]
        dead = [sum(c[f"{layer}_dead"][i] for layer in layers) for i in range(len(c["step"]))]
        axes[0][0].plot(c["step"], mean_vio, label=r["name"])
        axes[0][1].plot(c["step"], dead, label=r["name"])
    axes[0][0].set_title("MaxVio (mean of the MoE layers, train batches)", fontsize=8)
    axes[0][1].set_title("dead experts, all MoE layers together", fontsize=8)
    return report.save_figure(fig, out, EXPERIMENT)


def main(argv: list[str] | None = None) -> dict:
    more = "--more" in (argv if argv is not None else sys.argv[1:])
    argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--more"]
    args = runs.experiment_args(__doc__.splitlines()[0], argv, default_seeds="0")
    started = time.time()
    data = demo_data(args.work)
    steps = args.scale.steps if args.scale.name == "smoke" or args.steps else 160
    probe = runs.probe_ids(data, 1024 if args.scale.name != "smoke" else 64).view(-1, 64 if args.scale.name == "smoke" else 128)
    chosen = SETTINGS + (MORE_SETTINGS if more else [])
    results = [one_run(args, data, label, gamma, lr, steps, probe) for label, gamma, lr in chosen]
    settings = {"preset": "tiny", "steps": steps, "seq_len": 128, "batch_size": 8, "warmup_steps": 10,
                "tokenizer": "bundled 49152", "settings": [list(s) for s in chosen]}
    summary = {r["name"]: {k: r["final"][k] for k in ("max_vio", "dead_total", "loss")} for r in results}
    path = report.write_result(args.out, EXPERIMENT, FINDING, settings, results, summary, started)
    plot(results, args.out, FINDING)
    print(path)
    return report.read_result(path)


if __name__ == "__main__":
    main()
