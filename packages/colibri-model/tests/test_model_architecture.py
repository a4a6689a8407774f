"""The architecture's contracts: grouped dispatch == per-expert loop, KV-cache decoding ==
full forward, the top-1 router-gradient finding, and aux-loss-free balancing."""

import torch
from colibri_model import ColibriForCausalLM, ExpertBiasBalancer, get_preset
from colibri_model.experts import GroupedExperts
from colibri_model.moe import MoELayer


def small_config(**overrides):
    base = dict(vocab_size=512, max_seq_len=64)
    return get_preset("tiny", **{**base, **overrides})


def test_grouped_dispatch_matches_per_expert_loop_forward_and_backward():
    torch.manual_seed(0)
    experts = GroupedExperts(n_experts=8, d_model=32, expert_dim=16)
    experts.reset_parameters(0.1, 0.1)
    x = torch.randn(50, 32, requires_grad=True)
    # Skewed choice with an expert left empty, to cover zero-row groups.
    ids = torch.randint(0, 7, (50, 2))
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 5, (50,))) % 7
    gates = torch.rand(50, 2, requires_grad=True)
    upstream = torch.randn(50, 32)

    fast = experts(x, ids, gates)
    (fast * upstream).sum().backward()
    fast_grads = [t.grad.clone() for t in (x, gates, experts.gate_proj, experts.up_proj, experts.down_proj)]
    for t in (x, gates, experts.gate_proj, experts.up_proj, experts.down_proj):
        t.grad = None

    slow = experts.reference_forward(x, ids, gates)
    (slow * upstream).sum().backward()
    slow_grads = [t.grad for t in (x, gates, experts.gate_proj, experts.up_proj, experts.down_proj)]

    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast_grads, slow_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kv_cache_decoding_matches_full_forward_token_for_token():
    torch.manual_seed(1)
    model = ColibriForCausalLM(small_config()).eval()
    tokens = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        full = model(tokens).logits
        cache = model.new_kv_cache(batch_size=2, max_len=32)
        prefix = model(tokens[:, :10], cache=cache).logits
        steps = [model(tokens[:, t : t + 1], cache=cache).logits for t in range(10, 24)]
    incremental = torch.cat([prefix] + steps, dim=1)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-5)
    # The two paths run different kernels (one-row products vs the whole sequence), so their
    # logits agree to rounding, not bit for bit: the argmax must agree wherever the top-2 gap is
    # wider than that rounding (a near-tie may go either way on another CPU's kernels).
    top2 = full.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 1e-4
    assert decisive.float().mean() > 0.9
    assert torch.equal(incremental.argmax(-1)[decisive], full.argmax(-1)[decisive])


def _router_grad_ratio(top_k: int) -> float:
    torch.manual_seed(2)
    model = ColibriForCausalLM(small_config(top_k_train=top_k)).train()
    tokens = torch.randint(0, 512, (2, 32))
    out = model(tokens[:, :-1], targets=tokens[:, 1:])
    out.loss.backward()
    router_sq = sum(layer.router.weight.grad.pow(2).sum() for layer in model.moe_layers())
    total_sq = sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)
    return float((router_sq / total_sq).sqrt())


def test_router_gets_no_lm_gradient_at_top1_but_does_at_top2():
    # NanoColibri's finding: with route_norm, the top-1 gate is s/s == 1.
    assert _router_grad_ratio(1) < 1e-8
    assert _router_grad_ratio(2) > 1e-4


def test_bias_update_moves_skewed_router_toward_uniform_load():
    torch.manual_seed(3)
    config = small_config(bias_update_gamma=0.01)
    layer = MoELayer(config, layer_index=1)
    torch.nn.init.normal_(layer.router.weight, std=0.02)
    # Skew: with inputs shifted positive, every token's score favours experts 0 and 1.
    with torch.no_grad():
        layer.router.weight[0] += 0.03
        layer.router.weight[1] += 0.02

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.layer = layer

        def moe_layers(self):
            return [self.layer]

    holder = Holder()
    balancer = ExpertBiasBalancer(holder)
    x = torch.randn(4, 64, config.d_model) + 0.5

    def max_vio_after_step():
        with torch.no_grad():
            layer(x)
        balancer.step()
        return balancer.last_stats[0].max_vio

    first = max_vio_after_step()
    for _ in range(60):
        last = max_vio_after_step()
    assert first > 1.0, first  # 2 of 8 experts take everything: MaxVio 3
    assert last < 0.5, (first, last)
    assert balancer.last_stats[0].dead_experts == 0
    assert layer.router.expert_bias[0] < 0 and layer.router.expert_bias[1] < 0


def test_bias_update_counts_the_whole_accumulated_batch():
    torch.manual_seed(4)
    model = ColibriForCausalLM(small_config()).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    balancer = ExpertBiasBalancer(model)
    balancer.attach(optimizer)
    tokens = torch.randint(0, 512, (4, 17))
    for micro in range(2):  # two micro-batches, one optimizer step
        batch = tokens[2 * micro : 2 * micro + 2]
        model(batch[:, :-1], targets=batch[:, 1:]).loss.backward()
    optimizer.step()
    counted = sum(balancer.last_stats[0].load)  # shares sum to 1
    assert abs(counted - 1.0) < 1e-6
    slots = 4 * 16 * model.config.top_k_train
    assert model.moe_layers()[0].router.tokens_per_expert.sum() == 0  # reset after the step
    assert len(balancer.last_stats) == model.config.n_moe_layers and slots > 0


def test_serving_top_k_follows_mode_and_override():
    model = ColibriForCausalLM(small_config())
    layer = model.moe_layers()[0]
    assert layer.top_k == 2
    model.eval()
    assert layer.top_k == 1
    model.set_top_k(2)
    assert layer.top_k == 2
