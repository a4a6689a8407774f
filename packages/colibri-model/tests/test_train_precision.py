"""Precision of the training compute path: bf16 routed-expert matmuls on fp32 masters, an fp32
router under autocast, the chunked fp32 cross-entropy against the plain one, and the one warning
when the grouped matmul will be slow."""

import logging

import pytest
import torch
import torch.nn.functional as F
from colibri_model import ColibriForCausalLM, get_preset, grouped_mm
from colibri_model.experts import GroupedExperts
from colibri_model.loss import chunked_cross_entropy
from colibri_model.router import Router

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture(autouse=True)
def one_thread():
    # Small tensors: on a shared 2-core box a second OpenMP thread only adds barrier waits
    # (a tiny trainer step: 0.2 s on one thread, 4 s on two under load).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_config(**overrides):
    return get_preset("tiny", **{**dict(vocab_size=512, max_seq_len=64), **overrides})


def _experts_and_inputs(seed=0):
    torch.manual_seed(seed)
    experts = GroupedExperts(n_experts=8, d_model=32, expert_dim=16)
    experts.reset_parameters(0.1, 0.1)
    x = torch.randn(50, 32, requires_grad=True)
    ids = torch.randint(0, 7, (50, 2))  # expert 7 stays empty: a zero-row group
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 5, (50,))) % 7
    gates = torch.rand(50, 2, requires_grad=True)
    return experts, x, ids, gates


