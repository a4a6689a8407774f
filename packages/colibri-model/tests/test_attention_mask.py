"""Per-row positions and a key padding mask (`forward(..., positions, attention_mask)`): a
right-padded batch of different-length rows gives each row the logits it has alone, in prefill
and in decode steps that write every row's next token to one shared cache column; without the
arguments the forward is unchanged (the fast `is_causal` kernel included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.layers import RotaryEmbedding

LENGTHS = [7, 3, 5]  # rows of different lengths, right-padded to 7
DECODE_STEPS = 4


@pytest.fixture(scope="module", params=["moe", "dense-qk-proj"])
def model(request):
    torch.manual_seed(0)
    overrides = dict(vocab_size=256, max_seq_len=64)
    if request.param == "dense-qk-proj":  # the other attention branches: no MoE, QK-norm over the projection
        overrides.update(n_dense_layers=2, n_layers=2, n_experts=0, expert_dim=0, qk_norm_scope="projection",
                         qkv_bias=True)
    return ColibriForCausalLM(get_preset("tiny", **overrides)).eval()


def _alone(model, row: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits of `row` then each continuation token, one sequence on its own cache."""
    cache = model.new_kv_cache(1, 32)
    out = [model(torch.tensor([row]), cache=cache).logits[0, -1]]
    for token in continuation[:-1]:
        out.append(model(torch.tensor([[token]]), cache=cache).logits[0, -1])
    return torch.stack(out)


@torch.no_grad()
def test_a_padded_batch_gives_each_row_its_own_logits_in_prefill_and_decode(model):
    torch.manual_seed(1)
    rows = [torch.randint(0, 256, (n,)).tolist() for n in LENGTHS]
    continuations = [torch.randint(0, 256, (DECODE_STEPS,)).tolist() for _ in rows]
    B, T = len(rows), max(LENGTHS)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])  # pad id 0: a real token, masked out
    lengths = torch.tensor(LENGTHS)
    real = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    cache = model.new_kv_cache(B, T + DECODE_STEPS)
    logits = model(ids, cache=cache, positions=torch.arange(T).expand(B, T), attention_mask=real).logits
    got = [[logits[r, n - 1]] for r, n in enumerate(LENGTHS)]
    mask = real
    for step in range(DECODE_STEPS - 1):
        # every row's next token goes to the same new column; row r stands at position len_r + step
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.bool)], dim=1)
        token = torch.tensor([[c[step]] for c in continuations])
        out = model(token, cache=cache, positions=(lengths + step)[:, None], attention_mask=mask).logits
        for r in range(B):
            got[r].append(out[r, 0])
    for r, row in enumerate(rows):
        torch.testing.assert_close(torch.stack(got[r]), _alone(model, row, continuations[r]), rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_without_the_arguments_the_forward_is_unchanged(model, monkeypatch):
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (2, 9))
    plain = model(ids).logits
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    again = model(ids, positions=None, attention_mask=None).logits
    assert torch.equal(again, plain)
    assert calls and all(causal and mask is None for causal, mask in calls)  # the fast kernel, no mask
    calls.clear()
    # shared [T] positions and the same positions per row are the same RoPE, bit for bit
    per_row = model(ids, positions=torch.arange(9).expand(2, 9)).logits
    assert torch.equal(per_row, plain)
    calls.clear()
    # an all-True mask is the causal rule alone (an explicit mask kernel: equal to rounding)
    masked = model(ids, attention_mask=torch.ones(2, 9, dtype=torch.bool)).logits
    assert calls and all(mask is not None for _, mask in calls)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-6)
    # 0/1 integers mean the same as booleans
    assert torch.equal(model(ids, attention_mask=torch.ones(2, 9, dtype=torch.long)).logits, masked)


def test_rope_takes_shared_or_per_row_positions():
    rope = RotaryEmbedding(head_dim=8, theta=10_000.0, max_len=32)
    x = torch.randn(2, 3, 4, 8)  # [B, H, T, D]
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    both = rope(x, positions)
    for row in range(2):
        assert torch.equal(both[row : row + 1], rope(x[row : row + 1], positions[row]))


@torch.no_grad()
def test_a_query_with_every_key_hidden_is_not_nan(model):
    ids = torch.randint(0, 256, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)  # row 0 left-padded
    positions = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    logits = model(ids, positions=positions, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    alone = model(ids[:1, 2:]).logits[0]
    torch.testing.assert_close(logits[0, 2:], alone, rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_clear_errors(model):
    ids = torch.randint(0, 256, (2, 4))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, past \+ T\] = \[2, 4\]"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"positions must be \[T\] = \[4\] or \[B, T\] = \[2, 4\]"):
        model(ids, positions=torch.arange(5))


@torch.no_grad()
def test_rows_leaving_the_batch_keep_the_others_exact(model):
    torch.manual_seed(3)
    rows = [torch.randint(0, 256, (n,)).tolist() for n in LENGTHS]
    continuation = torch.randint(0, 256, (3,)).tolist()
    B, T = len(rows), max(LENGTHS)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    lengths = torch.tensor(LENGTHS)
    mask = torch.arange(T + 3)[None, :] < lengths[:, None]
    mask[:, T:] = True  # the decode columns are every row's own
    cache = model.new_kv_cache(B, T + 3)
    model(ids, cache=cache)  # right padding, plain causal prefill: real tokens never see padding
    kept = torch.tensor([2, 0])  # row 1 finished: leave the batch (order changes too)
    cache.select_rows(kept)
    lengths, mask = lengths[kept], mask[kept]
    for step, token in enumerate(continuation):
        out = model(torch.tensor([[token]] * 2), cache=cache, positions=(lengths + step)[:, None],
                    attention_mask=mask[:, : T + step + 1]).logits
    for i, r in enumerate(kept.tolist()):
        want = model(torch.tensor([rows[r] + continuation])).logits[0, -1]
        torch.testing.assert_close(out[i, 0], want, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_a_per_query_mask_packs_two_sequences_in_one_row(model):
    """[B, T, S] masks: two sequences side by side in one row, each seeing only itself, with
    positions restarting at the second, give each its logits alone."""
    torch.manual_seed(2)
    first, second = torch.randint(0, 256, (6,)).tolist(), torch.randint(0, 256, (4,)).tolist()
    ids = torch.tensor([first + second])
    positions = torch.tensor([list(range(6)) + list(range(4))])
    owner = torch.tensor([0] * 6 + [1] * 4)
    mask = (owner[:, None] == owner[None, :])[None]  # [1, 10, 10]; causality is ANDed in
    packed = model(ids, positions=positions, attention_mask=mask).logits[0]
    torch.testing.assert_close(packed[:6], model(torch.tensor([first])).logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[6:], model(torch.tensor([second])).logits[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"\[batch, T, past \+ T\]"):
        model(ids, attention_mask=torch.ones(1, 9, 10, dtype=torch.bool))
