"""The batched engine (packed rows, length batching, head-only logits, shared prefixes) equals
a naive one-request-at-a-time full forward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from colibri_eval import get_task, load_documents  # noqa: E402
from colibri_eval.request_encoding import TokenRequest, encode_requests  # noqa: E402
from colibri_eval.scoring_engine import ScoringEngine  # noqa: E402


def naive_score(hf_model, request: TokenRequest, max_length: int) -> tuple[float, bool]:
    full = list(request.context) + list(request.continuation)
    inp = torch.tensor([full[-(max_length + 1):][:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(inp).logits[0].float(), dim=-1)
    cont = torch.tensor(request.continuation)
    picked = logp[-len(cont):]
    return float(picked.gather(1, cont[:, None]).sum()), bool((picked.argmax(-1) == cont).all())


@pytest.fixture(scope="module")
def groups(tiny_hf_model):
    out = []
    for name in ("hellaswag", "winogrande", "lambada_openai", "arc_challenge"):
        for doc in load_documents(get_task(name), "bundled", limit=4):
            out.append(encode_requests(tiny_hf_model.tokenizer, doc.item.requests))
    return out


def test_engine_matches_naive_forward(tiny_hf_model, groups):
    hf_model = tiny_hf_model.model.model
    expected = [[naive_score(hf_model, r, tiny_hf_model.model.max_length) for r in g] for g in groups]
    model = tiny_hf_model.model
    # a huge batch puts documents with different prefix lengths in one left-padded call; packed
    # rows of 16 columns split every multiple-choice document (its trunk repeated per piece) and
    # give longer segments rows of their own
    settings = [dict(share_prefixes=share, batch_tokens=batch_tokens, pack=pack, row_tokens=row_tokens)
                for pack in (True, False) for share in (True, False) for batch_tokens in (64, 100_000)
                for row_tokens in ((16, 256) if pack else (256,))]
    for setting in settings:
        got = ScoringEngine(model, **setting).score(groups)
        for got_group, want_group in zip(got, expected, strict=True):
            for (ll, greedy), (want_ll, want_greedy) in zip(got_group, want_group, strict=True):
                assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-3)
                assert greedy == want_greedy


def test_prefix_sharing_is_used_for_multiple_choice(tiny_hf_model, groups):
    prefixes = []
    model = tiny_hf_model.model
    original = model.shared_prefix_logits

    def counting(prefix_ids, *args):
        prefixes.append(prefix_ids.shape[0])
        return original(prefix_ids, *args)

    model.shared_prefix_logits = counting
    try:
        ScoringEngine(model, batch_tokens=2048, pack=False).score(groups)
    finally:
        del model.shared_prefix_logits
    assert sum(prefixes) >= 8  # hellaswag and arc groups at least
    assert len(prefixes) < sum(prefixes)  # several documents per call


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_rows_are_exact_under_every_attention_kernel_that_packs(tiny_hf_dir, tiny_hf_model, groups, attention):
    """transformers' eager kernel ADDS the custom 4-D mask it is given (a boolean one would shift
    the scores by 0/1, silently): the adapter passes an additive one, right on both kernels."""
    import transformers
    from colibri_eval.adapters.hf_causal_lm import HFCausalLM

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir, attn_implementation=attention)
    adapter = HFCausalLM(model, tiny_hf_model.model.max_length)
    assert adapter.supports_packing
    got = ScoringEngine(adapter, row_tokens=64).score(groups)
    for group, got_group in zip(groups, got, strict=True):
        for request, (ll, greedy) in zip(group, got_group, strict=True):
            want_ll, want_greedy = naive_score(model, request, adapter.max_length)
            assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-3) and greedy == want_greedy


def test_packing_computes_each_shared_context_once(tiny_hf_model, groups):
    """Packed rows hold every document's trunk once and its branches: fewer tokens than the
    requests' inputs laid end to end, and no more columns than that plus a row tail each."""
    model = tiny_hf_model.model
    calls = []
    original = model.packed_logits

    def counting(input_ids, positions, allowed, rows, cols):
        calls.append((input_ids.shape, int((allowed.sum(-1) > 1).sum())))
        return original(input_ids, positions, allowed, rows, cols)

    model.packed_logits = counting
    try:
        ScoringEngine(model, batch_tokens=512, row_tokens=256).score(groups)
    finally:
        del model.packed_logits
    inputs = sum(min(len(r.context) + len(r.continuation) - 1, model.max_length) for g in groups for r in g)
    columns = sum(shape[0] * shape[1] for shape, _ in calls)
    assert columns < 0.8 * inputs
    assert all(shape[1] <= 256 for shape, _ in calls)


def test_left_truncation_to_max_length(tiny_hf_model):
    model = tiny_hf_model.model
    long_context = tuple(range(10, 10 + model.max_length + 40))
    request = TokenRequest(long_context, (7, 8))
    [[(ll, _)]] = ScoringEngine(model).score([[request]])
    want, _ = naive_score(model.model, request, model.max_length)
    assert ll == pytest.approx(want, rel=1e-5, abs=1e-3)
    with pytest.raises(ValueError, match="empty continuation"):
        ScoringEngine(model).score([[TokenRequest((1,), ())]])
