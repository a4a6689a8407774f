"""Exact resume: N steps straight == N/2 steps, save, resume, N/2 more (bit-identical).

What is guaranteed (TRAINING.md, "Exact resume"): on CPU, given the same torch build, CPU
capability, intra-op thread count and world size, which training_state.json records; a resume
under other ones warns. System load does not matter: these tests must pass under load.
Why tensors are loaded as copies: loaded tensors used to be views of the safetensors mmap, aligned to whatever the file's
header length gave; MKL's one-row sgemm (an expert that got one token) is alignment-dependent,
so a resume drifted by 1 ulp only for some header lengths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.checkpoint import load_checkpoint
from colibri_model.corpus import prose_files
from colibri_model.data import TokenSource, prepare
from colibri_model.training import ResumeNotBitIdenticalWarning, TrainConfig, Trainer, read_metrics
from colibri_model.training.optimizer_io import read_optimizer_file
from safetensors.torch import load_file, save_file

ARGS = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2", "--lr", "3e-3",
        "--warmup", "2", "--eval-every", "0", "--eval-batches", "1", "--save-every", "0", "--no-progress"]


def _train(data, run, steps):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "colibri_model.cli", "train", "--data", str(data), "--out", str(run),
           "--steps", str(steps), *ARGS]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _losses(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["loss"] is not None}


def _assert_same_files(a, b, names=("model.safetensors", "optimizer.safetensors")):
    for name in names:
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{name}:{key} differs after resume"


def test_resume_in_new_process_is_bit_identical(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(prose_files()[-1].read_text()[:60_000])
    data = tmp_path / "data"
    prepare([str(text)], data, shard_tokens=4000, val_fraction=0.05, text_doc_chars=1000, progress=False)

    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(data, straight, 6)
    _train(data, split, 3)
    resumed = _train(data, split, 6)  # a new process: resumes from split/checkpoints/step_00000003
    assert "ResumeNotBitIdenticalWarning" not in resumed.stderr  # same environment: no warning

    a, b = _losses(straight), _losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b  # exact float equality, step by step
    _assert_same_files(straight / "checkpoints/step_00000006", split / "checkpoints/step_00000006")
    state = json.loads((split / "checkpoints/step_00000006/training_state.json").read_text())
    first = json.loads((straight / "checkpoints/step_00000006/training_state.json").read_text())
    assert state["loader"] == first["loader"] and state["tokens_seen"] == first["tokens_seen"] == 6 * 4 * 32
    assert state["parent_checkpoint_id"] is not None  # the leg names the checkpoint it resumed
    assert state["environment"] == first["environment"]
    assert state["environment"]["intra_op_threads"] == 1 and state["environment"]["device"] == "cpu"


def _source(seed, n=3000):
    rng = np.random.default_rng(seed)
    return TokenSource([rng.integers(100, 3000, size=n).astype(np.uint16)])


CFG = dict(steps=6, seq_len=16, batch_size=4, micro_batch=2, lr=3e-3, warmup_steps=2, eval_every=0,
           eval_batches=1, save_every=0, progress=False)


@pytest.mark.parametrize("threads", [1, 2])
def test_resume_is_bit_identical_at_each_thread_count(tmp_path, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = TrainConfig(**CFG)
        straight = Trainer(tmp_path / "a", cfg, _source(0), _source(1), get_preset("tiny"))
        straight.train(until_step=3)  # saves a/checkpoints/step_00000003, then goes on unchanged
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResumeNotBitIdenticalWarning)
            resumed = Trainer(tmp_path / "b", cfg, _source(0), _source(1),
                              resume_from=tmp_path / "a/checkpoints/step_00000003")
        straight.train()
        resumed.train()
    finally:
        torch.set_num_threads(before)
    a = {r.step: r.loss for r in read_metrics(tmp_path / "a") if r.step > 3}
    b = {r.step: r.loss for r in read_metrics(tmp_path / "b")}
    assert sorted(a) == sorted(b) == [4, 5, 6] and a == b
    _assert_same_files(tmp_path / "a/checkpoints/step_00000006", tmp_path / "b/checkpoints/step_00000006")


def test_loaded_weights_compute_the_bits_of_the_saved_model(tmp_path):
    """Whatever the header length (so the offset of the tensors in the file), a loaded model and
    its optimizer state live in 64-byte aligned memory and give the same bits as the saved model,
    forward and backward, with experts that get a single token (a one-row matmul)."""
    torch.manual_seed(0)
    model = ColibriForCausalLM(get_preset("tiny"))
    model.save_pretrained(tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt/model.safetensors"))
    ids = torch.randint(0, model.config.vocab_size, (1, 5))  # 5 tokens x top-2 over 8 experts

    def run(m):
        m.zero_grad(set_to_none=True)
        m(ids, targets=ids).lm_loss.backward()  # the training path: chunked loss, no logits kept
        with torch.no_grad():
            logits = m(ids).logits
        return logits, {n: p.grad for n, p in m.named_parameters()}

    ref_logits, ref_grads = run(model)
    for pad in range(0, 64, 8):  # the header is padded to 8 bytes: every residue mod 64
        save_file(tensors, str(tmp_path / "ckpt/model.safetensors"), metadata={"pad": "x" * pad})
        loaded = load_checkpoint(tmp_path / "ckpt")
        assert all(t.data_ptr() % 64 == 0 for t in loaded.state_dict().values()), pad
        logits, grads = run(loaded)
        assert torch.equal(logits, ref_logits), pad
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads), pad

    trainer = Trainer(tmp_path / "run", TrainConfig(**{**CFG, "steps": 1}), _source(0), _source(1),
                      get_preset("tiny"))
    checkpoint = trainer.train().checkpoint
    named = read_optimizer_file(checkpoint / "optimizer.safetensors", trainer.model, trainer.optimizer)
    assert all(t.data_ptr() % 64 == 0 for entries in named.values() for t in entries.values())


def test_resume_in_another_environment_warns_and_a_1_0_state_loads(tmp_path):
    cfg = TrainConfig(**{**CFG, "steps": 2})
    checkpoint = Trainer(tmp_path / "run", cfg, _source(0), _source(1), get_preset("tiny")).train().checkpoint
    path = checkpoint / "training_state.json"
    state = json.loads(path.read_text())
    env = state["environment"]
    assert env["torch_version"] == torch.__version__ and env["world_size"] == 1
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["intra_op_threads"] == torch.get_num_threads()

    state["environment"] = {**env, "intra_op_threads": env["intra_op_threads"] + 1, "cpu_capability": "OTHER"}
    path.write_text(json.dumps(state))
    with pytest.warns(ResumeNotBitIdenticalWarning, match=r"cpu_capability: OTHER -> \w+; intra_op_threads: \d+ -> \d+"):
        Trainer(tmp_path / "b", cfg, _source(0), _source(1), resume_from=checkpoint)

    state.pop("environment")  # a checkpoint written before the record existed
    state["training_state_version"] = "1.0"
    path.write_text(json.dumps(state))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeNotBitIdenticalWarning)
        Trainer(tmp_path / "c", cfg, _source(0), _source(1), resume_from=checkpoint)
