"""MLA's two forms (mla.py) and the choice between them (mla_cost.py): the FLOP counts are torch's
own, the choice follows them, and a chunked prefill plus decode steps through the latent cache
give the full forward's logits with either form forced, on plain, padded-batch [B, S] and packed
[B, T, S] masks."""

from __future__ import annotations

import pytest
import torch
from colibri_model import ColibriConfig, ColibriForCausalLM
from colibri_model.layers import KVCache
from colibri_model.mla import MultiHeadLatentAttention
from colibri_model.mla_cost import cheaper_mla_form, mla_form_flops, most_decompressed_keys
from torch.utils.flop_counter import FlopCounterMode

MLA = dict(vocab_size=256, d_model=64, n_layers=2, n_dense_layers=1, n_heads=4, n_kv_heads=4, head_dim=24,
           dense_ffn_dim=96, n_experts=8, expert_dim=32, shared_expert_dim=32, top_k_train=2, top_k_infer=2,
           qk_norm=False, max_seq_len=64, attention_kind="mla", q_lora_rank=32, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True)
FORMS = ["absorbed", "decompressed", "auto"]
V2_LITE = dict(heads=16, kv_rank=512, nope=128, rope=64, v_dim=128)


def test_the_choice_at_deepseek_shapes_by_hand():
    # decompressed iff past * r * (n + v) < T * S * (2r - n - v): past < T * S / 170.67 at these shapes
    chunk = [cheaper_mla_form(128, past + 128, **V2_LITE) for past in (0, 128, 256, 384, 512)]
    assert chunk == ["decompressed", "decompressed", "decompressed", "absorbed", "absorbed"]
    flops = mla_form_flops(128, 512, **V2_LITE)  # past 384: the tie, which goes to absorbed
    assert flops["absorbed"] == flops["decompressed"] == 2 * 16 * (128 * 512 * 256 + 128 * 512 * 1088)
    assert cheaper_mla_form(1, 1, **V2_LITE) == "decompressed"  # a one-token prompt
    assert cheaper_mla_form(1, 2, **V2_LITE) == "absorbed"  # any decode step over a past
    assert cheaper_mla_form(4096, 4096, **V2_LITE) == "decompressed"  # a whole prompt
    for heads in (1, 128):  # the head count cancels
        assert cheaper_mla_form(128, 128 + 383, **{**V2_LITE, "heads": heads}) == "decompressed"
        assert cheaper_mla_form(128, 128 + 384, **{**V2_LITE, "heads": heads}) == "absorbed"


@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
@pytest.mark.parametrize("past, new", [(5, 3), (9, 1), (0, 6)])
def test_the_counted_flops_are_torchs_count_of_the_pass(form, past, new):
    """FlopCounterMode's count of one pass through the cache, less the projections both forms share."""
    config = ColibriConfig(**{**MLA, "q_lora_rank": None, "n_layers": 1, "n_experts": 0, "expert_dim": 0,
                              "shared_expert_dim": 0})
    attn = MultiHeadLatentAttention(config, 0)
    attn.form = form
    cache = KVCache(config, 2, 16)
    cache.length = past  # what the cache holds does not change the count
    x = torch.randn(2, new, 64)
    with FlopCounterMode(display=False) as counter:
        # a mask: the explicit-mask kernel, which computes the whole T x S score matrix
        attn(x, torch.arange(past, past + new), cache, attention_mask=torch.ones(2, past + new, dtype=torch.bool))
    shared = 2 * new * 64 * (4 * 24 + 32 + 8 + 4 * 16)  # per row: q_proj, kv_a_proj_with_mqa, o_proj
    counted = mla_form_flops(new, past + new, heads=4, kv_rank=32, nope=16, rope=8, v_dim=16)[form]
    assert counter.get_total_flops() == 2 * (shared + counted)  # two batch rows


def _model(form: str) -> ColibriForCausalLM:
    torch.manual_seed(0)
    model = ColibriForCausalLM(ColibriConfig(**MLA)).eval()
    _set_form(model, form)
    return model


def _set_form(model: ColibriForCausalLM, form: str) -> None:
    for layer in model.layers:
        layer.attn.form = form


def _reference(model: ColibriForCausalLM, form: str, tokens: list[int]) -> torch.Tensor:
    """The full forward of one sequence alone, no cache, in the OTHER form (a cross-check)."""
    _set_form(model, "absorbed" if form == "decompressed" else "decompressed")
    logits = model(torch.tensor([tokens])).logits[0]
    _set_form(model, form)
    return logits