def test_grouped_matmuls_run_bf16_on_fp32_masters_under_autocast(monkeypatch):
    experts, x, ids, gates = _experts_and_inputs()
    seen = []
    real = torch._grouped_mm

    def recording(a, b, *args, **kwargs):
        seen.append((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    with torch.autocast(**BF16):
        out = experts(x, ids, gates)
    out.float().pow(2).sum().backward()
    assert len(seen) == 3 + 6  # three projections forward; input and weight gradients backward
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert out.dtype == torch.float32  # the MoE output comes back in the activations' dtype
    for w in (experts.gate_proj, experts.up_proj, experts.down_proj):
        assert w.dtype == torch.float32 and w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0

    seen.clear()
    experts(x, ids, gates)  # without autocast: the activations' own dtype, fp32 on CPU
    assert set(seen) == {(torch.float32, torch.float32)}


@pytest.mark.parametrize("autocast, tolerance", [(False, 1e-5), (True, 2e-2)], ids=["fp32", "bf16"])
def test_grouped_path_matches_the_per_expert_loop(autocast, tolerance):
    experts, x, ids, gates = _experts_and_inputs(1)
    upstream = torch.randn(50, 32)
    tensors = (x, gates, experts.gate_proj, experts.up_proj, experts.down_proj)

    def run(forward):
        for t in tensors:
            t.grad = None
        with torch.autocast(**BF16, enabled=autocast):
            out = forward(x, ids, gates)
        (out * upstream).sum().backward()
        return out.detach(), [t.grad.clone() for t in tensors]

    fast, fast_grads = run(experts)
    slow, slow_grads = run(experts.reference_forward)
    torch.testing.assert_close(fast, slow, rtol=tolerance, atol=tolerance * 0.1)
    for a, b in zip(fast_grads, slow_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * 0.1)


def test_router_stays_fp32_under_autocast():
    torch.manual_seed(2)
    config = small_config()
    router = Router(config)
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(64, config.d_model)
    ids_fp32, gates_fp32, scores_fp32 = router(x, 2)
    with torch.autocast(**BF16):
        ids_amp, gates_amp, scores_amp = router(x, 2)
    assert scores_amp.dtype == gates_amp.dtype == torch.float32
    # bit for bit the fp32 routing: autocast would round the scores to bf16 (step ~0.004 near 0.5,
    # four times the balancing step gamma=1e-3)
    assert torch.equal(scores_amp, scores_fp32) and torch.equal(ids_amp, ids_fp32)
    assert torch.equal(gates_amp, gates_fp32)


def _loss_inputs(seed=3, n=45, d=24, vocab=97):
    torch.manual_seed(seed)
    h = torch.randn(n, d, requires_grad=True)
    weight = (torch.randn(vocab, d) * 0.2).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    targets[::4] = -100  # masked positions (SFT), and one chunk with no target at all
    targets[7:14] = -100
    return h, weight, targets


@pytest.mark.parametrize("autocast, tolerance", [(False, 1e-6), (True, 1e-2)], ids=["fp32", "bf16"])
def test_chunked_cross_entropy_equals_the_plain_loss_and_gradients(autocast, tolerance):
    h, weight, targets = _loss_inputs()

    def run(loss_fn):
        h.grad = weight.grad = None
        with torch.autocast(**BF16, enabled=autocast):
            loss = loss_fn()
        (loss * 3.0).backward()  # the incoming gradient is not 1 (the trainer weights micro losses)
        return loss.detach(), h.grad.clone(), weight.grad.clone()

    plain = run(lambda: F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100))
    for chunk_rows in (7, 45, 1000):
        chunked = run(lambda rows=chunk_rows: chunked_cross_entropy(h, weight, targets, rows))
        assert chunked[0].dtype == torch.float32
        for a, b in zip(chunked, plain):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_chunked_cross_entropy_without_grad_and_without_targets():
    h, weight, targets = _loss_inputs()
    with torch.no_grad():
        plain = F.cross_entropy(F.linear(h, weight), targets, ignore_index=-100)
        torch.testing.assert_close(chunked_cross_entropy(h, weight, targets, 8), plain, rtol=1e-6, atol=1e-6)
        nothing = torch.full_like(targets, -100)
        assert torch.isnan(chunked_cross_entropy(h, weight, nothing, 8))  # as the plain mean: 0/0
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_cross_entropy(h, weight, targets, 0)


def test_model_loss_is_the_same_chunked_or_through_whole_batch_logits():
    torch.manual_seed(4)
    model = ColibriForCausalLM(small_config())
    model.loss_chunk_rows = 10  # 2 x 31 rows: four chunks, the last one short
    tokens = torch.randint(0, 512, (2, 32))

    def run(**kwargs):
        model.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], targets=tokens[:, 1:], **kwargs)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    chunked, chunked_grads = run()
    plain, plain_grads = run(return_logits=True)
    assert chunked.logits is None and plain.logits.shape == (2, 31, 512)
    torch.testing.assert_close(chunked.lm_loss, plain.lm_loss, rtol=1e-6, atol=1e-6)
    assert chunked_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(chunked_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    monkeypatch.setattr(grouped_mm, "_warned", set())
    caplog.set_level(logging.WARNING, logger="colibri_model")
    return caplog


def test_a_gpu_without_the_fast_grouped_kernel_warns_once(monkeypatch, fresh_warnings):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    for _ in range(3):
        assert grouped_mm.warn_if_slow_grouped_mm(torch.device("cuda:0"), torch.bfloat16) == "slow_gpu"
    assert len(fresh_warnings.records) == 1
    message = fresh_warnings.records[0].getMessage()
    assert "A100" in message and "sm80" in message and "2x" in message

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert grouped_mm.warn_if_slow_grouped_mm(torch.device("cuda:0"), torch.bfloat16) is None
    assert grouped_mm.warn_if_slow_grouped_mm(torch.device("cuda:0"), torch.float32) == "fp32_on_cuda"
    assert grouped_mm.warn_if_slow_grouped_mm("cpu", torch.float32) is None
    assert len(fresh_warnings.records) == 2


def test_a_torch_without_grouped_mm_warns_once_and_takes_the_loop(monkeypatch, fresh_warnings):
    experts, x, ids, gates = _experts_and_inputs()
    expected = experts(x, ids, gates)
    monkeypatch.delattr(torch, "_grouped_mm")
    fallback = [GroupedExperts(n_experts=8, d_model=32, expert_dim=16) for _ in range(3)]
    assert len(fresh_warnings.records) == 1 and "no torch._grouped_mm" in fresh_warnings.records[0].getMessage()
    fallback[0].load_state_dict(experts.state_dict())
    assert not fallback[0].use_grouped_mm
    torch.testing.assert_close(fallback[0](x, ids, gates), expected, rtol=1e-5, atol=1e-6)
