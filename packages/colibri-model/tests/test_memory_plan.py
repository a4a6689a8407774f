"""The memory planner against what the eager model really saves and allocates, on CPU.

- saved activations: `measure_saved_bytes` (saved_tensors_hooks, unique storages) per kind and in
  total, fp32 and bf16 autocast, without and with full activation checkpointing: within 10%;
- the forward + backward peak: the CPU allocator's own events (torch.profiler with
  profile_memory) against the planner's peak over the parameter floor: never under, at most
  20% over;
- the plan's arithmetic (FSDP shards, accumulation, chunked CE) and the CLI's exit codes.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.cli import main
from colibri_model.training.activations import BF16_EXPERTS, FP32_EXPERTS, MODEL_PATH
from colibri_model.training.memory_plan import MemoryPlanError, largest_fitting_micro_batch, plan_memory
from colibri_model.training.saved_tensors import measure_saved_bytes
from torch.profiler import ProfilerActivity, profile

# The compute path the model in this package runs (activations.MODEL_PATH: fp32 experts, router
# recast by autocast and whole-batch logits until the bf16-expert compute path lands).
CODE_PATH = MODEL_PATH
TOLERANCE = 0.10


def _model(vocab_size: int, ac: bool) -> ColibriForCausalLM:
    torch.manual_seed(0)
    model = ColibriForCausalLM(get_preset("tiny", vocab_size=vocab_size))
    model.train()
    model.activation_checkpointing = ac
    return model


def _batch(model, batch: int, seq: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_planned_activations_match_saved_tensor_bytes(precision, ac):
    model = _model(vocab_size=2048, ac=ac == "full")
    batch, seq = 2, 96
    x, y = _batch(model, batch, seq)
    measured = measure_saved_bytes(model, x, y, torch.bfloat16 if precision == "bf16" else None)
    plan = plan_memory(model.config, micro_batch=batch, seq_len=seq, precision=precision, ac=ac, path=CODE_PATH)

    planned = plan.activations_by_kind
    assert abs(plan.activations - measured.activations_total) <= TOLERANCE * measured.activations_total, \
        (plan.activations, measured.activations_total)
    for kind, value in measured.activations.items():
        assert abs(planned[kind] - value) <= TOLERANCE * value, (kind, planned[kind], value)
    if ac == "full":
        assert abs(planned["checkpointed_blocks"] - measured.checkpoint_inputs) <= TOLERANCE * measured.checkpoint_inputs
        assert sum(measured.activations.get(k, 0) for k in ("attention", "experts", "router")) == 0
    else:
        assert measured.checkpoint_inputs == 0 and set(measured.activations) >= {"attention", "experts", "head"}
    # autocast's bf16 weight casts are the planner's compute copies (none in fp32)
    assert abs(plan.compute_copies - measured.compute_copies) <= TOLERANCE * max(measured.compute_copies, 1)
    # (under full AC the blocks' casts are redone in the recompute and the chunked CE keeps none)
    assert (measured.compute_copies > 0) == (precision == "bf16" and ac == "none")


@pytest.fixture
def one_thread():
    """Kernels' per-thread scratch buffers (e.g. CPU flash attention's) grow with the thread
    count; the planner models the tensors, so the peak is measured on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cpu_step_peak(model, x, y, bf16: bool) -> int:
    """Peak bytes the CPU allocator held above the start, over one forward + backward."""
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(x, targets=y).loss.backward()

    step()  # warm: lazily built RoPE tables and kernels' own caches stay out of the count
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("precision, ac, vocab, batch, seq", [
    ("fp32", "none", 256, 2, 128),  # the blocks dominate
    ("bf16", "none", 256, 2, 128),
    ("fp32", "full", 256, 2, 128),  # checkpointing: the recomputed block dominates
    ("bf16", "full", 256, 2, 128),
    ("bf16", "none", 8192, 2, 128),  # the whole-batch cross-entropy dominates
])
def test_planned_peak_bounds_the_cpu_allocator_peak(precision, ac, vocab, batch, seq, one_thread):
    model = _model(vocab_size=vocab, ac=ac == "full")
    x, y = _batch(model, batch, seq)
    measured = _cpu_step_peak(model, x, y, precision == "bf16")
    plan = plan_memory(model.config, micro_batch=batch, seq_len=seq, precision=precision, ac=ac, path=CODE_PATH)
    planned = plan.peak_allocated - plan.params - plan.optimizer - plan.buffers  # no AdamW state yet
    assert measured <= planned <= 1.2 * measured, (planned, measured)


