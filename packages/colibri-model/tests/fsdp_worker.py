"""The FSDP2 side of tests/test_train_fsdp.py, run under torchrun (2 gloo ranks, CPU).

One launch serves several checks (each torchrun start costs seconds on two cores):
  1. a fresh fp32 FSDP2 run: its initial weights gathered to rank 0 (init.safetensors), its
     sharded validation losses (eval.json), then 4 steps with DCP checkpoints at 2 and 4;
  2. a resume on 2 ranks of the 1-process checkpoint given as argv[2] (1 -> 2), to step 4;
  3. a bf16 run (MixedPrecisionPolicy): the dtypes the experts and the router compute with, and
     the dtypes of the sharded master weights and their gradients (mixed.json).
Usage: torchrun --nproc-per-node 2 fsdp_worker.py OUT SINGLE_STEP_2_CHECKPOINT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.training import TrainConfig, Trainer
from colibri_model.training.model_init import meta_model
from colibri_model.training.sharding import shard_model
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

CFG = dict(steps=4, seq_len=16, batch_size=4, micro_batch=2, lr=3e-3, warmup_steps=2, eval_every=0,
           eval_batches=1, save_every=2, progress=False, device="cpu", parallelism="fsdp")


def source(seed: int, n: int = 3000) -> TokenSource:
    rng = np.random.default_rng(seed)
    return TokenSource([rng.integers(100, 3000, size=n).astype(np.uint16)])


def fresh_run(out: Path) -> None:
    trainer = Trainer(out / "fsdp", TrainConfig(**CFG), source(0), source(1), get_preset("tiny"))
    assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    losses = {"serve": trainer.evaluate(), "train_top_k": trainer.evaluate(top_k=2)}
    if trainer.ctx.is_main:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "init.safetensors"))
        (out / "eval.json").write_text(json.dumps(losses))
    trainer.train()
    trainer.close()


def resume_single(out: Path, checkpoint: str) -> None:
    trainer = Trainer(out / "one_to_two", TrainConfig(**CFG), source(0), source(1), resume_from=checkpoint)
    assert trainer.step == 2
    trainer.train()
    trainer.close()


def mixed_precision(out: Path) -> None:
    cfg = TrainConfig(**{**CFG, "steps": 1, "save_every": 0, "precision": "bf16"})
    trainer = Trainer(out / "bf16", cfg, source(0), source(1), get_preset("tiny"))
    seen: dict[str, str] = {}  # the dtype of the (all-gathered) weights each module computes with

    def record_dtype(name: str, weight: str):
        def hook(module, args) -> None:
            seen.setdefault(name, str(module.get_parameter(weight).dtype))
        return hook

    moe = trainer.model.moe_layers()[0]
    moe.experts.register_forward_pre_hook(record_dtype("experts", "gate_proj"))
    moe.router.register_forward_pre_hook(record_dtype("router", "weight"))
    trainer.model.layers[0].attn.register_forward_pre_hook(record_dtype("attention", "q_proj.weight"))
    grads: set[str] = set()  # what AdamW receives: the reduce-scattered gradient shards
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.update(str(p.grad.dtype) for p in trainer.model.parameters()))
    record = trainer.train_step()
    masters = {str(p.dtype) for p in trainer.model.parameters()}  # the sharded parameters AdamW steps
    units = {"default": isinstance(moe.router, FSDPModule)}
    probe = meta_model(get_preset("tiny"))  # what a compiled run shards (no storage needed on meta)
    shard_model(probe, bf16=True, fp32_routers=False)
    units["compiled"] = isinstance(probe.moe_layers()[0].router, FSDPModule)
    if trainer.ctx.is_main:
        (out / "mixed.json").write_text(json.dumps({"compute": seen, "masters": sorted(masters), "router_unit": units,
                                                    "grads": sorted(grads), "loss": record.loss}))
    trainer.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # once: the trainers below share it (they never destroy it)
    out_dir = Path(sys.argv[1])
    fresh_run(out_dir)
    resume_single(out_dir, sys.argv[2])
    mixed_precision(out_dir)
    dist.destroy_process_group()
