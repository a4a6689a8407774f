"""`Engine.packed_logits`: sequences side by side in rows under a per-query mask (what colibri-eval's
packed scoring sends) give each sequence the logits it has alone, also when the batch runs in
several column chunks (a small budget's prefill_chunk); bad shapes are refused."""

from __future__ import annotations

import pytest
import torch
from colibri_stream import Engine


def _packed(sequences_per_row: list[list[list[int]]]):
    width = max(sum(len(s) for s in row) for row in sequences_per_row)
    rows = len(sequences_per_row)
    ids = torch.zeros((rows, width), dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    owner = torch.arange(width).repeat(rows, 1).neg() - 1  # padding: a sequence of its own per column
    for r, row in enumerate(sequences_per_row):
        at = 0
        for s, seq in enumerate(row):
            ids[r, at : at + len(seq)] = torch.tensor(seq)
            positions[r, at : at + len(seq)] = torch.arange(len(seq))
            owner[r, at : at + len(seq)] = s
            at += len(seq)
    return ids, positions, owner[:, :, None] == owner[:, None, :]


@pytest.mark.parametrize("budget", ["full", "minimum"])
def test_packed_rows_give_each_sequence_its_own_logits(tiny, minimum_budget, budget):
    ram = "200MB" if budget == "full" else minimum_budget(tiny[0])
    torch.manual_seed(3)
    layout = [[torch.randint(5, 200, (n,)).tolist() for n in lengths] for lengths in ([9, 5, 7], [12, 3])]
    ids, positions, mask = _packed(layout)
    wanted = [(r, c) for r in range(ids.shape[0]) for c in range(ids.shape[1]) if c % 2 == 0 or c > 15]
    rows, cols = torch.tensor([r for r, _ in wanted]), torch.tensor([c for _, c in wanted])
    with Engine.open(tiny[0], ram_budget=ram, prefill_chunk=8) as engine:  # 2 rows: chunks of 4 columns
        got = engine.packed_logits(ids, positions, mask, rows, cols)
        assert got.shape == (len(wanted), engine.model.config.vocab_size)
        alone = {}
        for r, row in enumerate(layout):
            at = 0
            for seq in row:
                logits = engine.logits(seq)
                for i in range(len(seq)):
                    alone[r, at + i] = logits[i]
                at += len(seq)
        for n, (r, c) in enumerate(wanted):
            if (r, c) in alone:  # padding columns are not compared
                torch.testing.assert_close(got[n], alone[r, c], rtol=1e-4, atol=1e-4)


def test_packed_logits_refuses_bad_shapes(tiny):
    ids, positions, mask = _packed([[[5, 6, 7]]])
    with Engine.open(tiny[0], ram_budget="200MB") as engine:
        with pytest.raises(ValueError, match=r"attention_mask \[B, T, T\]"):
            engine.packed_logits(ids, positions, mask[:, :2], torch.tensor([0]), torch.tensor([0]))
        with pytest.raises(ValueError, match="max_context"):
            engine.packed_logits(ids, positions + engine.max_context, mask, torch.tensor([0]), torch.tensor([0]))
