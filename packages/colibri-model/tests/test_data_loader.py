"""The packed loader: deterministic, covers each window once per epoch, resumes from its position."""

from __future__ import annotations

import numpy as np
import pytest
from colibri_model.data import IGNORE_INDEX, LoaderError, LoaderPosition, PackedLoader, TokenSource
from hypothesis import given, settings
from hypothesis import strategies as st


def _source():
    return TokenSource([np.arange(0, 101, dtype=np.uint16), np.arange(1000, 1041, dtype=np.uint16),
                        np.arange(2000, 2005, dtype=np.uint16)])


def test_windows_are_shifted_pairs_and_each_is_seen_once_per_epoch():
    loader = PackedLoader(_source(), seq_len=10, seed=3)
    assert loader.windows == [10, 4, 0]
    x, y = loader.next_batch(14)
    assert x.shape == y.shape == (14, 10)
    assert (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()
    starts = sorted(int(row[0]) for row in x)
    assert starts == sorted(list(range(0, 100, 10)) + list(range(1000, 1040, 10)))
    assert loader.position.epoch == 0
    loader.next_windows(1)
    assert loader.position.epoch == 1


def test_same_seed_same_order_other_seed_other_order():
    a = PackedLoader(_source(), 10, seed=1).next_windows(14)
    assert a == PackedLoader(_source(), 10, seed=1).next_windows(14)
    assert a != PackedLoader(_source(), 10, seed=2).next_windows(14)


def test_resume_from_saved_position_continues_exactly():
    straight = PackedLoader(_source(), 10, seed=5)
    expected = straight.next_windows(40)
    first = PackedLoader(_source(), 10, seed=5)
    got = first.next_windows(17)
    saved = LoaderPosition.model_validate_json(first.position.model_dump_json())
    second = PackedLoader(_source(), 10, seed=0, position=saved)  # the seed comes from the position
    got += second.next_windows(23)
    assert got == expected


def test_loss_mask_sets_ignored_targets():
    tokens = np.arange(12, dtype=np.uint16)
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0], dtype=np.uint8)
    loader = PackedLoader(TokenSource([tokens], [mask]), seq_len=11, shuffle=False)
    x, y = loader.next_batch(1)
    assert x[0].tolist() == list(range(11))
    assert y[0].tolist() == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, IGNORE_INDEX, 6, 7, 8, IGNORE_INDEX,
                             IGNORE_INDEX, IGNORE_INDEX]


def test_errors():
    with pytest.raises(LoaderError, match="needs 201 tokens"):
        PackedLoader(_source(), seq_len=200)
    with pytest.raises(LoaderError, match="saved for seq_len 8"):
        PackedLoader(_source(), seq_len=10, position=LoaderPosition(seq_len=8))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=6), seq_len=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1), split=st.integers(0, 50))
def test_every_window_once_per_epoch_and_resume_anywhere(lengths, seq_len, seed, split):
    source = TokenSource([np.zeros(n, dtype=np.uint16) for n in lengths])
    windows = [max(0, (n - 1) // seq_len) for n in lengths]
    if sum(windows) == 0:
        with pytest.raises(LoaderError):
            PackedLoader(source, seq_len, seed=seed)
        return
    total = sum(windows)
    loader = PackedLoader(source, seq_len, seed=seed)
    first_epoch = loader.next_windows(total)
    assert sorted(first_epoch) == sorted((s, w * seq_len) for s, n in enumerate(windows) for w in range(n))
    straight = PackedLoader(source, seq_len, seed=seed).next_windows(2 * total)
    head = PackedLoader(source, seq_len, seed=seed)
    part = head.next_windows(min(split, 2 * total))
    tail = PackedLoader(source, seq_len, position=head.position).next_windows(2 * total - len(part))
    assert part + tail == straight


@pytest.mark.parametrize("index", [0, 3, 9, 10, 13, 14, 15, 31, 40])
def test_position_at_equals_drawing_that_many_windows(index):
    drawn = PackedLoader(_source(), seq_len=10, seed=5)
    drawn.next_windows(index)
    jumped = PackedLoader(_source(), seq_len=10, seed=5)
    jumped.position = jumped.position_at(index)
    assert jumped.next_windows(20) == drawn.next_windows(20)
    with pytest.raises(LoaderError, match=">= 0"):
        jumped.position_at(-1)
