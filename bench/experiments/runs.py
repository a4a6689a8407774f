"""What the four experiments share: the CPU-scale data, model shapes, training runs and probes.

- `prepare_data(work)`: a 2048-token byte-level BPE trained on the bundled prose corpus
  (`colibri-model train-tokenizer`) and token shards made with it (`colibri-model prepare`), both
  cached under WORK. With the bundled 49152-token vocabulary the LM head would dominate a step.
- `model_config(scale, **changes)`: the experiments' model. "cpu" is d=128, 4 layers (1 dense +
  3 MoE), 16 experts of width 64 + a shared expert of 128, top-2 train / top-1 serve: about
  0.15-0.3 s per 8x128-token step on one thread of a 2-vCPU EPYC with other jobs running. "smoke" is smaller still,
  for the tests. (The issue's d=256 / 8 layers is 7x slower per step here: it would leave
  fewer than 200 steps per run inside the time box.)
- `train_run(...)`: one run through the normal `Trainer` (metrics.jsonl, checkpoints, the
  balancer as an optimizer pre-hook); an optional callback sees the model every `probe_every`
  steps (the trainer is driven in chunks with `train(until_step=...)`, nothing special-cased).
- `probe_routing(model, ids)`: each MoE layer's top-1 expert per probe token, as served (eval
  mode, expert bias included, routers not counting).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from colibri_model import ColibriConfig
from colibri_model.corpus import prose_files
from colibri_model.data.manifest import open_data_dir
from colibri_model.training import TrainConfig, Trainer
from colibri_model.training.checkpointing import latest_checkpoint
from colibri_model.training.metrics import MetricsRecord, read_metrics

VOCAB_SIZE = 2048
BIN = Path(sys.executable).parent
# NOTE: one intra-op thread. On the shared 2-vCPU box two threads that wait on each other at
# every parallel region ran a step 4-10x SLOWER than one thread as soon as other jobs held a
# core (2.6 s vs 0.25-0.6 s per step, measured under load 5-7). Results do not depend on it.
torch.set_num_threads(1)


@dataclass(frozen=True)
class Scale:
    """Model and batch shape of an experiment, and its default step count."""

    name: str
    d_model: int
    n_layers: int
    n_experts: int
    expert_dim: int
    shared_expert_dim: int
    seq_len: int
    batch_size: int
    steps: int
    eval_every: int
    eval_batches: int


SCALES = {
    "cpu": Scale("cpu", d_model=128, n_layers=4, n_experts=16, expert_dim=64, shared_expert_dim=128,
                 seq_len=128, batch_size=8, steps=800, eval_every=100, eval_batches=8),
    # seconds per run: the tests' smoke version of every experiment
    "smoke": Scale("smoke", d_model=32, n_layers=2, n_experts=4, expert_dim=16, shared_expert_dim=16,
                   seq_len=32, batch_size=4, steps=6, eval_every=3, eval_batches=1),
}


def _run_cli(args: list) -> None:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, args))}` failed ({result.returncode}): {result.stderr.strip()}")


def prepare_data(work: Path) -> Path:
    """WORK/data: shards of the bundled prose under a 2048-token BPE trained on it (cached)."""
    data = work / "data"
    if (data / "manifest.json").is_file():
        return data
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = work / "tokenizer" / "tokenizer.json"
    _run_cli([BIN / "colibri-model", "train-tokenizer", "--vocab-size", VOCAB_SIZE, "--out", tokenizer])
    _run_cli([BIN / "colibri-model", "prepare", *prose_files(), "--tokenizer", tokenizer, "--out", data,
              "--val-fraction", "0.05", "--no-progress"])
    return data


def model_config(scale: Scale, **changes) -> ColibriConfig:
    """The experiments' MoE (tied embeddings, head_dim 32, 2 KV heads), with field changes."""
    fields = dict(
        name=f"exp-{scale.name}", vocab_size=VOCAB_SIZE, d_model=scale.d_model, n_layers=scale.n_layers,
        n_dense_layers=1, n_heads=max(1, scale.d_model // 32), n_kv_heads=max(1, scale.d_model // 64),
        head_dim=min(32, scale.d_model), n_experts=scale.n_experts, expert_dim=scale.expert_dim,
        shared_expert_dim=scale.shared_expert_dim,
        # the preset convention: the dense FFN is as wide as the MoE layer's active part at top-2
        dense_ffn_dim=scale.shared_expert_dim + 2 * scale.expert_dim,
        max_seq_len=max(256, scale.seq_len), tie_embeddings=True,
    )
    fields.update(changes)
    return ColibriConfig(**fields)


def train_config(scale: Scale, **changes) -> TrainConfig:
    fields = dict(steps=scale.steps, seq_len=scale.seq_len, batch_size=scale.batch_size,
                  micro_batch=scale.batch_size, lr=3e-3, warmup_steps=max(1, scale.steps // 20),
                  eval_every=scale.eval_every, eval_batches=scale.eval_batches, save_every=0,
                  keep_checkpoints=20, progress=False)
    fields.update(changes)
    return TrainConfig(**fields)


def train_run(run_dir: Path, data: Path, model_cfg: ColibriConfig | None, train_cfg: TrainConfig, *,
              probe: Callable[[int, torch.nn.Module], None] | None = None, probe_every: int = 0,
              resume_from: Path | None = None, init_from: Path | None = None,
              fresh: bool = True) -> tuple[list[MetricsRecord], Path]:
    """Train one run from scratch (or from a checkpoint); returns (metrics, final checkpoint).

    fresh=False reuses RUN_DIR when it holds a checkpoint (the trainer resumes from it: a finished
    run trains no further); a directory without one is started afresh either way."""
    if run_dir.exists() and (fresh or latest_checkpoint(run_dir) is None):
        shutil.rmtree(run_dir)
    kwargs = {}
    if resume_from is not None:
        kwargs["resume_from"] = resume_from
    if init_from is not None:
        kwargs["init_from"] = init_from
    trainer = Trainer.for_pretraining(run_dir, data, model_cfg, train_cfg, **kwargs)
    try:
        if probe is not None:
            probe(trainer.step, trainer.model)
        stops = list(range(trainer.step + probe_every, train_cfg.steps, probe_every)) if probe_every else []
        for stop in [*stops, train_cfg.steps]:
            result = trainer.train(until_step=stop)
            if probe is not None:
                probe(trainer.step, trainer.model)
    finally:
        trainer.close()
    return read_metrics(run_dir), result.checkpoint


def probe_ids(data: Path, n_tokens: int) -> torch.Tensor:
    """The first N_TOKENS of the validation shard as one [1, N] batch (held-out text)."""
    _, val, _ = open_data_dir(data)
    tokens = torch.from_numpy(val.tokens[0][:n_tokens].astype("int64"))
    return tokens.view(1, -1)


@torch.no_grad()
def probe_routing(model: torch.nn.Module, ids: torch.Tensor, top_k: int = 1, chunk: int = 128) -> torch.Tensor:
    """[n_moe_layers, N] top-1 expert of every probe token, as served (eval mode, with the bias).

    The probe runs in windows of CHUNK tokens (each from position 0, as validation does)."""
    was_training = model.training
    model.eval()
    model.set_top_k(top_k)
    layers = model.moe_layers()
    for layer in layers:
        layer.router.count_tokens = False
        layer.record_routing = True
    try:
        n = ids.shape[1] - ids.shape[1] % chunk
        windows = ids[:, :n].reshape(-1, chunk)
        model(windows)
        return torch.stack([layer.last_expert_ids[..., 0].reshape(-1) for layer in layers])
    finally:
        for layer in layers:
            layer.router.count_tokens = True
            layer.record_routing = False
            layer.last_expert_ids = None
        model.set_top_k(None)
        model.train(was_training)


def load_entropy(expert_ids: torch.Tensor, n_experts: int) -> float:
    """Entropy of the expert load over the tokens, divided by log(E) (1 = uniform)."""
    share = torch.bincount(expert_ids.flatten(), minlength=n_experts).double()
    share = share / share.sum()
    nonzero = share[share > 0]
    return float(-(nonzero * nonzero.log()).sum() / torch.log(torch.tensor(float(n_experts))))


def val_curve(records: list[MetricsRecord]) -> dict[str, list]:
    """steps and validation losses (at top_k_train and at the serving top_k) from metrics.jsonl."""
    rows = [r for r in records if r.val_loss is not None]
    return {"step": [r.step for r in rows], "val_loss": [r.val_loss for r in rows],
            "val_loss_infer": [r.val_loss_infer for r in rows]}


def router_curve(records: list[MetricsRecord], every: int = 10) -> dict[str, list]:
    """Per MoE layer MaxVio, dead experts and load entropy of the training batches, every EVERY steps."""
    rows = [r for r in records if r.router and r.step % every == 0]
    if not rows:
        return {"step": []}
    curve: dict[str, list] = {"step": [r.step for r in rows]}
    for i, layer in enumerate(rows[0].router):
        curve[f"layer{layer.layer}_max_vio"] = [r.router[i].max_vio for r in rows]
        curve[f"layer{layer.layer}_dead"] = [r.router[i].dead_experts for r in rows]
        curve[f"layer{layer.layer}_entropy"] = [r.router[i].load_entropy for r in rows]
    return curve


def experiment_args(description: str, argv: list[str] | None, default_seeds: str = "0,1"):
    """The command line every experiment script shares."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="where NAME.json and NAME.png go [default: bench/experiments/results]")
    parser.add_argument("--work", type=Path, default=Path("build/experiments"),
                        help="data, tokenizer and run directories [default: build/experiments]")
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--seeds", default=default_seeds, help="comma-separated seeds [default: %(default)s]")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run [default: the scale's]")
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: not a comma-separated list of integers")
    if not args.seeds:
        parser.error("--seeds: give at least one seed")
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps {args.steps}: need at least 2")
    scale = SCALES[args.scale]
    if args.steps is not None:
        from dataclasses import replace

        scale = replace(scale, steps=args.steps, eval_every=max(1, min(scale.eval_every, args.steps // 4)))
    args.scale = scale
    return args
