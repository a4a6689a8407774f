"""Token shard files: round trip, atomic write, and one clear error per kind of damage."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from colibri_model.data import ShardFormatError, read_header, read_shard, write_shard
from colibri_model.data.shards import HEADER_SIZE


def test_round_trip_and_header(tmp_path):
    tokens = np.array([5, 0, 49151, 65535, 7], dtype=np.int64)
    digest = write_shard(tmp_path / "s.bin", tokens, document_count=2)
    assert len(digest) == 64 and not (tmp_path / "s.bin.tmp").exists()
    header = read_header(tmp_path / "s.bin")
    assert (header.token_count, header.document_count, header.version) == (5, 2, "1.0")
    assert read_shard(tmp_path / "s.bin").tolist() == tokens.tolist()
    raw = (tmp_path / "s.bin").read_bytes()
    assert raw[:8] == b"CLBTOKS\0" and len(raw) == HEADER_SIZE + 2 * 5


def test_out_of_range_token_is_refused(tmp_path):
    with pytest.raises(ShardFormatError, match="fit uint16"):
        write_shard(tmp_path / "s.bin", np.array([65536]), 1)


def test_damaged_shards_give_one_clear_error(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(100), 1)
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    with pytest.raises(ShardFormatError, match="truncated"):
        read_shard(path)
    path.write_bytes(b"NOTASHRD" + good[8:])
    with pytest.raises(ShardFormatError, match="not a Colibri token shard"):
        read_shard(path)
    path.write_bytes(good[:8] + struct.pack("<HH", 2, 0) + good[12:])
    with pytest.raises(ShardFormatError, match=r"version 2\.0 is not supported \(this colibri-model reads 1\.0\)"):
        read_shard(path)
    path.write_bytes(good[:10])
    with pytest.raises(ShardFormatError, match="shorter than"):
        read_header(path)
    with pytest.raises(ShardFormatError, match="cannot read"):
        read_header(tmp_path / "missing.bin")
