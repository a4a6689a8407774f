"""packing.py: the layout (ids, positions, tree mask) of packed rows, the first-fit packing and
the splitting of segments longer than a row."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from colibri_eval.packing import Segment, batches, build_batch, pack_rows, split_segment  # noqa: E402


def test_layout_of_one_row_with_two_segments():
    a = Segment([1, 2, 3], [[4, 5], [6]], ["a0", "a1"])
    b = Segment([7, 8], [[]], ["b0"])
    batch = build_batch([[a, b]])
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    # branches restart after the trunk; the next segment restarts at 0
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    allowed = batch.allowed[0].int().tolist()
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0, 0]  # branch 0's second token: trunk + itself
    assert allowed[5] == [1, 1, 1, 0, 0, 1, 0, 0]  # branch 1 never sees branch 0
    assert allowed[7] == [0, 0, 0, 0, 0, 0, 1, 1]  # segment b sees only itself
    assert batch.column(0, 1, 2) == (0, 2)  # a trunk position of branch 1
    assert batch.column(0, 1, 3) == (0, 5)  # its first own token
    assert batch.column(1, 0, 1) == (0, 7)


def test_padding_sees_only_itself():
    batch = build_batch([[Segment([1, 2, 3, 4], [[]], [0])], [Segment([5], [[6]], [1])]])
    assert batch.input_ids.shape == (2, 4)
    assert batch.allowed[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert bool(batch.allowed.any(-1).all())  # no query without a visible key (SDPA would NaN)


def test_split_repeats_the_trunk_and_keeps_every_branch():
    segment = Segment([1] * 6, [[2] * 3, [3] * 3, [4] * 3, [5] * 9], list("abcd"))
    pieces = split_segment(segment, 12)
    assert [p.owners for p in pieces] == [["a", "b"], ["c"], ["d"]]
    assert all(p.trunk == segment.trunk for p in pieces)
    assert [len(p) for p in pieces] == [12, 9, 15]  # the last is longer than a row: a row of its own


def test_first_fit_decreasing_and_batches():
    segments = [Segment([i] * n, [[]], [i]) for i, n in enumerate([5, 3, 7, 2, 4, 1])]
    rows = pack_rows(segments, 8)
    assert sorted(sum(len(s) for s in row) for row in rows) == [6, 8, 8]
    assert sum(len(s) for row in rows for s in row) == 22
    grouped = batches(segments, row_tokens=8, batch_tokens=16)
    assert [len(b) for b in grouped] == [2, 1]