@pytest.fixture
def calls(monkeypatch):
    """The forms the passes took, in order."""
    seen = []
    for name in ("_absorbed", "_decompressed"):
        original = getattr(MultiHeadLatentAttention, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            seen.append(_name[1:])
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(MultiHeadLatentAttention, name, spy)
    return seen


@torch.no_grad()
@pytest.mark.parametrize("form", FORMS)
def test_chunked_prefill_and_decode_equal_the_full_forward(form, calls):
    model = _model(form)
    tokens = torch.randint(0, 256, (2, 15))
    full = torch.stack([_reference(model, form, row) for row in tokens.tolist()])
    calls.clear()
    cache = model.new_kv_cache(2, 16)
    parts = [model(tokens[:, s:s + 4], cache=cache).logits for s in (0, 4, 8)]  # chunks at past 0, 4, 8
    parts += [model(tokens[:, t:t + 1], cache=cache).logits for t in range(12, 15)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    per_pass = calls[::2]  # two MLA layers a pass, both alike
    if form == "auto":  # decompressed iff past * 32 * 32 < T * S * 32 (the test's shapes)
        assert per_pass == ["decompressed", "absorbed", "absorbed"] + ["absorbed"] * 3
    else:
        assert set(calls) == {form}


@torch.no_grad()
@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_a_padded_batch_in_chunks_gives_each_row_its_logits_alone(form, calls):
    model = _model(form)
    torch.manual_seed(1)
    lengths = [7, 3, 5]
    rows = [torch.randint(0, 256, (n,)).tolist() for n in lengths]
    steps = torch.randint(0, 256, (3, 2)).tolist()  # two decode tokens per row
    ids = torch.tensor([r + [0] * (7 - len(r)) for r in rows])
    real = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    cache = model.new_kv_cache(3, 9)
    positions = torch.arange(7).expand(3, 7)
    chunks = [model(ids[:, s:e], cache=cache, positions=positions[:, s:e], attention_mask=real[:, :e]).logits
              for s, e in ((0, 3), (3, 7))]
    prefill = torch.cat(chunks, 1)
    mask, got = real, [[prefill[r, n - 1]] for r, n in enumerate(lengths)]
    for step in range(2):  # every row's next token in one new column
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        token = torch.tensor([[s[step]] for s in steps])
        out = model(token, cache=cache, positions=(torch.tensor(lengths) + step)[:, None], attention_mask=mask).logits
        for r in range(3):
            got[r].append(out[r, 0])
    assert set(calls) == {form}
    for r, row in enumerate(rows):
        alone = _reference(model, form, row + steps[r])[len(row) - 1:]
        torch.testing.assert_close(torch.stack(got[r]), alone, rtol=1e-4, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_packed_sequences_in_chunks_give_each_its_logits_alone(form, calls):
    """A [B, T, S] mask sliced per chunk: two sequences in one row, prefilled in two chunks."""
    model = _model(form)
    torch.manual_seed(2)
    first, second = torch.randint(0, 256, (6,)).tolist(), torch.randint(0, 256, (4,)).tolist()
    ids = torch.tensor([first + second])
    positions = torch.tensor([list(range(6)) + list(range(4))])
    owner = torch.tensor([0] * 6 + [1] * 4)
    mask = (owner[:, None] == owner[None, :])[None]  # [1, 10, 10]
    cache = model.new_kv_cache(1, 10)
    packed = torch.cat([model(ids[:, s:e], cache=cache, positions=positions[:, s:e],
                              attention_mask=mask[:, s:e, :e]).logits for s, e in ((0, 4), (4, 10))], 1)[0]
    assert set(calls) == {form}
    torch.testing.assert_close(packed[:6], _reference(model, form, first), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed[6:], _reference(model, form, second), rtol=1e-4, atol=1e-5)


def test_an_unknown_form_is_a_clear_error():
    model = _model("latent")
    with pytest.raises(ValueError, match=r"MultiHeadLatentAttention.form: 'latent' is not one of auto"):
        model(torch.randint(0, 256, (1, 3)))


@pytest.mark.parametrize("kv_rank, nope, v_dim", [(512, 128, 128), (32, 16, 16), (64, 100, 40), (16, 16, 16)])
def test_the_longest_decompressed_pass_matches_the_choice(kv_rank, nope, v_dim):
    shape = dict(heads=3, kv_rank=kv_rank, nope=nope, rope=8, v_dim=v_dim)
    for new in (1, 2, 7, 128, 171, 300):
        longest = most_decompressed_keys(new, 2048, kv_rank, nope, v_dim)
        chosen = [keys for keys in range(new, 2049) if cheaper_mla_form(new, keys, **shape) == "decompressed"]
        assert longest == (max(chosen) if chosen else 0)
        assert chosen == list(range(new, longest + 1))  # decompressed up to a length, absorbed beyond
