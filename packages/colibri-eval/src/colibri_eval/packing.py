"""Packed scoring rows: a document's shared context once, its continuations beside it, several
documents per row, no padding between them.

A *segment* is one document's work: a trunk (the token prefix all its requests share; for a
lone request, its whole input) followed by one branch per request (that request's tokens after
the trunk, possibly none). Laid out contiguously in a row:

    columns   | trunk (P) | branch 0 | branch 1 | ... | next segment ... | padding |
    positions   0..P-1      P..        P..              0..                 0

and run in ONE forward with a tree mask: a token sees its segment's trunk and the earlier
tokens of its own branch, nothing else (never another branch, segment or padding). RoPE
positions restart per segment and per branch, so a branch token is computed exactly as in a
plain forward of `trunk + branch`: logits differ by float rounding only (different matmul
shapes), as with any batching.

Why: the work is matmul-bound (a 135M model on CPU spends ~85% of eval time in `linear`), so
time follows tokens computed. Right-padded batches of whole requests compute every
multiple-choice context once per choice plus the batch's padding; a prefix pass followed by a
suffix pass (the KV cache repeated per suffix) still pads both passes. Packing computes each
trunk once and pads only the end of a row: on the bundled samples of the seven tasks this is
~5,100 tokens where lm-eval computes ~10,300 (and the old padded prefix/suffix batches ~8,600).

Rows are filled first-fit-decreasing to `row_tokens` columns; a segment longer than that is split
into pieces that each repeat the trunk with some of its branches (a trunk plus one branch longer
than a row gets a row of its own). The mask is dense per row (`[R, W, W]` booleans), so the
attention's cost grows with W^2: rows are kept short (the scoring engine's `row_tokens`, 256 by
default: on SmolLM2-135M SDPA over masked rows of 512 took ~15% of the eval's time, of 256 about
half that) and several rows go in one forward. Padding columns attend only to themselves: a query with no visible key would make SDPA
return NaN, and a NaN value at a masked key still poisons the softmax-weighted sum (0 * NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """A trunk and its branches; `owners[k]` is what the caller attaches to branch k."""

    trunk: list[int]
    branches: list[list[int]]
    owners: list[object]

    def __len__(self) -> int:
        return len(self.trunk) + sum(len(b) for b in self.branches)


@dataclass
class PackedBatch:
    """One forward's input: ids, positions and the tree mask of `len(rows)` rows of equal width,
    and where each segment's branch starts (`place[(segment, branch)] = (row, trunk column,
    branch column)`)."""

    input_ids: torch.Tensor  # [R, W] long
    positions: torch.Tensor  # [R, W] long
    allowed: torch.Tensor  # [R, W, W] bool: allowed[r, i, j] = query i may see key j
    segments: list[Segment]
    place: dict[tuple[int, int], tuple[int, int, int]]

    def column(self, segment: int, branch: int, position: int) -> tuple[int, int]:
        """(row, column) of input position `position` of branch `branch` of `segment`."""
        row, trunk_at, branch_at = self.place[(segment, branch)]
        trunk = len(self.segments[segment].trunk)
        return (row, trunk_at + position) if position < trunk else (row, branch_at + position - trunk)


def split_segment(segment: Segment, row_tokens: int) -> list[Segment]:
    """Pieces of `segment` of at most `row_tokens` columns where possible, each with the whole
    trunk and at least one branch."""
    if len(segment) <= row_tokens or len(segment.branches) == 1:
        return [segment]
    pieces: list[Segment] = []
    current = Segment(segment.trunk, [], [])
    for branch, owner in zip(segment.branches, segment.owners, strict=True):
        if current.branches and len(current) + len(branch) > row_tokens:
            pieces.append(current)
            current = Segment(segment.trunk, [], [])
        current.branches.append(branch)
        current.owners.append(owner)
    pieces.append(current)
    return pieces


def pack_rows(segments: list[Segment], row_tokens: int) -> list[list[Segment]]:
    """First-fit-decreasing bin packing of segments into rows of `row_tokens` columns (a longer
    segment gets a row of its own), rows in decreasing length order."""
    rows: list[list[Segment]] = []
    room: list[int] = []
    for segment in sorted(segments, key=len, reverse=True):
        size = len(segment)
        for index, free in enumerate(room):
            if size <= free:
                rows[index].append(segment)
                room[index] -= size
                break
        else:
            rows.append([segment])
            room.append(row_tokens - size)
    return sorted(rows, key=lambda row: sum(len(s) for s in row), reverse=True)


def build_batch(rows: list[list[Segment]]) -> PackedBatch:
    """Lay `rows` out as one [R, W] batch (W = the longest row) with its tree mask."""
    width = max(sum(len(s) for s in row) for row in rows)
    n_rows = len(rows)
    ids = torch.zeros((n_rows, width), dtype=torch.long)
    positions = torch.zeros((n_rows, width), dtype=torch.long)
    # per column: which segment (unique across the batch) and which part of it (0 = trunk,
    # k + 1 = branch k); padding gets a segment of its own per column, so it sees only itself
    segment_of = torch.arange(width).repeat(n_rows, 1).neg_().sub_(1)
    part_of = torch.zeros((n_rows, width), dtype=torch.long)
    segments: list[Segment] = []
    place: dict[tuple[int, int], tuple[int, int, int]] = {}
    for r, row in enumerate(rows):
        at = 0
        for segment in row:
            s = len(segments)
            segments.append(segment)
            trunk_at, trunk = at, len(segment.trunk)
            ids[r, at : at + trunk] = torch.tensor(segment.trunk, dtype=torch.long)
            positions[r, at : at + trunk] = torch.arange(trunk)
            segment_of[r, at : at + trunk] = s
            at += trunk
            for k, branch in enumerate(segment.branches):
                place[(s, k)] = (r, trunk_at, at)
                n = len(branch)
                if n:
                    ids[r, at : at + n] = torch.tensor(branch, dtype=torch.long)
                    positions[r, at : at + n] = torch.arange(trunk, trunk + n)
                    segment_of[r, at : at + n] = s
                    part_of[r, at : at + n] = k + 1
                at += n
    column = torch.arange(width)
    causal = column[None, :] <= column[:, None]
    same_segment = segment_of[:, :, None] == segment_of[:, None, :]
    key_part, query_part = part_of[:, None, :], part_of[:, :, None]
    allowed = causal & same_segment & ((key_part == 0) | (key_part == query_part))
    return PackedBatch(ids, positions, allowed, segments, place)


def batches(segments: list[Segment], row_tokens: int, batch_tokens: int) -> list[list[list[Segment]]]:
    """Rows of at most `row_tokens` columns, grouped `batch_tokens // row_tokens` per forward
    (rows of one forward have similar lengths: the packing returns them longest first)."""
    pieces = [piece for segment in segments for piece in split_segment(segment, row_tokens)]
    return fill_batches(pack_rows(pieces, row_tokens), lambda row: sum(len(s) for s in row), batch_tokens)


def fill_batches(ordered: list, length, batch_tokens: int) -> list[list]:
    """Consecutive runs of `ordered` (longest first, by `length(item)`) whose count times their
    first item's length (the padded width) stays within `batch_tokens`; a longer item is a batch
    of its own. The scoring engine batches plain requests the same way."""
    out: list[list] = []
    current: list = []
    for item in ordered:
        if current and (len(current) + 1) * length(current[0]) > batch_tokens:
            out.append(current)
            current = []
        current.append(item)
    if current:
        out.append(current)
    return out