def test_plan_arithmetic():
    nano = get_preset("nano")
    base = plan_memory(nano, micro_batch=8, seq_len=2048)
    assert base.params == base.grads == base.optimizer // 2 == base.total_params * 4
    sharded = plan_memory(nano, micro_batch=8, seq_len=2048, fsdp=8)
    assert sharded.params == -(-base.total_params // 8) * 4 and sharded.activations == base.activations
    # FSDP2 gathers two blocks in bf16 (and one block's fp32 gradients) whatever the depth
    deeper = plan_memory(nano.with_updates(n_layers=30), micro_batch=8, seq_len=2048, fsdp=8)
    assert deeper.compute_copies == sharded.compute_copies > 0
    accumulating = plan_memory(nano, micro_batch=8, seq_len=2048, grad_accum=4)
    assert accumulating.peak_allocated - base.peak_allocated == accumulating.grads - base.grads_at_peak
    checkpointed = plan_memory(nano, micro_batch=8, seq_len=2048, ac="full")
    assert checkpointed.activations < base.activations / 10 and "layer_recompute" in checkpointed.transients
    whole = plan_memory(nano, micro_batch=8, seq_len=2048, path=FP32_EXPERTS)
    assert whole.logits_returned == 8 * 2048 * nano.vocab_size * 2 and base.logits_returned == 0
    assert whole.transients["cross_entropy"] > 2 * base.transients["cross_entropy"]
    assert base.transients["cross_entropy"] == BF16_EXPERTS.ce_chunk_tokens * nano.vocab_size * 12
    assert base.peak_device == base.peak_allocated + base.margin
    # doubling the micro-batch doubles the activations (all but the per-expert offsets and RoPE tables)
    double = plan_memory(nano, micro_batch=16, seq_len=2048)
    assert double.activations_by_kind["experts"] == pytest.approx(2 * base.activations_by_kind["experts"], rel=1e-6)
    micro_batch, plan = largest_fitting_micro_batch(nano, 80 * 2**30, seq_len=2048)
    assert plan.peak_device <= 80 * 2**30 < plan_memory(nano, micro_batch=2 * micro_batch, seq_len=2048).peak_device


@pytest.mark.parametrize("options, message", [
    (dict(micro_batch=0, seq_len=16), "micro_batch: must be at least 1"),
    (dict(micro_batch=1, seq_len=4096), "seq_len: 4096 exceeds the model's max_seq_len 2048"),
    (dict(micro_batch=1, seq_len=16, ac="selective"), "ac: 'selective' is not planned"),
    (dict(micro_batch=1, seq_len=16, precision="fp16"), "precision: 'fp16'"),
])
def test_plan_rejects_bad_input(options, message):
    with pytest.raises(MemoryPlanError, match=message):
        plan_memory(get_preset("nano"), **options)


def _one_line(result, code):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.output.strip().count("\n") == 0, result.output
    return result.output


def test_plan_memory_cli():
    runner = CliRunner()
    args = ["plan-memory", "--preset", "nano", "--micro-batch", "8", "--seq", "2048"]
    fits = runner.invoke(main, [*args, "--gpu", "h200"])
    assert fits.exit_code == 0, fits.output
    for phrase in ("params (fp32 masters)", "optimizer (AdamW m+v, fp32)", "bf16 compute copies", "experts",
                   "one moe layer", "transient: cross entropy", "peak on the device", "H200 SXM 141 GB"):
        assert phrase in fits.output, phrase
    too_big = runner.invoke(main, [*args, "--gpu", "NVIDIA L4"])  # a device name works too
    assert too_big.exit_code == 1 and "does NOT fit" in too_big.output
    data = json.loads(runner.invoke(main, [*args, "--gpu", "a100-40gb", "--json", "--ac", "full"]).output)
    assert data["fit"]["gpu"] == "a100-40gb" and data["ac"] == "full" and data["peak_device"] > data["peak_allocated"]
    whole = json.loads(runner.invoke(main, [*args, "--gpu", "h200", "--json", "--ce-chunk", "0"]).output)
    assert whole["ce_chunk_tokens"] is None and whole["logits_returned"] > 0

    assert "no selective activation checkpointing" in _one_line(runner.invoke(main, [*args, "--gpu", "h200", "--ac",
                                                                                      "selective"]), 2)
    assert "unknown GPU 'tpu'; choose one of h200-nvl, h200" in _one_line(runner.invoke(main, [*args, "--gpu", "tpu"]), 2)
    assert "exceeds the model's max_seq_len" in _one_line(runner.invoke(main, [
        "plan-memory", "--preset", "nano", "--micro-batch", "1", "--seq", "9999", "--gpu", "h200"]), 2)
    assert "unknown preset 'huge'" in _one_line(runner.invoke(main, [
        "plan-memory", "--preset", "huge", "--micro-batch", "1", "--seq", "16", "--gpu", "h200"]), 2)
    assert runner.invoke(main, ["plan-memory", "--preset", "nano", "--micro-batch", "0", "--seq", "16",
                                "--gpu", "h200"]).exit_code == 2
    assert "Usage:" in runner.invoke(main, ["plan-memory", "--help"]).output
    # compute paths by what they compute; the 0.1 series' names still read
    fp32 = json.loads(runner.invoke(main, [*args, "--gpu", "h200", "--json", "--compute-path", "fp32-experts"]).output)
    former = json.loads(runner.invoke(main, [*args, "--gpu", "h200", "--json", "--compute-path", "pre-issue19"]).output)
    assert fp32 == former and fp32["ce_chunk_tokens"] is None  # the same plan under either name
    bad = runner.invoke(main, [*args, "--gpu", "h200", "--compute-path", "fast"])
    assert bad.exit_code == 2 and "bf16-experts, fp32-experts" in bad.output
