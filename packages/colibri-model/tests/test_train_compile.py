"""Per-block `torch.compile(fullgraph=True)` and a sync-free micro-batch, proved on CPU.

fullgraph=True makes any graph break an error, so a block that compiles IS one graph; the
aot_eager backend traces the backward too (AOT autograd) without spending minutes in inductor on
two cores. HostSyncCounter (colibri_model.host_syncs) counts, op by op, what would make the host
wait for a GPU."""

import functools

import numpy as np
import pytest
import torch
import torch.optim.adam as adam_functional
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.data import TokenSource
from colibri_model.host_syncs import HostSyncCounter
from colibri_model.training import TrainConfig, Trainer
from torch._dynamo.testing import CompileCounterWithBackend

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def small_config(**overrides):
    return get_preset("tiny", **{**dict(vocab_size=512, max_seq_len=64), **overrides})


@pytest.fixture(autouse=True)
def one_thread():
    # Small tensors: on a shared 2-core box a second OpenMP thread only adds barrier waits
    # (a tiny trainer step: 0.2 s on one thread, 4 s on two under load).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return ColibriForCausalLM(small_config(**overrides))


def _step(model, tokens, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast(**BF16, enabled=autocast):
        out = model(tokens[:, :-1], targets=tokens[:, 1:])
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_block_is_one_graph_forward_and_backward():
    model = _model()
    h = torch.randn(2, 16, model.config.d_model, requires_grad=True)
    positions = torch.arange(16)
    model(torch.zeros(1, 16, dtype=torch.long))  # builds the RoPE tables, as every model forward does
    for block in (model.layers[0], model.layers[1]):  # dense, MoE
        explanation = torch._dynamo.explain(block.forward)(h, positions)
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons

    counter = CompileCounterWithBackend("aot_eager")
    model.compile_blocks(backend=counter)  # fullgraph=True: a graph break would raise here
    tokens = torch.randint(0, 512, (2, 17))
    loss, grads = _step(model, tokens)
    assert torch.isfinite(loss) and len(grads) == len(list(model.parameters()))
    # one graph for the dense block and one for the MoE blocks, reused by all three of them
    assert counter.frame_count == 2


def test_compiled_training_after_a_forward_under_inference_mode():
    """The RoPE tables are cached per rope and shared by every model in the process
    (layers._rope_tables). One first built under inference_mode (an eval or a generation, as
    colibri-stream's engine runs) was an inference tensor, and a compiled block saves the table
    for backward: the next compiled training step of the same rope failed."""
    from colibri_model.layers import _rope_tables

    _rope_tables.cache_clear()
    with torch.inference_mode():
        _model(3).eval()(torch.randint(0, 512, (1, 8)))
    model = _model(3)
    model.compile_blocks(backend="aot_eager")
    loss, grads = _step(model, torch.randint(0, 512, (2, 17)))
    assert torch.isfinite(loss) and len(grads) == len(list(model.parameters()))


@pytest.mark.parametrize("autocast, tolerance", [(False, 1e-5), (True, 2e-2)], ids=["fp32", "bf16"])
def test_compiled_blocks_equal_eager(autocast, tolerance):
    eager, compiled = _model(1), _model(1)
    compiled.compile_blocks(backend="aot_eager")
    tokens = torch.randint(0, 512, (2, 33))
    loss_eager, grads_eager = _step(eager, tokens, autocast)
    loss_compiled, grads_compiled = _step(compiled, tokens, autocast)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=tolerance, atol=tolerance)
    assert grads_compiled.keys() == grads_eager.keys()
    for name, grad in grads_eager.items():
        # relative to the tensor's norm: in bf16 the traced graph rounds at other points than eager
        error = (grads_compiled[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < tolerance, (name, float(error))
    for a, b in zip(eager.moe_layers(), compiled.moe_layers()):  # the routers counted the same tokens
        assert torch.equal(a.router.tokens_per_expert, b.router.tokens_per_expert)


def test_no_recompile_across_routings():
    model = _model(2)
    counter = CompileCounterWithBackend("aot_eager")
    model.compile_blocks(backend=counter)
    _step(model, torch.randint(0, 512, (2, 17)))
    frames = counter.frame_count
    with torch._dynamo.config.patch(error_on_recompile=True):
        for bias in (None, 0.0, 5.0):
            if bias is not None:  # every token to expert 3 (+ one other): seven empty groups
                for layer in model.moe_layers():
                    layer.router.expert_bias.zero_()
                    layer.router.expert_bias[3] = bias
            loss, _ = _step(model, torch.randint(0, 512, (2, 17)))
            assert torch.isfinite(loss)
    assert counter.frame_count == frames
    assert model.moe_layers()[0].router.tokens_per_expert[3] > 0


def test_trainer_compile_flag_compiles_blocks_for_training_only(tmp_path, monkeypatch):
    # The trainer's --compile path with a CPU-quick backend (inductor takes minutes on 2 cores).
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(ColibriForCausalLM, "compile_blocks",
                        functools.partialmethod(ColibriForCausalLM.compile_blocks, backend=counter))
    trainer = _trainer(tmp_path, compile=True)
    record = trainer.train_step()
    assert record.loss is not None and np.isfinite(record.loss)
    assert counter.frame_count == 2
    assert np.isfinite(trainer.evaluate()) and np.isfinite(trainer.evaluate(top_k=2))
    trainer.train_step()
    assert counter.frame_count == 2  # validation ran the eager blocks: nothing recompiled
    trainer.close()


def test_the_counter_counts_what_would_sync():
    ids = torch.randint(0, 8, (40, 2))
    with HostSyncCounter() as syncs:
        torch.bincount(ids.flatten(), minlength=8)
        int(ids.max())
        torch.nonzero(ids == 3)
        ids[ids > 2]
        ids.tolist()
    assert syncs.events == {"bincount": 1, "item": 1, "nonzero": 1, "boolean_index": 1, "host_read": 1}
    model = _model(3)
    expert_ids = torch.randint(0, 8, (30, 2))
    with HostSyncCounter() as syncs:
        model.moe_layers()[0].experts.reference_forward(torch.randn(30, 128), expert_ids, torch.rand(30, 2))
    assert syncs.events["nonzero"] == 8  # the readable loop syncs once per expert; the grouped path never


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_micro_batch_forward_and_backward_never_syncs(autocast):
    model = _model(4)
    tokens = torch.randint(0, 512, (2, 33))
    _step(model, tokens, autocast)  # warm: RoPE tables exist
    with HostSyncCounter() as syncs:
        _step(model, torch.randint(0, 512, (2, 33)), autocast)
        model.activation_checkpointing = True
        _step(model, tokens, autocast)
    assert syncs.total == 0, dict(syncs.events)


def test_balancer_updates_on_device_and_reads_the_host_only_for_stats(monkeypatch):
    model = _model(5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    from colibri_model import ExpertBiasBalancer

    balancer = ExpertBiasBalancer(model)
    balancer.attach(optimizer)
    _step(model, torch.randint(0, 512, (2, 33)))
    reduces = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: reduces.append(t.shape))
    with HostSyncCounter() as syncs:
        optimizer.step()
    assert syncs.total == 0, dict(syncs.events)
    assert reduces == [(model.config.n_moe_layers, model.config.n_experts)]  # one all-reduce, all layers
    with HostSyncCounter() as syncs:
        stats = balancer.last_stats
        assert balancer.last_stats is stats
    assert syncs.events == {"host_read": 1} and len(stats) == 3
    assert all(abs(sum(s.load) - 1) < 1e-6 for s in stats)
    assert any(layer.router.expert_bias.abs().sum() > 0 for layer in model.moe_layers())


def _trainer(tmp_path, **overrides):
    rng = np.random.default_rng(0)
    source = TokenSource([rng.integers(0, 512, size=40_000).astype(np.uint16)])
    cfg = TrainConfig(**{**dict(steps=100, seq_len=32, batch_size=8, micro_batch=8, warmup_steps=0,
                                eval_batches=1, progress=False), **overrides})
    return Trainer(tmp_path / f"run{len(list(tmp_path.iterdir()))}", cfg, source, source, small_config())


def test_trainer_host_reads_per_step_stay_constant(tmp_path, monkeypatch):
    """Host reads per optimizer step do not grow with micro-batches or layers: the target counts
    (a host tensor, no sync on a GPU) and the one read of loss, aux and gradient norm."""
    counts = {}
    syncs = HostSyncCounter()
    # NOTE: AdamW's CPU (single-tensor) path reads its step counter with .item(), a host tensor;
    # on CUDA the trainer runs fused AdamW, whose step counters live on the device.
    single_tensor_adam = adam_functional._single_tensor_adam

    def adam_uncounted(*args, **kwargs):
        with syncs.ignoring():
            return single_tensor_adam(*args, **kwargs)

    monkeypatch.setattr(adam_functional, "_single_tensor_adam", adam_uncounted)
    for micro_batch in (8, 2):  # 1 and 4 micro-batches
        trainer = _trainer(tmp_path, micro_batch=micro_batch)
        trainer.train_step()
        syncs.events.clear()
        with syncs:
            record = trainer.train_step(router_stats=False)
        counts[micro_batch] = dict(syncs.events)
        assert record.router == []
        syncs.events.clear()
        with syncs:
            record = trainer.train_step()  # a logged step also copies the router counts, once
        assert syncs.total == 3 and len(record.router) == 3, dict(syncs.events)
        trainer.close()
    assert counts[8] == counts[2] == {"host_read": 2}, counts
