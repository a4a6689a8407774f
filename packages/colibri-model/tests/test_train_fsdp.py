"""FSDP2 done properly: sharded init, mixed precision, sharded eval, DCP checkpoints.

One torchrun launch (tests/fsdp_worker.py, 2 gloo ranks) serves every multi-process check; the
one-process runs it is compared with run in this process. What is checked:
  - a sharded init gathers to exactly the one-process init with the same seed (bit for bit);
  - the sharded validation loss equals the one-process one;
  - bf16 runs compute experts and attention in bf16, the router in fp32, with fp32 masters/grads;
  - DCP checkpoints: every rank writes only its rows; 2 ranks -> 1 and 1 -> 2 resume give the
    losses of an uninterrupted run; DCP <-> safetensors conversions resume bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from colibri_model import get_preset
from colibri_model.checkpoint import CheckpointFormatError
from colibri_model.cli import main
from colibri_model.training import (
    ResumeNotBitIdenticalWarning,
    TrainConfig,
    Trainer,
    dcp_to_safetensors,
    is_dcp_checkpoint,
    read_metrics,
    safetensors_to_dcp,
)
from colibri_model.training.distributed import DistributedContext
from colibri_model.training.validation import build_val_batches
from safetensors import safe_open
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("fsdp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from fsdp_worker import CFG, source  # noqa: E402  (the worker's config is the comparison's config)

ONE_PROCESS = TrainConfig(**{**CFG, "parallelism": "ddp"})  # a world of one: no wrapper at all


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run: Path) -> dict[int, float]:
    return {r.step: r.loss for r in read_metrics(run) if r.loss is not None}


def _close(a: dict, b: dict, steps) -> None:
    # fp32 reduction order differs across world sizes (gloo all-reduce vs one process); in this
    # run the losses agree exactly, but another CPU's kernels may round differently.
    assert sorted(a) == sorted(b) == list(steps), (a, b)
    for step in steps:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


def _same_files(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "optimizer.safetensors"):
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


def _resume(run: Path, checkpoint: Path) -> Trainer:
    trainer = Trainer(run, ONE_PROCESS, source(0), source(1), resume_from=checkpoint)
    trainer.train()
    return trainer


def test_fsdp_init_eval_mixed_precision_and_dcp_resume_across_world_sizes(tmp_path):
    torch.set_num_threads(1)  # as the worker's ranks (OMP_NUM_THREADS=1): the same kernels' bits
    single = Trainer(tmp_path / "single", ONE_PROCESS, source(0), source(1), get_preset("tiny"))
    init = {k: v.clone() for k, v in single.model.state_dict().items()}
    evals = {"serve": single.evaluate(), "train_top_k": single.evaluate(top_k=2)}
    single.train(until_step=2)  # saves single/checkpoints/step_00000002 (single file)
    step2 = tmp_path / "single/checkpoints/step_00000002"

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(WORKER),
                           str(tmp_path), str(step2)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    single.train()  # the uninterrupted one-process run, steps 3 and 4
    reference = _losses(tmp_path / "single")

    # sharded init: the gathered weights are the one-process init, bit for bit
    gathered = load_file(str(tmp_path / "init.safetensors"))
    assert gathered.keys() == init.keys()
    assert all(torch.equal(gathered[k], init[k]) for k in init)
    # sharded eval: each rank its half of the set, sums all-reduced
    sharded_evals = json.loads((tmp_path / "eval.json").read_text())
    for key, value in evals.items():
        assert abs(sharded_evals[key] - value) <= 1e-6 * value, (key, sharded_evals[key], value)
    assert evals["serve"] != evals["train_top_k"]  # two different numbers were compared
    _close(_losses(tmp_path / "fsdp"), reference, [1, 2, 3, 4])
    _close(_losses(tmp_path / "one_to_two"), {s: reference[s] for s in (3, 4)}, [3, 4])  # 1 -> 2 ranks

    mixed = json.loads((tmp_path / "mixed.json").read_text())
    assert mixed["compute"] == {"experts": "torch.bfloat16", "attention": "torch.bfloat16", "router": "torch.float32"}
    assert mixed["masters"] == mixed["grads"] == ["torch.float32"] and np.isfinite(mixed["loss"])
    assert mixed["router_unit"] == {"default": True, "compiled": False}  # see sharding.py's NOTE

    # the DCP layout: JSON + one safetensors file per rank and part, each with half the rows
    dcp2 = tmp_path / "fsdp/checkpoints/step_00000002"
    assert is_dcp_checkpoint(dcp2) and not (dcp2 / "model.safetensors").exists()
    assert json.loads((dcp2 / "dcp.json").read_text())["world_size"] == 2
    for part in ("model", "optimizer"):
        files = sorted((dcp2 / part).glob("*.safetensors"))
        assert [f.name for f in files] == ["shard-00001-model-00001-of-00001.safetensors",
                                           "shard-00002-model-00001-of-00001.safetensors"]
        key = "layers.1.moe.experts.gate_proj" + ("::exp_avg" if part == "optimizer" else "")
        rows = [safe_open(str(f), "pt").get_slice(key).get_shape()[0] for f in files]
        assert rows == [4, 4]  # 8 experts: no rank wrote the full tensor

    # 2 ranks -> 1: the losses of the uninterrupted run (the world size changed: a warning says so)
    with pytest.warns(ResumeNotBitIdenticalWarning, match="world_size: 2 -> 1"):
        two_to_one = _resume(tmp_path / "two_to_one", dcp2)
    _close(_losses(tmp_path / "two_to_one"), {s: reference[s] for s in (3, 4)}, [3, 4])

    # DCP -> safetensors: the converted checkpoint resumes bit for bit like the DCP one
    converted = dcp_to_safetensors(dcp2, tmp_path / "converted")
    assert sorted(p.name for p in converted.iterdir()) == [
        "config.json", "model.safetensors", "optimizer.safetensors", "training_state.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeNotBitIdenticalWarning)
        _resume(tmp_path / "from_converted", converted)
    assert _losses(tmp_path / "from_converted") == _losses(tmp_path / "two_to_one")
    _same_files(tmp_path / "from_converted/checkpoints/step_00000004",
                tmp_path / "two_to_one/checkpoints/step_00000004")
    two_to_one.close()

    # safetensors -> DCP: resumes bit for bit like the single file (= the uninterrupted run)
    as_dcp = safetensors_to_dcp(step2, tmp_path / "as_dcp")
    assert is_dcp_checkpoint(as_dcp) and len(list((as_dcp / "model").glob("*.safetensors"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeNotBitIdenticalWarning)  # same environment
        _resume(tmp_path / "from_dcp", as_dcp)
    assert _losses(tmp_path / "from_dcp") == {s: reference[s] for s in (3, 4)}
    _same_files(tmp_path / "from_dcp/checkpoints/step_00000004", tmp_path / "single/checkpoints/step_00000004")

    # a lost shard file is an error, never rows silently left unread
    broken, lying = tmp_path / "broken", tmp_path / "lying"
    for copy, lost in ((broken, 2), (lying, 1)):
        shutil.copytree(dcp2, copy)
        (copy / f"model/shard-0000{lost}-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match=r"model: 1 shard files, but dcp.json says 2 ranks wrote"):
        dcp_to_safetensors(broken, tmp_path / "nowhere")
    manifest = json.loads((lying / "dcp.json").read_text())
    (lying / "dcp.json").write_text(json.dumps({**manifest, "world_size": 1}))  # a manifest that lies too
    with pytest.raises(CheckpointFormatError, match=r"model: embed.weight is incomplete \(\d+ of \d+ elements "
                                                    r"stored; a shard file is missing\)"):
        Trainer(tmp_path / "from_lying", ONE_PROCESS, source(0), source(1), resume_from=lying)
    assert not (tmp_path / "nowhere").exists()
    single.close()


def test_dcp_conversion_refuses_bad_input_with_one_clear_error(tmp_path):
    cfg = TrainConfig(**{**CFG, "parallelism": "ddp", "steps": 1})
    checkpoint = Trainer(tmp_path / "run", cfg, source(0), source(1), get_preset("tiny")).train().checkpoint
    with pytest.raises(CheckpointFormatError, match=r"dcp.json: missing \(not a DCP checkpoint directory\)"):
        dcp_to_safetensors(checkpoint, tmp_path / "out")
    dcp = safetensors_to_dcp(checkpoint, tmp_path / "dcp")
    with pytest.raises(CheckpointFormatError, match="exists and is not an empty directory"):
        safetensors_to_dcp(checkpoint, tmp_path / "dcp")
    truncated = tmp_path / "truncated"
    shutil.copytree(dcp, truncated)
    shard = next((truncated / "model").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointFormatError, match=r"truncated/model: unreadable tensor files"):
        dcp_to_safetensors(truncated, tmp_path / "out")
    manifest = json.loads((dcp / "dcp.json").read_text())
    (dcp / "dcp.json").write_text(json.dumps({**manifest, "dcp_checkpoint_version": "2.0"}))
    with pytest.raises(CheckpointFormatError, match=r"dcp_checkpoint_version 2.0 is not supported "
                                                    r"\(this colibri-model reads 1.0\)"):
        dcp_to_safetensors(dcp, tmp_path / "out")
    (dcp / "dcp.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="dcp.json: not valid JSON"):
        Trainer(tmp_path / "other", cfg, source(0), source(1), resume_from=dcp)

    runner = CliRunner()
    ok = runner.invoke(main, ["convert-checkpoint", str(checkpoint), str(tmp_path / "cli_dcp")])
    assert ok.exit_code == 0, ok.output
    back = runner.invoke(main, ["convert-checkpoint", str(tmp_path / "cli_dcp"), str(tmp_path / "cli_back"),
                                "--weights-only"])
    assert back.exit_code == 0, back.output
    assert sorted(p.name for p in (tmp_path / "cli_back").iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(tmp_path / "cli_back/model.safetensors"))["embed.weight"],
                       load_file(str(checkpoint / "model.safetensors"))["embed.weight"])
    bad = runner.invoke(main, ["convert-checkpoint", str(tmp_path / "dcp"), str(tmp_path / "cli_bad")])
    assert bad.exit_code == 2 and "dcp.json: not valid JSON" in bad.output
    assert runner.invoke(main, ["convert-checkpoint", str(checkpoint), str(tmp_path / "x"),
                                "--weights-only"]).exit_code == 2


def test_validation_set_is_split_evenly_with_ignored_fillers():
    src = source(3, n=16 * 3 + 1)  # exactly 3 windows of 16 tokens
    ranks = [build_val_batches(src, 16, 2, 3, DistributedContext(rank=r, world_size=2)) for r in (0, 1)]
    assert [len(b) for b in ranks] == [1, 1]  # the same number of forwards on each rank
    assert [b[0][0].shape[0] for b in ranks] == [2, 2]
    targets = [int((b[0][1] != -100).sum()) for b in ranks]
    assert targets == [32, 16]  # rank 1 holds one real sequence and one filler with no target
